"""Sampled decoding: plain, and lossless speculative rounds (prompt lookup, self-speculation).

Kept apart from the greedy engine's loop (ort_runtime/speculate.py), whose gates, proposers,
verify graphs and exactness rule it uses; the next step folds it into that loop as an *acceptor*
strategy: ``SampledAcceptor`` replaces ``greedy_accept``
(it turns logits rows into processed distributions and applies the rejection rule of
ort_runtime/sampling.py), and the two round functions are the greedy rounds with that acceptor.

Finish semantics are speculate.stream's: "eos" (a stop id, yielded) or "length"; on finish
``n`` covers the prefix, the input and every yielded token but the last (pending, no KV); a
consumer that stops early leaves ``n`` the same way.

Self-speculation round with sampling (draft depth d, K drafts): row i of the draft graph (token
x_i, x_0 = pending) writes depth<d KV at n+i and gives q_i, the processed distribution of its
depth-d logits; x_{i+1} ~ q_i. verify_tail over the K+1 depth-d states writes depth>=d KV and
gives p_0..p_K. ``speculative_accept`` → a drafts kept plus one token drawn from the residual
(or the bonus row); commit pending + x_1..x_a. Rows past the accepted ones hold stale KV at
positions >= the new n, which the next round rewrites before any row reads them (the greedy
round's invariant, unchanged by sampling).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np

from loopcast.errors import RequestError
from loopcast.manifest import DECODE, DRAFT, PREFILL, VERIFY, VERIFY_TAIL
from loopcast.ort_runtime.gates import GATES, AlwaysGate, CostGate, HitDensityGate, StepCosts
from loopcast.ort_runtime.generator import Generator
from loopcast.ort_runtime.proposers import PromptLookupProposer
from loopcast.ort_runtime.sampling import SamplingParams, make_rng, probabilities, sample, speculative_accept
from loopcast.ort_runtime.speculate import Finisher, GenerationStats
from loopcast.ort_runtime.verifiers import DraftTail, VerifyRows

MODES = ("none", "prompt-lookup", "self")


class SampledAcceptor:
    """Sampling's side of a round: distributions from logits rows, draws, the rejection rule.
    One per request; it owns the request's random stream."""

    def __init__(self, params: SamplingParams, rng: np.random.Generator | None = None) -> None:
        self.params = params
        self.rng = rng if rng is not None else make_rng(params)

    def distribution(self, logits_V: np.ndarray, context: Sequence[int]) -> np.ndarray:
        return probabilities(logits_V, self.params, context)

    def draw(self, logits_V: np.ndarray, context: Sequence[int]) -> int:
        """The next token after ``context`` from its logits row (plain decoding)."""
        return sample(self.distribution(logits_V, context), self.rng)

    def accept(self, context: Sequence[int], drafts: Sequence[int], target_logits: np.ndarray,
               draft_probs: Sequence[np.ndarray] | None = None) -> tuple[int, int]:
        """``context`` ends with the pending token; ``target_logits[i]`` scores the token after
        ``context + drafts[:i]``. Returns (accepted drafts, next token)."""
        return speculative_accept(drafts, draft_probs, _Rows(self, target_logits, list(context), list(drafts)),
                                  self.rng)


class _Rows:
    """Target distributions made on first use: the rule reads rows only up to the first
    rejection, and a row costs ~1 ms at V = 128k (docs/sampling.md)."""

    def __init__(self, acceptor: SampledAcceptor, logits: np.ndarray, context: list[int], drafts: list[int]) -> None:
        self.acceptor, self.logits, self.context, self.drafts = acceptor, logits, context, drafts
        self._made: dict[int, np.ndarray] = {}

    def __len__(self) -> int:
        return len(self.drafts) + 1

    def __getitem__(self, i: int) -> np.ndarray:
        if i not in self._made:
            self._made[i] = self.acceptor.distribution(self.logits[i], self.context + self.drafts[:i])
        return self._made[i]


def sampled_stream(gen: Generator, ids: list[int], max_new_tokens: int, *, sampling: SamplingParams,
                   stop_ids: tuple[int, ...] = (), mode: str = "none", num_draft_tokens: int | None = None,
                   gate: str = "auto", proposer=None, stats: GenerationStats | None = None,
                   acceptor: SampledAcceptor | None = None) -> Iterator[int]:
    """Feed ``ids`` after the committed prefix and yield sampled tokens as they are committed.
    ``acceptor`` replaces the default ``SampledAcceptor(sampling)`` (tests inject wrong rules)."""
    stats = stats if stats is not None else GenerationStats()
    if mode not in MODES:
        raise RequestError(f"unknown speculative mode {mode!r}; choose from {', '.join(MODES)}")
    if gate not in GATES:
        raise RequestError(f"unknown gate {gate!r}; choose from {', '.join(GATES)}")
    if gate == "cost" and sampling.seed is not None:
        # Greedy tokens do not depend on which steps speculate; sampled ones do (the modes use
        # the random stream differently), and the cost gate decides on measured times.
        raise RequestError("--gate cost decides on measured step times, so seeded sampling would not be "
                           "reproducible; use --gate hit-density or none with --seed (or drop --seed)")
    if max_new_tokens < 0:
        raise RequestError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    if not ids:
        raise RequestError("prompt is empty: give at least one token")
    gen.validate_ids(ids)
    k_max = _check_mode(gen, mode, num_draft_tokens, proposer)
    if mode == "prompt-lookup" and proposer is None:
        proposer = PromptLookupProposer()
    acceptor = acceptor if acceptor is not None else SampledAcceptor(sampling)
    stats.prompt_tokens, stats.speculative, stats.gate = len(ids), mode, gate
    finish = Finisher(gen, stats, len(ids), max_new_tokens, stop_ids)
    if max_new_tokens == 0:
        finish("length")
        return
    try:
        yield from _loop(gen, ids, mode, proposer, acceptor, stats, finish, _gate(gen, gate, mode, k_max))
    finally:
        finish.abandoned()


def _check_mode(gen: Generator, mode: str, num_draft_tokens: int | None, proposer) -> int:
    if mode == "none":
        return 0
    kind = VERIFY_TAIL if mode == "self" else VERIFY
    if not gen.has_kind(kind) or (mode == "self" and not gen.has_kind(DRAFT)):
        raise RequestError(f"speculative mode {mode!r} needs the {kind} graph, which this artifact "
                           "lacks (self-speculation needs a looped model, R > 1)")
    if mode == "self" and proposer is not None:
        raise RequestError("sampled self-speculation drafts from the draft graph; it takes no proposer")
    width = gen.rows(kind)
    k = num_draft_tokens if num_draft_tokens is not None else width - 1
    if not 1 <= k <= width - 1:
        raise RequestError(f"--num-draft-tokens must be in 1..{width - 1} (verify width {width}), got {k}")
    return k


def _gate(gen: Generator, name: str, mode: str, k_max: int):
    """The greedy loop's gates, unchanged: whether a step speculates depends only on the past
    (acceptances, would-hit counts, step costs), so every step keeps plain sampling's
    distribution whichever way the gate goes. Host sampling time is not in the step costs."""
    if mode == "none":
        return None
    if name == "hit-density" or name == "auto":
        # auto: sampled tokens depend on which steps speculate, so the default gate must decide
        # on the tokens alone (reproducible with a seed), not on measured times.
        return HitDensityGate(k_max, chosen_by="auto" if name == "auto" else "caller")
    if name == "cost":
        share = (gen.model.manifest.draft_depth or 1) / gen.model.config.num_loops
        return CostGate(k_max, StepCosts(gen, share), DraftTail() if mode == "self" else VerifyRows(),
                        free_guess=mode == "prompt-lookup")
    return AlwaysGate(k_max)


def _prefill(gen: Generator, ids: list[int]) -> np.ndarray:
    """Generator.prefill, keeping the last row's logits (a copy: the buffer is reused)."""
    out = gen.run(PREFILL, gen.n, tokens=ids, want_logits=True)
    gen.commit(ids)
    return np.array(out.logits[-1], dtype=np.float32)


def _loop(gen: Generator, ids: list[int], mode: str, proposer, acceptor: SampledAcceptor,
          stats: GenerationStats, finish: Finisher, gate) -> Iterator[int]:
    pending = acceptor.draw(_prefill(gen, ids), gen.tokens)
    new_tokens, step = [pending], 0
    width = gen.rows(VERIFY_TAIL if mode == "self" else VERIFY) if mode != "none" else None
    while not (yield from finish.emit(new_tokens)):
        step += 1
        new_tokens = None
        k = gate.engage(step) if gate is not None else None
        if k and gen.n + width <= gen.max_length:
            k = min(k, width - 1, finish.remaining)
            if mode == "self":
                outcome = self_draft_round(gen, acceptor, pending, k)
            else:
                outcome = prompt_lookup_round(gen, acceptor, proposer, pending, k)
            if outcome is not None:
                new_tokens, proposed, accepted = outcome
                _count(stats, proposed, accepted)
                gate.observe(proposed, accepted, step=step)
        if new_tokens is None:
            context = gen.tokens + [pending]
            guess = proposer.propose(context, 1) if gate is not None and mode == "prompt-lookup" else None
            out = gen.run(DECODE, gen.n, tokens=[pending], want_logits=True)
            gen.commit([pending])
            new_tokens = [acceptor.draw(out.logits[0], context)]
            if guess is not None:  # free evidence for the gate, as in the greedy loop
                gate.observe(0, 0, would_hit=bool(guess) and guess[0] == new_tokens[0], step=step)
        pending = new_tokens[-1]
        stats.gate_transitions = getattr(gate, "transitions", 0)


def prompt_lookup_round(gen: Generator, acceptor: SampledAcceptor, proposer, pending: int,
                        k: int) -> tuple[list[int], int, int] | None:
    """Deterministic drafts (q one-hot) verified in one verify step → (new tokens, proposed,
    accepted), or None when the proposer has nothing (the caller decodes)."""
    context = gen.tokens + [pending]
    drafts = [int(t) for t in proposer.propose(context, k)][:k]
    if not drafts:
        return None
    vocab = gen.model.config.vocab_size
    if any(not 0 <= t < vocab for t in drafts):
        raise RequestError(f"proposer {getattr(proposer, 'name', proposer)!r} offered a token outside the vocabulary")
    verified = gen.run(VERIFY, gen.n, tokens=[pending] + drafts, want_logits=True)
    accepted, nxt = acceptor.accept(context, drafts, verified.logits)
    gen.commit([pending] + drafts[:accepted])
    return drafts[:accepted] + [nxt], len(drafts), accepted


def self_draft_round(gen: Generator, acceptor: SampledAcceptor, pending: int,
                     k: int) -> tuple[list[int], int, int]:
    """Drafts sampled from the draft graph's distributions, verified by verify_tail (see the
    module docstring for the KV invariant) → (new tokens, proposed, accepted)."""
    n, context = gen.n, gen.tokens + [pending]
    rows_in, hidden, qs = [pending], [], []
    for i in range(k + 1):
        out = gen.run(DRAFT, n + i, tokens=[rows_in[i]], want_logits=i < k)
        hidden.append(out.hidden[0])
        if i < k:
            q = acceptor.distribution(out.logits[0], context + rows_in[1:])
            qs.append(q)
            rows_in.append(sample(q, acceptor.rng))
    drafts = rows_in[1:]
    verified = gen.run(VERIFY_TAIL, n, hidden=np.stack(hidden), want_logits=True)
    accepted, nxt = acceptor.accept(context, drafts, verified.logits, qs)
    gen.commit([pending] + drafts[:accepted])
    return drafts[:accepted] + [nxt], len(drafts), accepted


def _count(stats: GenerationStats, proposed: int, accepted: int) -> None:
    stats.rounds += 1
    stats.proposed += proposed
    stats.accepted += accepted
    for i in range(proposed):
        if len(stats.proposed_by_position) <= i:
            stats.proposed_by_position.append(0)
            stats.accepted_by_position.append(0)
        stats.proposed_by_position[i] += 1
        stats.accepted_by_position[i] += int(i < accepted)
