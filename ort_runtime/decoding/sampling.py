"""Sampling: the processed next-token distribution, the draw, and lossless speculative acceptance.

Pure numpy (no torch, no transformers), run on the host on the pulled logits row(s); the cost
per token against a decode step is measured in docs/sampling.md.

The distribution ``probabilities(logits, params, context)`` applies, in transformers' order:
repetition penalty (over the distinct ids of ``context``: a positive logit is divided by the
penalty, a negative one multiplied), temperature, top-k, top-p (the smallest set of most likely
tokens whose mass reaches top_p), min-p (drop tokens below min_p times the top probability).
``temperature == 0`` is greedy: a one-hot row at the argmax of the penalised logits.

RNG (documented so that a seed means the same tokens everywhere): one
``numpy.random.Generator(PCG64(seed))`` per request (``make_rng``). ``sample`` draws one
uniform ``u = rng.random()`` and returns the first index whose float64 cumulative probability
exceeds ``u * total`` (inverse CDF in vocabulary order). ``speculative_accept`` draws, for each
draft in order, one uniform for its accept test, then one uniform for the correction or bonus
token. A given seed therefore fixes the tokens for a given mode (the modes consume the stream
differently), artifact and device; the *distribution* is the same in every mode.

Lossless speculative sampling (Leviathan et al. 2023, Chen et al. 2023): draft ``x_i`` drawn
from ``q_i`` is accepted with probability ``min(1, p_i(x_i) / q_i(x_i))``; the first rejected
one is replaced by a draw from ``normalize(max(0, p_i - q_i))``; if every draft is accepted a
bonus token is drawn from the last target row. A deterministic proposer (prompt lookup) has
``q_i`` = one-hot at ``x_i``: accept with probability ``p_i(x_i)``, resample from ``p_i`` with
``x_i`` removed. The committed sequence then has exactly the distribution of plain sampling
from ``p`` (tests/ort_runtime/test_sampling.py checks it by chi-square and shows that wrong
rules fail the same check).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from loopcast.errors import LoopcastError, RequestError

# top-p sorts only the most likely candidates first; the full sort is the fallback when they do
# not reach top_p (a flat distribution).
_TOP_P_CANDIDATES = 1024
_LARGEST = 1e300  # penalised logits are clipped here: finite, and any subtraction of two stays finite


@dataclass(frozen=True)
class SamplingParams:
    """How to draw each token. The defaults are plain sampling at temperature 1."""

    temperature: float = 1.0
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1: off
    min_p: float = 0.0  # 0: off
    repetition_penalty: float = 1.0  # 1: off
    seed: int | None = None  # None: fresh OS entropy (not reproducible)

    def __post_init__(self) -> None:
        def bad(name: str, value, expected: str) -> RequestError:
            return RequestError(f"sampling {name} must be {expected}, got {value!r}")

        if not _finite(self.temperature) or self.temperature < 0:
            raise bad("temperature", self.temperature, "a finite number >= 0 (0 is greedy)")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, (int, np.integer)) or self.top_k < 0:
            raise bad("top_k", self.top_k, "an integer >= 0 (0 is off)")
        if not _finite(self.top_p) or not 0 < self.top_p <= 1:
            raise bad("top_p", self.top_p, "in (0, 1] (1 is off)")
        if not _finite(self.min_p) or not 0 <= self.min_p <= 1:
            raise bad("min_p", self.min_p, "in [0, 1] (0 is off)")
        if not _finite(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise bad("repetition_penalty", self.repetition_penalty, "a finite number > 0 (1 is off)")
        if self.seed is not None and (
            isinstance(self.seed, bool) or not isinstance(self.seed, (int, np.integer)) or self.seed < 0
        ):
            raise bad("seed", self.seed, "a non-negative integer or None")

    @property
    def greedy(self) -> bool:
        """Exactly today's greedy decoding: temperature 0 and nothing that changes the argmax."""
        return self.temperature == 0 and self.repetition_penalty == 1.0


def _finite(x) -> bool:
    return (
        isinstance(x, (int, float, np.floating, np.integer)) and not isinstance(x, bool) and math.isfinite(x)
    )


def make_rng(params: SamplingParams) -> np.random.Generator:
    """The request's one random stream."""
    return np.random.Generator(np.random.PCG64(params.seed))


def probabilities(
    logits_V: np.ndarray, params: SamplingParams, context_ids: Sequence[int] = ()
) -> np.ndarray:
    """The processed next-token distribution (float64, sums to 1) for one logits row.

    ``context_ids`` are the ids the repetition penalty looks at: the whole sequence before the
    token being drawn (prompt, committed tokens, and for a verify row the drafts before it).
    """
    x = np.array(logits_V, dtype=np.float64)
    size = x.size
    if not np.isfinite(x).all():
        raise LoopcastError("the model's logits are not finite (NaN or inf): nothing to sample from")
    if params.repetition_penalty != 1.0 and len(context_ids):
        seen = np.unique(np.asarray(context_ids, dtype=np.int64))
        vals = x[seen]
        with np.errstate(over="ignore", under="ignore"):
            penalised = np.where(vals > 0, vals / params.repetition_penalty, vals * params.repetition_penalty)
        # An extreme penalty overflows: the extreme finite value keeps the order it means.
        x[seen] = np.clip(penalised, -_LARGEST, _LARGEST)
    if params.temperature == 0:
        p = np.zeros_like(x)
        p[int(np.argmax(x))] = 1.0
        return p
    keep = None  # after top-k, the rest works on the kept entries only (cheap at V = 128k)
    if 0 < params.top_k < size:
        kth = x[np.argpartition(x, size - params.top_k)[size - params.top_k]]
        keep = np.flatnonzero(x >= kth)  # ties with the k-th value stay, as in transformers
        x = x[keep]
    # Shift before scaling: every entry is then <= 0 and the top one exactly 0, so a tiny
    # temperature sends the rest to -inf (probability 0), never to inf - inf = NaN.
    x -= x.max()
    with np.errstate(over="ignore", divide="ignore", invalid="ignore"):
        x /= params.temperature
    x[np.isnan(x)] = -np.inf  # 0 / tiny is 0; -0.0 / tiny stays -0.0: only -inf / tiny could be NaN
    q = np.exp(x, out=x)
    q /= q.sum()
    if params.top_p < 1.0:
        q = _top_p(q, params.top_p)
    if params.min_p > 0.0:
        q[q < params.min_p * q.max()] = 0.0
        q /= q.sum()
    if keep is None:
        return q
    p = np.zeros(size)
    p[keep] = q
    return p


def _top_p(p: np.ndarray, top_p: float) -> np.ndarray:
    """Keep the most likely tokens until their mass reaches ``top_p`` (at least one).

    Sorts only the m most likely entries, m = 1024, 8192, ... until they hold ``top_p``: a
    trained model's row reaches 0.9 within a few hundred tokens, so the full sort is rare."""
    m = min(p.size, _TOP_P_CANDIDATES)
    while True:
        cand = np.argpartition(p, p.size - m)[p.size - m :] if m < p.size else np.arange(p.size)
        order = cand[np.argsort(-p[cand], kind="stable")]
        mass = np.cumsum(p[order])
        if mass[-1] >= top_p or m == p.size:
            break
        m = min(p.size, m * 8)
    keep = min(int(np.searchsorted(mass, top_p)), order.size - 1) + 1  # first index with mass >= top_p
    out = np.zeros_like(p)
    kept = order[:keep]
    out[kept] = p[kept]
    return out / out.sum()


def sample(p_V: np.ndarray, rng: np.random.Generator) -> int:
    """One draw from ``p_V`` with one uniform (inverse CDF in vocabulary order)."""
    cdf = np.cumsum(p_V, dtype=np.float64)
    if not (np.isfinite(cdf[-1]) and cdf[-1] > 0):  # a NaN never becomes a token
        raise LoopcastError("the sampling distribution is not a distribution (NaN or zero mass)")
    u = rng.random() * cdf[-1]
    # side="right" skips zero-probability tokens: cdf[i] > u needs p_i > 0 at the crossing.
    return int(min(np.searchsorted(cdf, u, side="right"), p_V.size - 1))


def speculative_accept(
    drafts: Sequence[int],
    draft_probs: Sequence[np.ndarray] | None,
    target_probs: Sequence[np.ndarray],
    rng: np.random.Generator,
) -> tuple[int, int]:
    """The rejection rule → (accepted drafts, the token after them).

    ``target_probs[i]`` is the processed target distribution after the pending token and
    ``drafts[:i]`` (so ``len(drafts) + 1`` rows). ``draft_probs[i]`` is the distribution draft i
    was drawn from, or ``None`` for a deterministic proposer (q = one-hot at the draft).
    """
    if len(target_probs) != len(drafts) + 1:
        raise ValueError(
            f"need {len(drafts) + 1} target rows for {len(drafts)} drafts, got {len(target_probs)}"
        )
    if draft_probs is not None and len(draft_probs) != len(drafts):
        raise ValueError(f"need {len(drafts)} draft rows, got {len(draft_probs)}")
    for i, x in enumerate(drafts):
        kept, token = accept_one(x, None if draft_probs is None else draft_probs[i], target_probs[i], rng, i)
        if not kept:
            return i, token
    return len(drafts), sample(target_probs[len(drafts)], rng)


def accept_one(
    x: int, q_V: np.ndarray | None, p_V: np.ndarray, rng: np.random.Generator, index: int = 0
) -> tuple[bool, int]:
    """One draft ``x`` (drawn from ``q_V``; None: a deterministic proposer, q one-hot at x)
    against the target distribution ``p_V``: kept with probability min(1, p(x)/q(x)) → (True,
    x); else (False, a draw from the normalised residual max(0, p - q)). Either way the token's
    law is p."""
    q_x = 1.0 if q_V is None else float(q_V[x])
    if q_x <= 0.0:
        raise ValueError(f"draft {index} ({x}) has probability 0 under its own draft distribution")
    if rng.random() < min(1.0, float(p_V[x]) / q_x):
        return True, int(x)
    if q_V is None:
        residual = np.array(p_V, dtype=np.float64)
        residual[x] = 0.0
    else:
        residual = np.maximum(0.0, np.asarray(p_V, dtype=np.float64) - q_V)
    if residual.sum() <= 0.0:  # p == q up to rounding: a rejection has probability ~0
        residual = np.asarray(p_V, dtype=np.float64)
    return False, sample(residual / residual.sum(), rng)
