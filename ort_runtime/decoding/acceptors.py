"""Acceptors: greedy or sampled — how the engine's rounds turn the graphs' rows into tokens.

The speculation engine (ort_runtime/decoding/speculate.py) runs one round loop; the acceptor is the one
place where greedy decoding and sampling differ:

    first(gen, ids)                 prefill, then the first token (argmax on the device / a draw)
    decode(gen, pending, context)   a plain step's token
    draft(token, logits, context)   a drafted token and the distribution it came from (None: greedy)
    accept(context, proposal, ver.) a round's accepted prefix and next token (``greedy_accept`` /
                                    the rejection rule of ort_runtime/decoding/sampling.py)
    check(draft, q, target, logits, context)   the same rule for one draft (the pipeline's lanes)
    choose(argmax, logits, context) a plain row's token (the batching engine's rows)

``accept_round`` is the one accept path of both engines (ort_runtime/decoding/speculate.py and
ort_runtime/batching/engine.py); ``SampledAcceptor.draw`` the one place a token is drawn.

``context`` is always the sequence before the token being decided (the repetition penalty
reads it). Greedy never pulls logits it does not need: its tokens are the device's argmax.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from loopcast.ort_runtime.decoding.greedy_accept import (
    AcceptResult,
    TieGuard,
    greedy_accept,
    greedy_accept_tree,
)
from loopcast.ort_runtime.decoding.sampling import (
    SamplingParams,
    make_rng,
    probabilities,
    sample,
    speculative_accept,
)
from loopcast.ort_runtime.decoding.verifiers import PlainDecode

from loopcast.manifest import PREFILL


def accept_round(acceptor, context: Sequence[int], proposal, verified) -> tuple[AcceptResult, list[int]]:
    """A round's verdict, for one sequence and for each request of a batch alike: the accept
    result and the tokens emitted after the pending one (accepted drafts + the next token).
    ``context`` ends with the pending token."""
    result = acceptor.accept(context, proposal, verified)
    return result, list(proposal.tokens[: result.accepted]) + [result.next_token]


class GreedyAcceptor:
    sampled = False

    def __init__(self, tie_guard: TieGuard = TieGuard()) -> None:
        self.tie_guard = tie_guard
        self._plain = PlainDecode()

    def first(self, gen, ids: list[int]) -> int:
        return gen.prefill(ids)

    def decode(self, gen, pending: int, context: Sequence[int]) -> int:
        return self._plain.step(gen, pending)

    def draft(self, token: int, logits: np.ndarray | None, context: Sequence[int]) -> tuple[int, None]:
        return int(token), None

    def choose(self, argmax_id: int, logits_V: np.ndarray | None, context: Sequence[int]) -> int:
        """A plain row's token: the device's argmax (greedy pulls no logits)."""
        return int(argmax_id)

    def accept(self, context: Sequence[int], proposal, verified) -> AcceptResult:
        guard = self.tie_guard
        if proposal.branch is not None:
            return greedy_accept_tree(
                proposal.tokens,
                verified.target_ids,
                proposal.branch,
                verified.branch_ids,
                verified.logits,
                epsilon=guard.epsilon,
                tolerant=guard.tolerant,
            )
        return greedy_accept(
            proposal.tokens,
            verified.target_ids,
            verified.logits,
            epsilon=guard.epsilon,
            tolerant=guard.tolerant,
        )

    def check(
        self, draft: int, q, target: int, logits: np.ndarray | None, context: Sequence[int]
    ) -> tuple[bool, int]:
        return draft == target, target


class SampledAcceptor:
    """Sampling's side of a round: processed distributions from logits rows, draws, and the
    rejection rule. One per request; it owns the request's random stream."""

    sampled = True

    def __init__(self, params: SamplingParams, rng: np.random.Generator | None = None) -> None:
        self.params = params
        self.rng = rng if rng is not None else make_rng(params)

    def distribution(self, logits_V: np.ndarray, context: Sequence[int]) -> np.ndarray:
        return probabilities(logits_V, self.params, context)

    def draw(self, logits_V: np.ndarray, context: Sequence[int]) -> int:
        """The one place a token is drawn from a row's processed distribution."""
        return sample(self.distribution(logits_V, context), self.rng)

    def choose(self, argmax_id: int, logits_V: np.ndarray | None, context: Sequence[int]) -> int:
        """A plain row's token: a draw from its logits (the argmax is not used)."""
        return self.draw(logits_V, context)

    def first(self, gen, ids: list[int]) -> int:
        out = gen.run(PREFILL, gen.n, tokens=ids, want_logits=True)
        row = np.array(out.logits[-1], dtype=np.float32)  # the buffer is reused by the next step
        gen.commit(ids)
        return self.draw(row, gen.tokens)

    def decode(self, gen, pending: int, context: Sequence[int]) -> int:
        from loopcast.manifest import DECODE

        out = gen.run(DECODE, gen.n, tokens=[pending], want_logits=True)
        gen.commit([pending])
        return self.draw(out.logits[0], list(context) + [pending])

    def draft(self, token: int, logits: np.ndarray | None, context: Sequence[int]) -> tuple[int, np.ndarray]:
        q = self.distribution(logits, context)
        return sample(q, self.rng), q

    def accept(self, context: Sequence[int], proposal, verified) -> AcceptResult:
        """``context`` ends with the pending token; row i of ``verified.logits`` scores the token
        after ``context + drafts[:i]``."""
        rows = _Rows(self, verified.logits, list(context), list(proposal.tokens))
        accepted, token = speculative_accept(proposal.tokens, proposal.probs, rows, self.rng)
        return AcceptResult(accepted, token, 0)

    def check(
        self, draft: int, q, target: int, logits: np.ndarray | None, context: Sequence[int]
    ) -> tuple[bool, int]:
        """One draft ``x ~ q`` against the target row: kept with probability min(1, p(x)/q(x)),
        else the token is drawn from the normalised residual max(0, p - q)."""
        p = self.distribution(logits, context)
        q_x = 1.0 if q is None else float(q[draft])
        if self.rng.random() < min(1.0, float(p[draft]) / q_x):
            return True, draft
        residual = np.maximum(0.0, p - q) if q is not None else np.where(np.arange(p.size) == draft, 0.0, p)
        if residual.sum() <= 0.0:  # p == q up to rounding: a rejection has probability ~0
            residual = p
        return False, sample(residual / residual.sum(), self.rng)

    def bonus(self, logits: np.ndarray, context: Sequence[int]) -> int:
        """A token with no draft to check (the last lane of the pipeline): a plain draw."""
        return self.draw(logits, context)


class _Rows:
    """Target distributions made on first use: the rule reads rows only up to the first
    rejection, and a row costs ~1 ms at V = 128k (docs/sampling.md)."""

    def __init__(
        self, acceptor: SampledAcceptor, logits: np.ndarray, context: list[int], drafts: list[int]
    ) -> None:
        self.acceptor, self.logits, self.context, self.drafts = acceptor, logits, context, drafts
        self._made: dict[int, np.ndarray] = {}

    def __len__(self) -> int:
        return len(self.drafts) + 1

    def __getitem__(self, i: int) -> np.ndarray:
        if i not in self._made:
            self._made[i] = self.acceptor.distribution(self.logits[i], self.context + self.drafts[:i])
        return self._made[i]
