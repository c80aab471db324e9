"""Proposers: where draft tokens come from (like ORT-GenAI's Propose / Advance / Reset).

The protocol a user's own proposer implements (only ``propose`` is required)::

    class MyProposer:
        name = "mine"
        def propose(self, context: list[int], k: int) -> list[int] | Proposal: ...
        def advance(self, committed: list[int]) -> None: ...      # tokens the engine committed
        def reset(self, generator) -> None: ...                   # a new generation starts

``context`` is the committed sequence plus the pending token (whose KV is not written yet); a
proposal is up to ``k`` token ids that continue it. Capabilities are declared, never sniffed:
``free_guess = True`` says that a one-token proposal costs nothing, so the engine may compare
it with the token a plain step produced (evidence for the gate at no cost); ``drafts_hidden``
says the proposal carries depth-d hidden states that the draft+verify_tail strategy continues.
A proposal may carry ``evidence``, a small integer saying how strongly its drafts are supported
(prompt lookup: the length of the context suffix its source matched); the cost gate keeps an
acceptance per evidence and verifies as many drafts as that acceptance pays for.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np
from loopcast.ort_runtime.decoding.protocols import ProposerBase, ProposerCaps

from loopcast.errors import RequestError
from loopcast.manifest import DRAFT


@dataclass(frozen=True)
class Branch:
    """An alternate suffix (docs/architecture.md §5, "Alternate suffix"): ``tokens[0]`` competes
    with the proposal's draft ``fork`` for the same position, and the rest continue it."""

    fork: int  # index into Proposal.tokens of the draft that tokens[0] replaces
    tokens: list[int]  # the branch's drafts (tokens[0]: the runner-up at the fork)
    hidden: np.ndarray  # [len(tokens), H]: their depth-d states


def _continued_length(gen, context: Sequence[int]) -> int:
    """The generator's committed length, checked against a self-draft context (its sequence and
    the pending token)."""
    if len(context) != gen.n + 1:
        raise RequestError(
            f"self-drafts continue the generator's sequence: context of {len(context)} "
            f"tokens for {gen.n} committed"
        )
    return gen.n


@dataclass(frozen=True)
class Proposal:
    tokens: list[int]  # up to k drafts continuing the context
    hidden: np.ndarray | None = None  # [len(tokens) + 1, H]: depth-d states of pending + drafts
    probs: list[np.ndarray] | None = None  # sampled drafts: the distribution each was drawn from
    branch: Branch | None = None  # at most one alternate suffix (AlternateDraftProposer)
    fork_skipped: bool = False  # a near tie whose branch did not fit the width or the KV
    evidence: int | None = None  # how strongly the drafts are supported (module doc)

    def first(self, keep: int) -> Proposal:
        """The first ``keep`` drafts, with their distributions and states."""
        probs = self.probs[:keep] if self.probs is not None else None
        hidden = self.hidden[: keep + 1] if self.hidden is not None else None
        return replace(self, tokens=self.tokens[:keep], probs=probs, hidden=hidden)


class PromptLookupProposer(ProposerBase):
    """Drafts by n-gram match: find the latest earlier occurrence of the last n tokens
    (n from ``max_ngram`` down to ``min_ngram``) and propose what followed it. The proposal's
    evidence is how many tokens before that occurrence agree with the context's end (n, and
    further back up to ``MAX_EVIDENCE``): a continuation found after a one-token match is
    right far less often than one after a long copied run, and the gate prices them apart."""

    MAX_EVIDENCE = 16

    name = "prompt-lookup"
    caps = ProposerCaps(free_guess=True)

    def __init__(self, min_ngram: int = 1, max_ngram: int = 6) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise RequestError(
                f"prompt lookup needs 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}"
            )
        self.min_ngram, self.max_ngram = min_ngram, max_ngram
        self.reset(None)

    def reset(self, generator) -> None:
        self._seq: list[int] = []
        # n -> {n-gram: latest start followed by at least one token}; a proposal is then a dict
        # lookup per n instead of a scan of the whole context on every step.
        self._index: dict[int, dict[tuple[int, ...], int]] = {
            n: {} for n in range(self.min_ngram, self.max_ngram + 1)
        }

    def _sync(self, context: Sequence[int]) -> None:
        # Within a generation the context only grows (reset() starts the next one), so a check
        # of the length and the last indexed token catches a rewound or different sequence
        # without comparing the whole context on every step.
        seq = self._seq
        if len(context) < len(seq) or (seq and context[len(seq) - 1] != seq[-1]):
            self.reset(None)
            seq = self._seq
        for i in range(len(seq), len(context)):
            seq.append(int(context[i]))
            for n, index in self._index.items():
                if i - n >= 0:
                    index[tuple(seq[i - n : i])] = i - n

    def propose(self, context: Sequence[int], k: int) -> Proposal:
        self._sync(context)
        seq = self._seq
        for n in range(min(self.max_ngram, len(seq) - 1), self.min_ngram - 1, -1):
            start = self._index[n].get(tuple(seq[-n:]))
            if start is not None:
                matched = n  # extend the match backwards: seq[start - j] against seq[-n - 1 - j]
                while (
                    matched < self.MAX_EVIDENCE
                    and start - (matched - n) > 0
                    and seq[start - (matched - n) - 1] == seq[-matched - 1]
                ):
                    matched += 1
                return Proposal(seq[start + n : start + n + k], evidence=matched)
        return Proposal([])


class SelfDraftProposer(ProposerBase):
    """Shallow-loop self-speculation: the draft graph runs loops 0..d-1 for the pending token
    and then each draft, one row at a time at positions n, n+1, …, writing their depth<d KV
    and keeping each row's depth-d state for verify_tail (``ort_runtime/decoding/verifiers.py``).

    ``perturb(position, token) -> token`` may replace a drafted token before it is fed to the
    next draft row — the adversarial tests use it to force rejections mid-chain.
    """

    name = "self"
    caps = ProposerCaps(drafts_hidden=True, draws=True)

    def __init__(self, perturb=None) -> None:
        self.perturb = perturb
        self._gen = None
        self.acceptor = None  # the engine's (acceptors.py): greedy drafts, or sampled ones

    def bind(self, acceptor) -> None:
        self.acceptor = acceptor

    def reset(self, generator) -> None:
        if not generator.has_kind(DRAFT):
            raise RequestError(
                "self-speculation needs the draft graph, which this artifact lacks "
                "(it needs a looped model, R > 1)"
            )
        self._gen = generator

    def propose(self, context: Sequence[int], k: int) -> Proposal:
        gen = self._gen
        n = _continued_length(gen, context)
        vocab = gen.model.config.vocab_size
        sampled = self.acceptor is not None and self.acceptor.sampled
        rows_in, hidden, probs = [int(context[-1])], [], []
        for i in range(k + 1):
            out = gen.run(DRAFT, n + i, tokens=[rows_in[i]], want_logits=sampled and i < k)
            hidden.append(out.hidden[0])
            if i < k:
                token = int(out.next_ids[0])
                if sampled:  # x_{i+1} ~ q_i, the processed distribution of the depth-d row
                    token, q = self.acceptor.draft(token, out.logits[0], list(context) + rows_in[1:])
                    probs.append(q)
                if self.perturb is not None:
                    token = int(self.perturb(i, token))
                if not 0 <= token < vocab:
                    raise RequestError(f"self-draft token {token} is outside the vocabulary [0, {vocab})")
                rows_in.append(token)
        return Proposal(rows_in[1:], np.stack(hidden), probs if sampled else None)


class AlternateDraftProposer(ProposerBase):
    """Self-speculation with one fallback branch per round (docs/architecture.md §5,
    "Alternate suffix"). The primary chain is drafted as SelfDraftProposer drafts it, row by
    row through the ``tree_draft`` graph at positions n, n+1, …; at the first draft row whose
    top-1/top-2 probability gap (full softmax) is below ``gap``, the runner-up token starts a
    branch that is drafted after the primary chain, its rows at scratch positions past it
    (n+k+1, …) with the primary's rows after the fork masked, so each branch row computes what
    the decode row at its logical position computes.

    The branch has at most ``min(k - fork, width - (k+1), capacity left - (k+1))`` rows (it
    covers no position the primary chain does not, and it shares the verify width); when that is
    0 the round stays primary-only and says so (``Proposal.fork_skipped``).

    Test hooks, through the same interface: ``fork_hook(position, token, top2_ids, gap)`` replaces
    the gap rule at each primary draft row (``position`` is the drafted token's) and returns
    ``(primary, alternate)`` to fork there with those tokens, or None; ``perturb(branch, position,
    token)`` replaces any other drafted token (``branch``: "primary" or "alternate").
    """

    name = "self+alternate"
    caps = ProposerCaps(drafts_hidden=True)

    def __init__(self, gap: float, *, fork_hook=None, perturb=None) -> None:
        if not 0.0 < gap <= 1.0:
            raise RequestError(f"alternate_gap must be a probability gap in (0, 1], got {gap}")
        self.gap, self.fork_hook, self.perturb = gap, fork_hook, perturb
        self._gen = None

    def reset(self, generator) -> None:
        from loopcast.manifest import TREE_KINDS

        missing = [k for k in TREE_KINDS if not generator.has_kind(k)]
        if missing:
            raise RequestError(
                f"the alternate suffix needs the {' and '.join(TREE_KINDS)} graphs; this artifact "
                "lacks them (re-export with --tree-verify)"
            )
        self._gen = generator

    def _token(self, token: int, branch: str, position: int) -> int:
        if self.perturb is not None:
            token = int(self.perturb(branch, position, token))
        return self._check(token)

    def _check(self, token: int) -> int:
        vocab = self._gen.model.config.vocab_size
        if not 0 <= token < vocab:
            raise RequestError(f"alternate-suffix draft token {token} is outside the vocabulary [0, {vocab})")
        return token

    def _fork(self, position: int, token: int, out) -> tuple[int, int] | None:
        """(primary, alternate) when the draft row at ``position - 1`` is a near tie, else None."""
        ids, probs = [int(t) for t in out.top2_ids], out.top2_probs
        gap = float(probs[0] - probs[1])
        if self.fork_hook is not None:
            forced = self.fork_hook(position, token, ids, gap)
            return None if forced is None else (self._check(int(forced[0])), self._check(int(forced[1])))
        runner_up = (
            ids[1] if ids[0] == token else ids[0]
        )  # TopK and ArgMax may order an exact tie differently
        return (token, runner_up) if gap < self.gap and runner_up != token else None

    def propose(self, context: Sequence[int], k: int) -> Proposal:
        from loopcast.manifest import TREE_DRAFT, TREE_TAIL

        gen = self._gen
        n = _continued_length(gen, context)
        # Rows the tree verify may use: its width, and no row past the KV capacity.
        room = min(gen.rows(TREE_TAIL), gen.max_length - n) - (k + 1)
        rows_in, hidden, fork, skipped = [int(context[-1])], [], None, False
        for i in range(k + 1):
            out = gen.run_rows(TREE_DRAFT, [(n + i, 0, 0)], tokens=[rows_in[i]])
            hidden.append(out.hidden[0])
            if i == k:
                break
            token = self._token(int(out.next_ids[0]), "primary", n + i + 1)
            if fork is None and not skipped:
                tie = self._fork(n + i + 1, token, out)
                if tie is not None:
                    token = tie[0]
                    rows = min(room, k - i)
                    fork, skipped = ((i, tie[1], rows), False) if rows >= 1 else (None, True)
            rows_in.append(token)
        branch = self._branch(n, k, *fork) if fork is not None else None
        return Proposal(rows_in[1:], np.stack(hidden), branch=branch, fork_skipped=skipped)

    def _branch(self, n: int, k: int, fork: int, first: int, rows: int) -> Branch:
        """Draft the branch at scratch positions n+k+1.. with the primary rows after the fork
        (positions n+fork+1..n+k) masked: its logical positions are n+fork+1.."""
        from loopcast.manifest import TREE_DRAFT

        lo, hi = n + fork + 1, n + k + 1
        tokens, hidden = [first], []
        for j in range(rows):
            out = self._gen.run_rows(TREE_DRAFT, [(hi + j, lo, hi)], tokens=[tokens[j]])
            hidden.append(out.hidden[0])
            if j < rows - 1:
                tokens.append(self._token(int(out.next_ids[0]), "alternate", lo + j + 1))
        return Branch(fork, tokens, np.stack(hidden))


class UserProposer(ProposerBase):
    """Adapts a user's object and validates what it offers at the boundary. The user's object
    is foreign, so this is the one place that reads what it has: ``propose`` (required),
    ``advance``/``reset`` (optional), and its declared ``name``, ``free_guess`` and
    ``drafts_hidden`` (the documented user protocol, module doc); inside the engine the
    adapter's own ``caps`` say what it offers."""

    def __init__(self, inner, vocab_size: int, hidden_size: int | None = None) -> None:
        declared = {name: getattr(inner, name, None) for name in _USER_PROTOCOL}
        if not callable(declared["propose"]):
            raise RequestError(f"proposer {inner!r} has no propose(context, k) method", parameter="proposer")
        self.inner, self.vocab_size, self.hidden_size = inner, vocab_size, hidden_size
        self.name = str(declared["name"] or type(inner).__name__)
        self.caps = ProposerCaps(
            drafts_hidden=bool(declared["drafts_hidden"]), free_guess=bool(declared["free_guess"])
        )
        self._advance = declared["advance"] if callable(declared["advance"]) else None
        self._reset = declared["reset"] if callable(declared["reset"]) else None

    def _refuse(self, what: str) -> RequestError:
        return RequestError(f"proposer {self.name!r} {what}", parameter="proposer")

    def propose(self, context: Sequence[int], k: int) -> Proposal:
        raw = self.inner.propose(list(context), k)
        if raw is None:
            raw = []
        if isinstance(raw, Proposal):
            tokens_in, hidden_in = raw.tokens, raw.hidden
        elif isinstance(raw, (list, tuple)) or (isinstance(raw, np.ndarray) and raw.ndim == 1):
            tokens_in, hidden_in = raw, None
        else:
            raise self._refuse(
                f"returned {type(raw).__name__}; propose(context, k) returns a list of token ids "
                "(or a Proposal)"
            )
        tokens = self._token_ids(tokens_in)[:k]
        if self.caps.drafts_hidden:
            hidden_in = self._hidden(hidden_in, len(tokens))
        hidden = hidden_in[: len(tokens) + 1] if hidden_in is not None else None
        return Proposal(tokens, hidden)

    def _token_ids(self, raw) -> list[int]:
        if isinstance(raw, np.ndarray):
            if raw.ndim != 1 or not np.issubdtype(raw.dtype, np.integer):
                raise self._refuse(f"offered an array of {raw.dtype} {raw.shape}; token ids are integers")
            raw = raw.tolist()
        if not isinstance(raw, (list, tuple)):
            raise self._refuse(f"offered tokens as {type(raw).__name__}; token ids come as a list")
        for t in raw:
            if isinstance(t, bool) or not isinstance(t, (int, np.integer)):
                raise self._refuse(f"offered {t!r} ({type(t).__name__}); token ids are integers")
            if not 0 <= t < self.vocab_size:
                raise self._refuse(f"offered a token outside the vocabulary [0, {self.vocab_size})")
        return [int(t) for t in raw]

    def _hidden(self, hidden, drafts: int):
        """The depth-d states a ``drafts_hidden`` proposer owes: [drafts + 1, H] floating point."""
        if hidden is None:
            raise self._refuse("declares drafts_hidden but gave no hidden state per row")
        if not isinstance(hidden, np.ndarray) or not np.issubdtype(hidden.dtype, np.floating):
            raise self._refuse(
                f"gave hidden states as {type(hidden).__name__}"
                + (f" of {hidden.dtype}" if isinstance(hidden, np.ndarray) else "")
                + "; they are a floating-point numpy array [drafts + 1, hidden]"
            )
        width = self.hidden_size
        if hidden.ndim != 2 or len(hidden) < drafts + 1 or (width is not None and hidden.shape[1] != width):
            raise self._refuse(
                f"gave hidden states of shape {hidden.shape}; {drafts} drafts need "
                f"[{drafts + 1}, {width if width is not None else 'hidden'}] (one row per pending token "
                "and draft)"
            )
        if not np.isfinite(hidden[: drafts + 1]).all():
            raise self._refuse("gave hidden states that are not finite")
        return hidden

    def advance(self, committed: Sequence[int]) -> None:
        if self._advance is not None:
            self._advance(list(committed))

    def reset(self, generator) -> None:
        if self._reset is not None:
            self._reset(generator)


# What a user's proposer may have (the module doc): read once, by UserProposer.
_USER_PROTOCOL = ("propose", "advance", "reset", "name", "free_guess", "drafts_hidden")
