"""The batching engine's gate (``BatchCostGate``): per step, which requests speculate and how —
a verify_batch step for prompt-lookup drafts (``engage``), a self-speculation round
(``engage_self``: draft_batch and verify_tail_batch), and which pipeline requests run their
lanes in the step's cycle_batch call (``engage_pipeline``). Every choice is priced with the step
costs measured per (kind, width) on this machine and each request's observed yield; decisions
change which kernels run, never the greedy tokens.
"""

from __future__ import annotations

from loopcast.ort_runtime.decoding.gates import GateCounters

from loopcast.manifest import CYCLE_BATCH, DECODE_BATCH, DRAFT_BATCH, VERIFY_BATCH, VERIFY_TAIL_BATCH

# Per observed cycle, the weight the earlier ones keep in a pipeline request's rate (about 30
# cycles of memory: several rejections' refills)
PIPE_DECAY = 0.97
PIPE_PRIOR_CYCLES = 8.0  # the prior's weight in a new request's rate, in cycles
# How much faster the other choice must price than the current one for the pipeline gate to switch
PIPE_MARGIN = 1.05
# A probe whose epoch ends off again doubles the gap to the next one, up to this many steps: a
# probe's lanes are dropped before they fill, so each costs most of an epoch of tokens
PIPE_PROBE_MAX = 1024


class BatchCostGate(GateCounters):
    """Whether a step verifies drafts (verify_batch) or decodes (decode_batch), and which
    requests self-draft (``engage_self``: draft_batch and verify_tail_batch).

    Verify when (running + proposing·α) / t_verify(w) > running / t_decode(w): tokens per second
    of either step at width w, with α the observed accepted drafts per proposing request (an
    exponential average, starting optimistic so that the first proposals are tried). Costs are
    exponential averages of steady runs per (kind, width); a binding's first run is left out.
    While verify is off, α cannot move, so every ``probe_every`` steps one verify step is taken
    anyway. Decisions change which kernels run, never the greedy tokens.
    """

    def __init__(self, probe_every: int = 32, smoothing: float = 0.2) -> None:
        super().__init__("batch-cost", "batching engine")
        self.probe_every, self.smoothing = probe_every, smoothing
        self.cost: dict[tuple[str, int], float] = {}
        self._seen: set[tuple[str, int]] = set()
        self.alpha = 2.0
        self.off_steps = self.self_off_steps = 0
        self._self_alpha: dict[int, float] = {}  # slot -> its request's accepted self-drafts per round
        self._self_prior: float | None = None  # the same over every request's rounds
        # the pipeline: slot -> tokens its lanes commit per cycle, once they run steadily
        self._pipe_rate: dict[int, float] = {}
        self._pipe_sums: dict[int | None, tuple[float, float]] = {}  # decayed (commits, cycles)
        self._pipe_prior: float | None = None  # the same over every request's cycles
        self._pipe_warm: set[int] = set()  # slots whose lanes committed a token since they started
        self._pipe_floor: float | None = None  # this epoch's choice: the least rate taken (None: off)
        self._pipe_taken: set[int] = set()  # this epoch's requests (they keep their lanes)
        self._pipe_epoch = 0  # steps left of this epoch's choice
        self.pipe_off_steps = 0
        self._pipe_probe_gap = probe_every  # off steps before the next probe epoch

    def engage(self, width: int, running: int, proposing: int) -> bool:
        t_verify, t_decode = self.cost.get((VERIFY_BATCH, width)), self.cost.get((DECODE_BATCH, width))
        if t_decode is None:  # measure the plain step at this width first
            on = False
        elif t_verify is None:
            on = True
        else:
            on = (running + proposing * self.alpha) / t_verify > running / t_decode
        probe = False
        if not on:
            self.off_steps += 1
            if self.off_steps >= self.probe_every:
                on = probe = True
        if on:
            self.off_steps = 0
        self._switch(on)
        self._count(1 if on else None, probe)
        self.reason = f"α={self.alpha:.2f} at width {width}: {'verify' if on else 'decode'}"
        return on

    def observe_cost(self, kind: str, width: int, seconds: float) -> None:
        key = (kind, width)
        if key not in self._seen:  # warm-up run of a fresh binding
            self._seen.add(key)
            return
        old = self.cost.get(key)
        self.cost[key] = seconds if old is None else old + self.smoothing * (seconds - old)

    def observe_accept(self, accepted_per_proposer: float) -> None:
        self.alpha += self.smoothing * (accepted_per_proposer - self.alpha)

    def engage_self(
        self, width: int, running: int, candidates: dict[int, int], row_budget: int
    ) -> dict[int, int]:
        """Which requests self-draft this step: slot -> drafts, from ``candidates`` (slot -> the
        most drafts it may take). Per request: its own α (accepted drafts per round, starting
        at the mean over all requests' rounds so far, or at its k before any, so that it is
        tried); requests in order of α, as many as fit ``row_budget`` draft rows (k + 1 each).
        The round runs max k + 1 draft_batch calls and one verify_tail_batch call at width w,
        all running requests in each; it is taken with the prefix of that order that maximises
        (running + Σα) / ((K + 1)·t_draft(w) + t_tail(w)), when that beats running / t_decode(w).
        Otherwise a probe every ``probe_every`` steps. Costs at a width not measured yet are
        priced from the measured ones (``_scaled``), so a new width costs no exploring round."""
        prior = self._self_prior
        alpha = {
            s: self._self_alpha.setdefault(s, float(k) if prior is None else min(prior, k))
            for s, k in candidates.items()
        }
        chosen, rows = [], 0
        for s in sorted(candidates, key=lambda s: -alpha[s]):
            if rows + candidates[s] + 1 <= row_budget:
                chosen.append(s)
                rows += candidates[s] + 1
        t_decode = self.cost.get((DECODE_BATCH, width))
        t_draft, t_tail = self._scaled(DRAFT_BATCH, width), self._scaled(VERIFY_TAIL_BATCH, width)
        if t_decode is None:  # measure the plain step at this width first
            best: list[int] = []
        elif t_draft is None or t_tail is None:
            best = chosen
        else:
            best, best_rate, gain, K = [], running / t_decode, 0.0, 0
            for j, s in enumerate(chosen):
                gain, K = gain + alpha[s], max(K, candidates[s])
                rate = (running + gain) / ((K + 1) * t_draft + t_tail)
                if rate > best_rate:
                    best, best_rate = chosen[: j + 1], rate
        probe = False
        if not best and chosen:
            self.self_off_steps += 1
            if self.self_off_steps >= self.probe_every:
                best, probe = chosen, True
        if best:
            self.self_off_steps = 0
        self._switch(bool(best))
        self._count(1 if best else None, probe)
        self.reason = f"self-drafting {len(best)} of {len(candidates)} requests at width {width}"
        return {s: candidates[s] for s in best}

    def _scaled(self, kind: str, width: int) -> float | None:
        """``kind``'s cost at ``width``: measured; else between two measured widths, linear
        between them; above every measured width, the widest one's cost times the ratio of the
        widths; below every measured width, the narrowest one's scaled by the ratio of the decode
        costs (None: nothing to scale from). Upward the ratio of the widths is an upper bound (a
        call's cost grows at most in proportion to its rows, the weights' reads being shared),
        where the decode costs' ratio under-priced the kinds of several rows a slot: decode rows
        grow with the width more slowly than a cycle's R rows or a tail's W do, and every width
        not yet measured was then priced on, ran, and turned off again."""
        cost = self.cost.get((kind, width))
        if cost is not None:
            return cost
        known = sorted(w for (k, w) in self.cost if k == kind)
        below, above = [w for w in known if w < width], [w for w in known if w > width]
        if below and above:
            lo, hi = below[-1], above[0]
            t_lo, t_hi = self.cost[(kind, lo)], self.cost[(kind, hi)]
            return t_lo + (t_hi - t_lo) * (width - lo) / (hi - lo)
        if below:
            return self.cost[(kind, below[-1])] * width / below[-1]
        decode = self.cost.get((DECODE_BATCH, width))
        near = self.cost.get((DECODE_BATCH, above[0])) if above else None
        if decode is None or near is None:
            return None
        return self.cost[(kind, above[0])] * decode / near

    def observe_self(self, slot: int, accepted: int) -> None:
        """A self-drafting request's round accepted ``accepted`` drafts."""
        old = self._self_alpha.get(slot, float(accepted))
        self._self_alpha[slot] = old + self.smoothing * (accepted - old)
        prior = self._self_prior if self._self_prior is not None else float(accepted)
        self._self_prior = prior + self.smoothing * (accepted - prior)

    def engage_pipeline(self, width: int, running: int, candidates: list[int], loops: int) -> set[int]:
        """Which pipeline requests run their lanes this step (one cycle_batch call at width w);
        the others take plain rows in the step's decode_batch call. Per request: ρ, the tokens its
        lanes commit per cycle once they run steadily (decayed sums over the cycles after their
        first committed token; before that the same over every request's, or 1 before any, so
        that it is tried). The prefix of the requests in order of ρ that maximises
        (Σρ + running − taken) / (t_cycle(w) + t_decode(w) if any request is left plain) is taken
        when that beats running / t_decode(w) by ``PIPE_MARGIN`` (switching costs: lanes dropped,
        or their fill), or stays while within it. (With the cycle's cost set by the width, a strict
        subset pays both calls and never beats both all-lanes and all-plain, a mediant: the
        choice is all or none.) Lanes take ``loops`` cycles to commit their first token, so a
        choice holds for ``loops`` steps (an epoch): its requests keep their lanes, and a request
        joining meanwhile is taken if its ρ reaches the least the choice took; while off, a probe
        epoch after ``probe_every`` steps, the gap doubling after each probe that ends off again
        (up to PIPE_PROBE_MAX) and starting over once the prices turn the lanes on."""
        rate = {
            s: self._pipe_rate.get(s, 1.0 if self._pipe_prior is None else self._pipe_prior)
            for s in candidates
        }
        if self._pipe_epoch > 0:
            self._pipe_epoch -= 1
            floor, taken = self._pipe_floor, self._pipe_taken
            if floor is None:
                return set()
            self._pipe_taken = {s for s in candidates if s in taken or rate[s] >= floor}
            return set(self._pipe_taken)
        order = sorted(candidates, key=lambda s: -rate[s])
        t_decode = self.cost.get((DECODE_BATCH, width))
        t_cycle = self._scaled(CYCLE_BATCH, width)
        if t_decode is None:  # measure the plain step at this width first
            best: list[int] = []
        elif t_cycle is None:
            best = order
        else:
            # switching either way costs (lanes dropped, or R - 1 cycles of fill): a margin
            on = self._pipe_floor is not None
            best, best_rate, gain = [], running / t_decode * (1.0 / PIPE_MARGIN if on else PIPE_MARGIN), 0.0
            for j, s in enumerate(order):
                gain += rate[s]
                plain = running - (j + 1)
                step_rate = (gain + plain) / (t_cycle + (t_decode if plain else 0.0))
                if step_rate > best_rate:
                    best, best_rate = order[: j + 1], step_rate
        probe = False
        if not best and t_decode is not None:
            self.pipe_off_steps += 1
            if self.pipe_off_steps >= self._pipe_probe_gap:
                best, probe = order, True
                self._pipe_probe_gap = min(2 * self._pipe_probe_gap, PIPE_PROBE_MAX)
        elif best:
            self._pipe_probe_gap = self.probe_every  # on by its prices: probes start over
        if best:
            self.pipe_off_steps = 0
        self._pipe_floor = min(rate[s] for s in best) if best else None
        self._pipe_taken = set(best)
        self._pipe_epoch = loops - 1 if best else 0
        self._switch(bool(best))
        self._count(1 if best else None, probe)
        self.reason = f"pipeline lanes for {len(best)} of {len(candidates)} requests at width {width}"
        return set(best)

    def observe_pipeline(self, slot: int, committed: bool) -> None:
        """A cycle ran ``slot``'s lanes and committed a token (or not). Its rate counts once its
        lanes have committed their first token (the cycles before are the lanes' fill), as
        decayed sums of commits over cycles: a rejection's R - 1 empty refill cycles come in a
        burst, which a short exponential average would take for the rate."""
        if slot not in self._pipe_warm:
            if not committed:
                return
            self._pipe_warm.add(slot)
        if slot not in self._pipe_sums and self._pipe_prior is not None:
            # a new request starts from the prior, worth a few cycles, not from one burst
            self._pipe_sums[slot] = (PIPE_PRIOR_CYCLES * self._pipe_prior, PIPE_PRIOR_CYCLES)
        for key in (slot, None):  # the request's own, and every request's (the prior)
            c, n = self._pipe_sums.get(key, (0.0, 0.0))
            self._pipe_sums[key] = (PIPE_DECAY * c + committed, PIPE_DECAY * n + 1.0)
        c, n = self._pipe_sums[slot]
        self._pipe_rate[slot] = c / n
        c, n = self._pipe_sums[None]
        self._pipe_prior = c / n

    def pipeline_stopped(self, slot: int) -> None:
        """``slot``'s lanes were dropped: the next ones fill again before they count."""
        self._pipe_warm.discard(slot)

    def forget(self, slot: int) -> None:
        """The request in ``slot`` left: the next one there starts with its own α and ρ."""
        self._self_alpha.pop(slot, None)
        self._pipe_rate.pop(slot, None)
        self._pipe_sums.pop(slot, None)
        self._pipe_warm.discard(slot)


class AlwaysBatchGate(BatchCostGate):
    """Speculate wherever a request can (measurements: ``loadgen --gate always``): verify every
    step with drafts, self-draft every self request within the row budget, lanes for every
    pipeline request."""

    def __init__(self) -> None:
        super().__init__()
        self.name = "always"

    def engage(self, width: int, running: int, proposing: int) -> bool:
        self._count(1)
        return True

    def engage_self(
        self, width: int, running: int, candidates: dict[int, int], row_budget: int
    ) -> dict[int, int]:
        chosen, rows = {}, 0
        for s, k in candidates.items():
            if rows + k + 1 <= row_budget:
                chosen[s], rows = k, rows + k + 1
        self._count(1 if chosen else None)
        return chosen

    def engage_pipeline(self, width: int, running: int, candidates: list[int], loops: int) -> set[int]:
        self._count(1)
        return set(candidates)
