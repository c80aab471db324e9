"""The cost gate's rules on fixed costs (no model): the draft count that follows the run, the
fixed-width rounds that keep the priced k, and decisions that wait on a measurement."""

from __future__ import annotations

from loopcast.ort_runtime.decoding.gates import CostGate
from loopcast.ort_runtime.decoding.protocols import CostsBase, VerifierBase


class Costs(CostsBase):
    """Decode 1.0 once measured (``decode_measured``), verify 1.2."""

    def __init__(self, decode_measured: bool = True) -> None:
        self.decode_measured = decode_measured

    def decode(self) -> float:
        return 1.0

    def mean(self, kind: str) -> float | None:
        if kind == "decode":
            return 1.0 if self.decode_measured else None
        return {"verify": 1.2}.get(kind)


class ByCount(VerifierBase):
    """A round's price grows with its drafts (the CPU's variable-rows verify)."""

    kinds = ("verify",)

    def round_cost(self, costs, k: int) -> float:
        return 1.0 + 0.05 * k


class FixedWidth(ByCount):
    """Every round costs the full width (a fixed-width verify graph)."""

    def round_cost(self, costs, k: int) -> float:
        return 1.4


def test_the_draft_count_follows_the_run_where_rounds_are_priced_by_count() -> None:
    gate = CostGate(7, Costs(), ByCount())
    first = gate.engage(0)
    assert first is not None and first > 1
    gate.observe(first, 0, step=0)  # a rejection: one draft fewer
    assert gate.engage(1) == first - 1
    gate.observe(first - 1, first - 1, step=1)  # every draft right: two more
    assert gate.engage(2) == min(7, first + 1)
    for step in range(3, 10):  # a long run of right drafts: up to k_max, no further
        k = gate.engage(step)
        gate.observe(k, k, step=step)
    assert gate.engage(10) == 7 and gate.report()["run_drafts"] == 7
    for step in range(11, 30):  # misses: down to one draft, no further
        k = gate.engage(step)
        if not k:
            break
        gate.observe(k, 0, step=step)
    assert gate.report()["run_drafts"] == 1
    # the next generation on the same generator starts where this one left off, within its
    # own k_max (a request may ask for fewer drafts)
    gate.remember()
    assert CostGate(7, Costs(), ByCount(), memory=gate.memory).engage(0) in (None, 1)
    for step in range(4):
        gate.observe(1, 1, step=step)
        gate.engage(step)
    gate.remember()
    assert gate.memory["run_k"] > 3
    assert CostGate(3, Costs(), ByCount(), memory=gate.memory).engage(0) == 3


def test_fixed_width_rounds_take_the_priced_k_whatever_the_run() -> None:
    gate = CostGate(7, Costs(), FixedWidth())
    priced = gate.engage(0)
    assert priced is not None
    for step in range(1, 6):
        gate.observe(priced, 0 if step % 2 else priced, step=step)
        k = gate.engage(step)
        assert k in (None, gate.best_k()[0]) and gate.report()["run_drafts"] is None


def test_a_decision_waiting_on_the_decode_time_is_taken_again_on_the_next_step() -> None:
    """Before decode is timed the gate runs plain steps; the first one that times it lets the
    next step engage, instead of holding the wait for the whole re-pricing interval."""
    costs = Costs(decode_measured=False)
    gate = CostGate(7, costs, ByCount(), free_guess=True)
    assert not gate.engage(1) and "measuring" in gate.reason
    assert gate.plain_streak(1) == 1  # no streak of plain steps past the measurement
    costs.decode_measured = True  # the plain step timed decode
    assert gate.engage(2) and "engaged" in gate.reason


def test_drafts_are_priced_again_at_the_acceptance_of_their_evidence() -> None:
    """Drafts after short matches that keep missing are cut (to none: a plain step), drafts after
    long matches that keep hitting are all verified, and drafts without evidence are untouched;
    each evidence class starts from the overall α and is remembered for the next generation."""
    gate = CostGate(7, Costs(), ByCount(), free_guess=True)
    k = gate.engage(0)
    assert k and gate.fit(k, 2) == gate.fit(k, 3)  # unseen classes: both the overall α
    for step in range(1, 40):
        gate.observe(k, 0, step=step, evidence=1)  # one-token matches: every first draft wrong
        gate.observe(0, 0, would_hit=False, step=step, evidence=1)
        gate.observe(k, k, step=step, evidence=5)  # long matches: every draft right
        gate.engage(step)
    assert gate.fit(7, 1) == 0
    assert gate.fit(7, 4) == 7 and gate.fit(7, 16) == 7  # 4 and longer: one class
    assert gate.fit(3, None) == 3
    report = gate.report()["alpha_by_evidence"]
    assert report[1] < 0.1 and report[4] > 0.9
    gate.remember()
    again = CostGate(7, Costs(), ByCount(), free_guess=True, memory=gate.memory)
    again.engage(0)
    assert again.fit(7, 1) == 0 and again.fit(7, 4) == 7


def test_a_fixed_width_round_is_never_cut_short_by_evidence() -> None:
    """Where every round costs the full width, fewer drafts save nothing: the count is all of
    them or none."""
    gate = CostGate(7, Costs(), FixedWidth(), free_guess=True)
    gate.engage(0)
    for step in range(1, 6):
        gate.observe(5, 2, step=step, evidence=2)
        gate.engage(step)
    assert gate.fit(5, 2) in (0, 5)
