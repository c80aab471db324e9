"""Speculation pieces: the pure ``greedy_accept``, the TieGuard, proposers and gates.

One round (driven by ``ort_runtime/decoding.py``): a proposer offers up to K draft tokens; the
verifier scores the pending token and the drafts in one step; ``greedy_accept`` returns the
accepted prefix and the verifier's own next token (correction or bonus); the generator
commits the pending token plus the accepted drafts and the rest is forgotten by moving ``n``.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from loopcast.errors import RequestError


@dataclass(frozen=True)
class AcceptResult:
    accepted: int                 # drafts accepted (a prefix of the proposal)
    next_token: int               # the verifier's token after the accepted prefix
    near_tie_rejections: int      # 1 if the first rejected draft was within ε of the row max
    tolerant_accepts: int = 0     # drafts accepted only because of the tolerant mode


def greedy_accept(drafts: Sequence[int], target_ids: Sequence[int], target_logits: np.ndarray | None = None,
                  *, epsilon: float = 0.0, tolerant: bool = False) -> AcceptResult:
    """Accept the longest prefix of ``drafts`` that greedy decoding would have produced.

    ``target_ids[i]`` is the verifier's argmax after the pending token and ``drafts[:i]``, so
    ``len(target_ids) == len(drafts) + 1``. Strict (default): draft i is accepted iff it equals
    ``target_ids[i]``; the committed tokens are then exactly greedy's. With ``target_logits``
    a rejected draft whose logit is within ``epsilon`` of its row's max counts as a near tie;
    ``tolerant=True`` accepts such drafts — that output is *not* identical to greedy.
    """
    if len(target_ids) != len(drafts) + 1:
        raise ValueError(f"need {len(drafts) + 1} verifier rows for {len(drafts)} drafts, got {len(target_ids)}")
    accepted = tolerated = ties = 0
    for i, draft in enumerate(drafts):
        if draft == target_ids[i]:
            accepted += 1
            continue
        near = target_logits is not None and target_logits[i].max() - target_logits[i][draft] <= epsilon
        if near and tolerant:
            accepted += 1
            tolerated += 1
            continue
        ties = int(near)
        break
    # The verifier's rows condition on the drafts themselves, so its token after the accepted
    # prefix is consistent with what is committed, tolerated drafts included.
    return AcceptResult(accepted, int(target_ids[accepted]), ties, tolerated)


@dataclass(frozen=True)
class TieGuard:
    """Counts near-tie rejections; ``tolerant`` mode trades exactness for acceptance."""

    epsilon: float = 1e-3
    tolerant: bool = False


# -- proposers -------------------------------------------------------------------------------

class PromptLookupProposer:
    """Drafts by n-gram match: find the latest earlier occurrence of the last n tokens
    (n from ``max_ngram`` down to ``min_ngram``) and propose what followed it."""

    name = "prompt-lookup"

    def __init__(self, min_ngram: int = 1, max_ngram: int = 3) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise RequestError(f"prompt lookup needs 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.min_ngram, self.max_ngram = min_ngram, max_ngram

    def propose(self, context: Sequence[int], k: int) -> list[int]:
        seq = list(context)
        for n in range(min(self.max_ngram, len(seq) - 1), self.min_ngram - 1, -1):
            tail = seq[-n:]
            for start in range(len(seq) - n - 1, -1, -1):
                if seq[start:start + n] == tail:
                    return seq[start + n:start + n + k]
        return []


class SelfDraftProposer:
    """Shallow-loop self-speculation: drafts come from the draft graph at depth d (the
    decoding loop runs it, since its rows also write depth<d KV).

    ``perturb(position, token) -> token`` may replace a drafted token before it is fed to the
    next draft row — the adversarial tests use it to force rejections mid-chain.
    """

    name = "self"

    def __init__(self, perturb=None) -> None:
        self.perturb = perturb

    def adjust(self, position: int, token: int) -> int:
        return int(self.perturb(position, token)) if self.perturb is not None else token


# -- gates -------------------------------------------------------------------------------------

class AlwaysGate:
    """Speculate on every step the proposer has drafts for."""

    name = "none"
    transitions = 0

    def __init__(self, k: int) -> None:
        self.k = k

    def engage(self, step: int) -> int | None:
        """Number of drafts to take this step (None: run plain decode)."""
        return self.k

    def observe(self, proposed: int, accepted: int, would_hit: bool | None = None, step: int = 0) -> None:
        pass


class HitDensityGate:
    """Engage while the fraction of recent steps whose proposal would have hit is high.

    Steps run as plain decode still count: the proposer's first draft is compared with the
    token decode produced (``would_hit``), which costs nothing for prompt lookup.
    """

    name = "hit-density"

    def __init__(self, k: int, window: int = 16, threshold: float = 0.35, probe_every: int = 16) -> None:
        self.k, self.threshold, self.probe_every = k, threshold, probe_every
        self.hits: deque[bool] = deque(maxlen=window)
        self.engaged = False
        self.transitions = 0
        self._last_info = 0
        self._base_probe, self._probing = probe_every, False

    def engage(self, step: int) -> int | None:
        density = sum(self.hits) / len(self.hits) if self.hits else 1.0
        now = density >= self.threshold
        if now != self.engaged:
            self.transitions += 1
            self.engaged = now
        if not now and step - self._last_info >= self.probe_every:
            # Proposers without a free would-hit signal (self-drafts) learn only from rounds;
            # the interval doubles while probes keep missing.
            self._last_info = step
            self._probing = True
            return self.k
        return self.k if now else None

    def observe(self, proposed: int, accepted: int, would_hit: bool | None = None, step: int = 0) -> None:
        if would_hit is not None:
            self.hits.append(would_hit)
            self._last_info = step
        elif proposed:
            self.hits.append(accepted > 0)
            self._last_info = step
            if self._probing:
                self.probe_every = self._base_probe if accepted > 0 else min(2 * self.probe_every, 256)
        self._probing = False


class CostGate:
    """Choose per step between plain decode and a speculative round of k drafts.

    With per-draft acceptance α (running estimate), a round of k drafts commits on average
    E(k) = 1 + α + … + α^k tokens. Its cost is ``draft_cost(k) + verify_cost`` (measured on this
    machine by the generator's step timers). Engage with the k that maximises E(k)/cost when
    that beats 1/decode_cost by ``margin``; otherwise decode, and re-probe with a single round
    every ``probe_every`` steps (doubling while probes keep failing) so a workload that turns
    predictable is noticed.
    """

    name = "cost"

    def __init__(self, k_max: int, costs, *, margin: float = 0.05, prior_alpha: float = 0.8,
                 probe_every: int = 8) -> None:
        self.k_max, self.costs, self.margin = k_max, costs, margin
        # α = accepted / (accepted + rejections), as decayed counts: a ratio of sums, not a
        # mean of per-round ratios (which undercounts long accepted runs).
        self._accepted, self._trials = 2.0 * prior_alpha, 2.0
        self.probe_every, self._next_probe = probe_every, 0
        self.engaged = False
        self.transitions = 0

    @property
    def alpha(self) -> float:
        return self._accepted / self._trials

    def best_k(self) -> tuple[int, float]:
        """The k with the best expected tokens/s, 0 if plain decode is better.

        Hysteresis: engaging needs a ``margin`` gain over decode, staying engaged only needs
        to lose less than ``margin``, so one unlucky round does not flip the gate.
        """
        plain = 1.0 / self.costs.decode()
        need = plain * (1 - self.margin if self.engaged else 1 + self.margin)
        best_k, best_rate = 0, need
        for k in range(1, self.k_max + 1):
            expected = sum(self.alpha ** i for i in range(k + 1))
            rate = expected / self.costs.round(k)
            if rate > best_rate:
                best_k, best_rate = k, rate
        return best_k, max(best_rate, plain)

    def engage(self, step: int) -> int | None:
        k, _ = self.best_k()
        now = k > 0
        if not now and step >= self._next_probe:
            self._next_probe = step + self.probe_every
            self.probe_every = min(self.probe_every * 2, 256)
            k = self.k_max  # a full-length probe: one round tells how far drafts stay right
        if now != self.engaged:
            self.transitions += 1
            self.engaged = now
        return k or None

    def observe(self, proposed: int, accepted: int, would_hit: bool | None = None, step: int = 0) -> None:
        decay = 0.8
        if proposed:
            self._accepted = decay * self._accepted + accepted
            self._trials = decay * self._trials + accepted + (1 if accepted < proposed else 0)
            if accepted > 0:
                self.probe_every = 8
        elif would_hit is not None:
            # Free evidence from a plain step (prompt lookup): one draft, hit or miss. It
            # replaces the probe, which would only measure the same thing at a cost.
            self._accepted = decay * self._accepted + float(would_hit)
            self._trials = decay * self._trials + 1.0
            self._next_probe = step + self.probe_every
