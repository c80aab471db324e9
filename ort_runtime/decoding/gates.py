"""Gates: per step, run a speculative round (and with how many drafts) or plain decode.

- ``always``: speculate on every step the proposer has drafts for (for measurements).
- ``hit-density``: engage while the recent fraction of steps whose first draft was right is high.
- ``cost``: price a round with the step costs measured on this machine and the running
  acceptance α; engage with the k that maximises expected tokens per second when that beats
  plain decode by a margin.
- ``auto`` (the default): the cost gate, calibrated for this artifact and device — the costs
  are the generator's own steady step timers (captured replays on CUDA, warm-up and capture
  excluded), updated every step, and the host work a round adds around its graph runs
  (``StepCosts.host_factor``, from the engine's round wall times); its probes are priced so
  that a workload where speculation never pays spends at most ``probe_budget`` of its time
  finding that out.

Every gate reports what it did (``report()``): rounds on, steps off, probes, the measured
costs and the reason it engaged or stood down; ``GenerationStats.gate_report`` carries it.
"""

from __future__ import annotations

from collections import deque

from loopcast.ort_runtime.binding.step_clock import rows_timer
from loopcast.ort_runtime.decoding.protocols import CostsBase

from loopcast.errors import RequestError
from loopcast.manifest import DECODE
from loopcast.vocab import GateKind, GraphKind, choices

LOOP_EMBED, LOOP_STEP, EXIT_HEAD = GraphKind.LOOP_EMBED, GraphKind.LOOP_STEP, GraphKind.EXIT_HEAD

GATES = tuple(choices(GateKind))
# Wall-time timers the engine keeps beside the step timers (StepCosts.host_factor): speculative
# rounds' wall time, their steps' timed time and their graph calls; plain rounds' wall time.
SPEC_ROUND, SPEC_ROUND_DEVICE, SPEC_ROUND_CALLS = "spec_round", "spec_round_device", "spec_round_calls"
DECODE_ROUND = "decode_round"


class StepCosts(CostsBase):
    """Mean steady step time per graph kind on this generator (seconds). A CUDA slot's first
    run (warm-up + capture) costs many steps and is not counted."""

    def __init__(self, gen, draft_share: float) -> None:
        self.gen, self.draft_share = gen, draft_share

    def mean(self, kind: str) -> float | None:
        return self.gen.clock.mean(self.gen.resolve(kind))  # at the generation's static depth

    def decode(self) -> float:
        return self.mean(DECODE) or 1e-3

    def rows_cost(self, kind: str, rows: int) -> float | None:
        """The price of ``rows`` rows of a variable-rows kind (verify on the CPU: a round runs
        only the rows it uses). The steady mean at that count where measured; between measured
        counts (decode's one row is the first), the line joining the neighbours; past the
        largest, its cost per row after the first. None before any count is measured."""
        gen = self.gen
        if not gen.variable_rows(kind):
            return None
        kind = gen.resolve(kind)
        points = {1: self.decode()}
        for m in range(2, (gen.rows(kind) or 1) + 1):
            mean = gen.clock.mean(rows_timer(kind, m))
            if mean is not None:
                points[m] = mean
        if rows in points:
            return points[rows]
        if len(points) == 1:
            return None
        below = max(m for m in points if m < rows)
        above = [m for m in points if m > rows]
        if above:
            hi = min(above)
            t = (rows - below) / (hi - below)
            return points[below] + t * (points[hi] - points[below])
        top = max(points)
        return points[top] + (rows - top) * (points[top] - points[1]) / (top - 1)

    def host_factor(self) -> float:
        """How much dearer a speculative round is on the wall than its steps' timers say,
        relative to a plain step (1.0 until measured). The step timers time the graph runs only;
        a round also pays host work per call (pushes, pulls, proposer, accept), and on a small
        model that work is a large share of a round of six calls against one for plain decode
        (rounds priced by their step timers alone can run well below plain). Measured by the
        engine over steady rounds (``SPEC_ROUND`` timers) and plain rounds (``DECODE_ROUND``);
        before any plain round, a plain step is priced with the speculative rounds' host time
        per call."""
        clock = self.gen.clock
        calls = clock.steady(SPEC_ROUND_CALLS)
        device = clock.steady_seconds(SPEC_ROUND_DEVICE)
        if not calls or device <= 0:
            return 1.0
        wall = clock.steady_seconds(SPEC_ROUND)
        spec = wall / device
        plain_round, plain_step = self.mean(DECODE_ROUND), self.mean(DECODE)
        if plain_round and plain_step:
            plain = plain_round / plain_step
        else:
            plain = 1.0 + max(wall - device, 0.0) / calls / self.decode()
        return spec / plain

    def snapshot_ms(self) -> dict[str, float]:
        return self.gen.clock.means_ms()


class GatedRowCosts(StepCosts):
    """StepCosts where a plain round is one exit-gated row (ort_runtime/decoding/exits.py): its
    embedding, R loop steps (``full``: every loop runs) and one head. ``decode`` is that row's
    graph time, so the gate prices the gated pipeline's lanes against the plain gated rows."""

    ROW_KIND = LOOP_STEP  # the kind whose steady runs say a plain round was timed

    def mean(self, kind: str) -> float | None:
        if kind != DECODE:
            return super().mean(kind)
        clock = self.gen.clock
        embed, loop, head = (clock.mean(k) for k in (LOOP_EMBED, LOOP_STEP, EXIT_HEAD))
        if embed is None or loop is None or head is None:
            return None
        return embed + self.gen.model.config.num_loops * loop + head


class GateCounters:
    """What every gate reports."""

    def __init__(self, name: str, chosen_by: str) -> None:
        self.name, self.chosen_by = name, chosen_by
        self.rounds_on = self.steps_off = self.probes = self.transitions = 0
        self.engaged = False
        self.reason = "no step yet"

    def _switch(self, now: bool) -> None:
        if now != self.engaged:
            self.transitions += 1
            self.engaged = now

    def _count(self, k: int | None, probe: bool = False) -> int | None:
        if k:
            self.rounds_on += 1
            self.probes += int(probe)
        else:
            self.steps_off += 1
        return k or None

    def wants_evidence(self, step: int) -> bool:
        return False

    def fit(self, drafts: int, evidence: int | None) -> int:
        """How many of a proposal's ``drafts`` to verify (gates that price evidence: fewer,
        or 0 for a plain step); ``evidence``: the proposal's (``Proposal.evidence``)."""
        return drafts

    def plain_streak(self, step: int) -> int:
        """Steps from this one on that are sure to be plain (1: only this one)."""
        return 1

    def remember(self) -> None:
        """Keep what this generation learned for the next one (gates with memory)."""

    def report(self) -> dict:
        return {
            "name": self.name,
            "chosen_by": self.chosen_by,
            "rounds_on": self.rounds_on,
            "steps_off": self.steps_off,
            "probes": self.probes,
            "transitions": self.transitions,
            "reason": self.reason,
        }


class AlwaysGate(GateCounters):
    """Speculate on every step the proposer has drafts for."""

    def wants_evidence(self, step: int) -> bool:
        return True

    def __init__(self, k: int, chosen_by: str = "caller") -> None:
        super().__init__("always", chosen_by)
        self.k = k
        self.reason = "gate off: every step speculates"

    def engage(self, step: int) -> int | None:
        self._switch(True)
        return self._count(self.k)

    def observe(
        self,
        proposed: int,
        accepted: int,
        would_hit: bool | None = None,
        step: int = 0,
        evidence: int | None = None,
    ) -> None:
        pass


class HitDensityGate(GateCounters):
    """Engage while the fraction of recent steps whose proposal would have hit is high.

    Steps run as plain decode still count: the proposer's first draft is compared with the
    token decode produced (``would_hit``), which costs nothing for prompt lookup.
    """

    def wants_evidence(self, step: int) -> bool:
        return True

    def __init__(
        self,
        k: int,
        window: int = 16,
        threshold: float = 0.35,
        probe_every: int = 16,
        chosen_by: str = "caller",
    ) -> None:
        super().__init__("hit-density", chosen_by)
        self.k, self.threshold, self.probe_every = k, threshold, probe_every
        self.hits: deque[bool] = deque(maxlen=window)
        self._last_info = 0
        self._base_probe, self._probing = probe_every, False

    def engage(self, step: int) -> int | None:
        density = sum(self.hits) / len(self.hits) if self.hits else 1.0
        now = density >= self.threshold
        self._switch(now)
        self.reason = f"hit density {density:.2f} {'>=' if now else '<'} {self.threshold}"
        if not now and step - self._last_info >= self.probe_every:
            # Proposers without a free would-hit signal (self-drafts) learn only from rounds;
            # the interval doubles while probes keep missing.
            self._last_info = step
            self._probing = True
            return self._count(self.k, probe=True)
        return self._count(self.k if now else None)

    def observe(
        self,
        proposed: int,
        accepted: int,
        would_hit: bool | None = None,
        step: int = 0,
        evidence: int | None = None,
    ) -> None:
        if would_hit is not None:
            self.hits.append(would_hit)
            self._last_info = step
        elif proposed:
            self.hits.append(accepted > 0)
            self._last_info = step
            if self._probing:
                self.probe_every = self._base_probe if accepted > 0 else min(2 * self.probe_every, 256)
        self._probing = False


class CostGate(GateCounters):
    """Choose per step between plain decode and a speculative round of k drafts.

    With per-draft acceptance α (running estimate), a round of k drafts commits on average
    E(k) = 1 + α + … + α^k tokens at ``strategy.round_cost(costs, k)``. Engage with the k that
    maximises E(k)/cost when that beats 1/decode by ``margin`` (hysteresis: staying engaged
    only needs to lose less than ``margin``, so one unlucky round does not flip the gate).

    Engaged, the draft count follows the run where a round's price grows with its drafts (rows
    that are not computed cost nothing: variable-rows verify on the CPU, self-drafts): a round
    whose every draft was accepted lengthens the next by ``run_up``, a round with a rejection
    shortens it by ``run_down`` (Hugging Face's "heuristic" schedule for assisted generation),
    from the priced k at the first engagement, within 1..k_max. Runs of right drafts come in
    stretches (a copied passage, a repeated block), and the count that fits the stretch is one
    the running α, which weighs the stretch and the misses around it together, does not give.
    Where a round costs the same at every count (a fixed-width verify), every round takes the
    priced k.

    Disengaged, the gate still learns: from the free one-token guess of proposers that declare
    ``free_guess`` (prompt lookup), otherwise from probe rounds of one draft, the cheapest
    round that measures α. A probe wastes its wall price less the (1 + α) tokens it commits at
    decode's price; the next probe waits until that waste is at most ``probe_budget`` of the
    decode time spent since, and the wait doubles while probes leave the gate standing down,
    so a workload where speculation never pays loses at most about ``probe_budget`` to probing.

    A proposal that carries evidence (prompt lookup: the length of the match its drafts
    continue) is priced again at the acceptance seen for that evidence (``fit``): drafts after
    a one-token match are right far less often than drafts after a long copied run, and the
    run schedule's count, set by both together, over-drafts the first and stops the second
    short. Evidence 1..``EVIDENCE_CLASSES`` each keep their own α (the last class: that long
    or longer), started from the overall α and remembered like it.
    """

    EVIDENCE_CLASSES = 4

    def __init__(
        self,
        k_max: int,
        costs: StepCosts,
        strategy,
        *,
        free_guess: bool = False,
        margin: float = 0.05,
        prior_alpha: float = 0.6,
        probe_budget: float = 0.02,
        run_up: int = 2,
        run_down: int = 1,
        name: str = "cost",
        chosen_by: str = "caller",
        memory: dict | None = None,
    ) -> None:
        super().__init__(name, chosen_by)
        self.k_max, self.costs, self.strategy, self.margin = k_max, costs, strategy, margin
        self.free_guess, self.probe_budget = free_guess, probe_budget
        self.run_up, self.run_down = run_up, run_down
        self._run_k: int | None = None  # the draft count of the run schedule (None: not started)
        self._by_count = False  # whether the schedule sets k (re-read with each decision)
        self._provisional = False  # the decision waits on a measurement: re-decided next step
        # α = accepted / (accepted + rejections), as decayed counts: a ratio of sums, not a
        # mean of per-round ratios (which undercounts long accepted runs).
        self._accepted, self._trials = 2.0 * prior_alpha, 2.0
        self._next_probe, self._backoff = 0, 1
        # What earlier generations on this generator learned (α, the probe schedule): a new
        # request should not pay again to find out what the last one measured.
        self.memory = memory if memory is not None else {}
        if self.memory:
            self._accepted, self._trials = self.memory["accepted"], self.memory["trials"]
            self._next_probe, self._backoff = self.memory["probe_in"], self.memory["backoff"]
            run_k = self.memory.get("run_k")  # an earlier generation's, maybe at another k_max
            self._run_k = None if run_k is None else max(1, min(run_k, k_max))
        # evidence class -> [accepted, trials], decayed like the overall α (fit())
        self._by_evidence: dict[int, list[float]] = {
            int(c): list(v) for c, v in self.memory.get("by_evidence", {}).items()
        }
        self._round_prices: list[float] | None = None  # k -> a round's wall price (k - 1 indexed)
        self._probing = False
        self._step = 0
        self._decision, self._decided_at, self.refresh_every = None, 0, 16
        self._measuring, self.evidence_every = False, 4
        self.last_rate_ratio = None

    @property
    def alpha(self) -> float:
        return self._accepted / self._trials

    def best_k(self) -> tuple[int, float]:
        """The k with the best expected tokens/s (0: plain decode) and its rate over decode's."""
        plain = 1.0 / self.costs.decode()
        need = plain * (1 - self.margin if self.engaged else 1 + self.margin)
        rate = self.strategy.token_rate(self.costs, self.alpha)  # None: priced per round below
        if rate is not None:
            return (1 if rate > need else 0), max(rate, plain) / plain
        best_k, best_rate = 0, need
        host = self.costs.host_factor()
        for k in range(1, self.k_max + 1):
            expected = sum(self.alpha**i for i in range(k + 1))
            rate = expected / (self.strategy.round_cost(self.costs, k) * host)
            if rate > best_rate:
                best_k, best_rate = k, rate
        return best_k, max(best_rate, plain) / plain

    def engage(self, step: int) -> int | None:
        self._step = step
        if self._decision is None or self._provisional or step >= self._decided_at + self.refresh_every:
            # Re-priced when a round moved α or every refresh_every steps (the costs drift
            # slowly): a standing decision costs the host almost nothing per token, which
            # matters when a step takes half a millisecond. A decision taken while a kind is
            # still unmeasured holds for one step: the step that measures it re-decides.
            self._decision, self._decided_at = self._decide(), step
            self.reason = self._decision[1]
        k = self._decision[0]
        self._switch(k > 0)
        if k:
            if self._by_count:
                if self._run_k is None:
                    self._run_k = k
                k = self._run_k
            return self._count(k)
        if (self._measuring or not self.free_guess) and step >= self._next_probe:
            self._probing = True
            return self._count(1, probe=True)
        return self._count(None)

    def _evidence_class(self, evidence: int) -> list[float]:
        c = max(1, min(int(evidence), self.EVIDENCE_CLASSES))
        if c not in self._by_evidence:
            self._by_evidence[c] = [2.0 * self.alpha, 2.0]  # starts from the overall α
        return self._by_evidence[c]

    def fit(self, drafts: int, evidence: int | None) -> int:
        """The draft count (at most ``drafts``) with the best expected rate at the acceptance
        of drafts with this ``evidence``; 0 where a plain step beats every count. All of them
        without evidence or before the round prices are known."""
        prices = self._round_prices
        if evidence is None or not drafts or prices is None:
            return drafts
        accepted, trials = self._evidence_class(evidence)
        alpha = accepted / trials
        best, best_rate, expected = 0, 1.0 / self.costs.decode(), 1.0
        for k in range(1, min(drafts, len(prices)) + 1):
            expected += alpha**k
            rate = expected / prices[k - 1]
            if rate > best_rate:
                best, best_rate = k, rate
        return best

    def _priced_by_count(self) -> bool:
        """Whether a round's price grows with its drafts (then the run schedule sets k)."""
        if self.k_max < 2 or self.strategy.token_rate(self.costs, self.alpha) is not None:
            return False
        cost = self.strategy.round_cost
        return cost(self.costs, self.k_max) > cost(self.costs, 1)

    def plain_streak(self, step: int) -> int:
        """How many plain steps from ``step`` on (this one included) need no decision: the
        gate stands down and nothing is due before then (re-pricing, a probe, or for a
        free-guess proposer the next evidence step). The engine runs them back to back."""
        if self._decision is None or self._decision[0] or self._measuring or self._provisional:
            return 1
        until = self._decided_at + self.refresh_every
        if self.free_guess:
            until = min(until, step + self.evidence_every - step % self.evidence_every)
        else:
            until = min(until, max(self._next_probe, step + 1))
        return max(1, until - step)

    def wants_evidence(self, step: int) -> bool:
        """Whether a plain step should take the proposer's free one-token guess: every step
        while engaged, every ``evidence_every`` steps while stood down (enough to notice a
        workload turning predictable, at a quarter of the host work)."""
        return self.engaged or step % self.evidence_every == 0

    def _decide(self) -> tuple[int, str]:
        # Decode is the price to beat: nothing is priced against a guessed decode time (a guess
        # off by 2x keeps a losing mode engaged).
        self._measuring = any(self.costs.mean(kind) is None for kind in self.strategy.kinds)
        self._provisional = self._measuring or self.costs.mean(DECODE) is None
        if self._measuring:
            # Unmeasured kinds: price nothing on guesses; probe rounds of one draft time them.
            self._next_probe = min(self._next_probe, self._step)
            return 0, "measuring: rounds of one draft time the speculative kinds first"
        if self.costs.mean(DECODE) is None:
            return 0, "measuring: plain steps time decode first"
        k, ratio = self.best_k()
        self.last_rate_ratio = ratio
        self._by_count = self._priced_by_count()
        if self.strategy.token_rate(self.costs, self.alpha) is None:
            host = self.costs.host_factor()
            self._round_prices = [
                self.strategy.round_cost(self.costs, j) * host for j in range(1, self.k_max + 1)
            ]
        if k:
            return k, f"engaged: α={self.alpha:.2f}, k={k} expected at {ratio:.2f}x plain decode"
        return 0, f"stood down: α={self.alpha:.2f}, no k beats plain decode by {self.margin:.0%}"

    def observe(
        self,
        proposed: int,
        accepted: int,
        would_hit: bool | None = None,
        step: int = 0,
        evidence: int | None = None,
    ) -> None:
        # A strategy whose rounds carry one draft each (the pipeline) remembers more rounds.
        decay = self.strategy.caps.alpha_decay
        if proposed:  # a round moved α (and timed its kinds): re-price on the next step
            if self._run_k is not None and not self._probing:
                if accepted >= proposed:
                    self._run_k = min(self.k_max, self._run_k + self.run_up)
                else:
                    self._run_k = max(1, self._run_k - self.run_down)
            self._decision = None
            self._accepted = decay * self._accepted + accepted
            self._trials = decay * self._trials + accepted + (1 if accepted < proposed else 0)
            if evidence is not None:
                counts = self._evidence_class(evidence)
                counts[0] = decay * counts[0] + accepted
                counts[1] = decay * counts[1] + accepted + (1 if accepted < proposed else 0)
            if self._probing:
                # Every probe schedules the next one. A probe that leaves the gate standing down
                # stretches the wait (doubling), even when its draft was accepted: drafts can hit
                # often without paying, and a wait reset on every hit would make probing cost
                # more than its budget. Except a hit of a strategy with persistent lanes (the
                # pipeline): its α remembers ~50 drafts and moves only through probes, one draft
                # each, so hits must keep them coming or α never reaches the acceptance. The
                # waste is the round's wall price (host work in) less the tokens it commits.
                keep = self.best_k()[0] or (accepted and self.strategy.caps.persistent_lanes)
                self._backoff = 1 if keep else min(self._backoff * 2, 16)
                host = self.costs.host_factor()
                price = self.strategy.round_cost(self.costs, 1) * host / self.costs.decode()
                waste = max(price - 1.0 - self.alpha, 0.05)
                self._next_probe = step + int(self._backoff * waste / self.probe_budget)
        elif would_hit is not None:
            # Free evidence from a plain step (prompt lookup): one draft, hit or miss.
            self._accepted = decay * self._accepted + float(would_hit)
            self._trials = decay * self._trials + 1.0
            if evidence is not None:
                counts = self._evidence_class(evidence)
                counts[0] = decay * counts[0] + float(would_hit)
                counts[1] = decay * counts[1] + 1.0
        self._probing = False

    def report(self) -> dict:
        out = super().report()
        host = self.costs.host_factor()
        out.update(
            alpha=round(self.alpha, 4),
            alpha_by_evidence={c: round(a / t, 4) for c, (a, t) in sorted(self._by_evidence.items())},
            run_drafts=self._run_k,
            costs_ms=self.costs.snapshot_ms(),
            host_factor=round(host, 3),
            expected_ratio=None if self.last_rate_ratio is None else round(self.last_rate_ratio, 4),
        )
        return out

    def remember(self) -> None:
        """Keep what this generation learned for the next one on the same generator."""
        self.memory.update(
            accepted=self._accepted,
            trials=self._trials,
            backoff=self._backoff,
            probe_in=max(self._next_probe - self._step, 0),
            run_k=self._run_k,
            by_evidence={c: list(v) for c, v in self._by_evidence.items()},
        )


def make_gate(
    name: str, k_max: int, costs: StepCosts, strategy, *, free_guess: bool, memory: dict | None = None
):
    """The gate called ``name``; ``auto`` is the calibrated cost gate (see the module doc).
    ``memory``: the state earlier generations of this generator left (cost gates only)."""
    if name == "auto":
        return CostGate(
            k_max, costs, strategy, free_guess=free_guess, name="cost", chosen_by="auto", memory=memory
        )
    if name == "cost":
        return CostGate(k_max, costs, strategy, free_guess=free_guess, memory=memory)
    if name == "hit-density":
        return HitDensityGate(k_max)
    if name == "always":
        return AlwaysGate(k_max)
    raise RequestError(f"gate must be one of {', '.join(GATES)}, got {name!r}")
