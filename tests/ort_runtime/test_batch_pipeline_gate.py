"""``BatchCostGate.engage_pipeline``: which pipeline requests run lanes, from given step costs and
observed rates (ort_runtime/batching/batch_gate.py)."""

from __future__ import annotations

from loopcast.ort_runtime.batching.batch_gate import BatchCostGate

from loopcast.manifest import CYCLE_BATCH, DECODE_BATCH


def _gate(t_decode: float | None, t_cycle: float | None, width: int = 4) -> BatchCostGate:
    gate = BatchCostGate(probe_every=8)
    if t_decode is not None:
        gate.cost[(DECODE_BATCH, width)] = t_decode
    if t_cycle is not None:
        gate.cost[(CYCLE_BATCH, width)] = t_cycle
    return gate


def _steady(gate: BatchCostGate, slot: int, rate: float, cycles: int = 200) -> None:
    """Feed ``slot`` a commit pattern of the given rate (after its first commit)."""
    gate.observe_pipeline(slot, True)
    acc = 0.0
    for _ in range(cycles):
        acc += rate
        gate.observe_pipeline(slot, acc >= 1.0)
        acc -= float(acc >= 1.0)


def test_plain_first_then_the_cycle_is_tried():
    assert _gate(None, None).engage_pipeline(4, 4, [0, 1, 2, 3], loops=4) == set()
    assert _gate(1.0, None).engage_pipeline(4, 4, [0, 1, 2, 3], loops=4) == {0, 1, 2, 3}


def test_rates_against_costs():
    # a cycle costs a third of a decode step: the pipeline pays above a rate of 1/3 per cycle
    gate = _gate(3.0, 1.0)
    for slot, rate in ((0, 0.9), (1, 0.8), (2, 0.1), (3, 0.1)):
        _steady(gate, slot, rate)
    # plain: 4 / 3 = 1.33 tokens per unit; lanes for all four: (1.9 + 0.2) / 1 = 2.1
    assert gate.engage_pipeline(4, 4, [0, 1, 2, 3], loops=4) == {0, 1, 2, 3}
    slow = _gate(3.0, 2.5)  # a cycle nearly a decode step's cost: only fast requests, or none
    for slot, rate in ((0, 0.95), (1, 0.9), (2, 0.1), (3, 0.05)):
        _steady(slow, slot, rate)
    # all four: 2.0 / 2.5 = 0.8; the fast two: (1.85 + 2) / (2.5 + 3) = 0.7; plain 1.33: off
    assert slow.engage_pipeline(4, 4, [0, 1, 2, 3], loops=4) == set()
    # a subset pays a cycle and a decode call: (Σρ_taken + plain) / (t_cycle + t_decode) never
    # beats both all-lanes and all-plain (a mediant), so a step is all lanes or none
    for t_cycle in (0.5, 1.0, 2.0, 4.0):
        mixed = _gate(3.0, t_cycle)
        for slot, rate in ((0, 0.95), (1, 0.9), (2, 0.0), (3, 0.0)):
            _steady(mixed, slot, rate)
        assert mixed.engage_pipeline(4, 4, [0, 1, 2, 3], loops=4) in (set(), {0, 1, 2, 3})


def test_a_choice_holds_for_an_epoch_and_joiners_meet_its_floor():
    gate = _gate(3.0, 1.0)
    _steady(gate, 0, 0.9)
    assert gate.engage_pipeline(4, 2, [0, 1], loops=3) == {0, 1}  # slot 1: the prior (0.9-ish)
    _steady(gate, 0, 0.0, cycles=50)  # its rate collapses, but the epoch holds the choice
    assert 0 in gate.engage_pipeline(4, 2, [0, 1], loops=3)
    assert 0 in gate.engage_pipeline(4, 2, [0, 1], loops=3)
    assert 0 not in gate.engage_pipeline(4, 2, [0, 1], loops=3)  # the next epoch re-decides


def test_fill_cycles_do_not_count_and_a_stopped_request_fills_again():
    gate = _gate(3.0, 1.0)
    for _ in range(10):
        gate.observe_pipeline(0, False)  # the lanes' fill: no commit yet
    assert 0 not in gate._pipe_rate
    gate.observe_pipeline(0, True)
    assert gate._pipe_rate[0] == 1.0
    gate.pipeline_stopped(0)
    gate.observe_pipeline(0, False)
    assert gate._pipe_rate[0] == 1.0


def test_off_then_a_probe_epoch():
    gate = _gate(1.0, 5.0)  # the cycle never pays
    _steady(gate, 0, 0.5)
    taken = [gate.engage_pipeline(4, 1, [0], loops=2) for _ in range(9)]
    assert taken[:7] == [set()] * 7 and taken[7] == {0}  # the 8th step off probes
    assert gate.report()["probes"] == 1


def test_probes_back_off_while_the_cycle_never_pays_and_start_over_when_it_does():
    """Each probe epoch that ends off doubles the gap to the next (8, 16, 32, ...: a probe's lanes
    are dropped before they fill); once the prices turn the lanes on, the gap is 8 again."""
    gate = _gate(1.0, 5.0)  # the cycle never pays
    _steady(gate, 0, 0.5)
    taken = [gate.engage_pipeline(4, 1, [0], loops=1) for _ in range(8 + 16 + 32 + 1)]
    probes = [i for i, t in enumerate(taken) if t]
    assert probes == [7, 23, 55]  # after 8, 16 and 32 off steps
    assert gate.report()["probes"] == 3
    gate.cost[(CYCLE_BATCH, 4)] = 0.1  # now it pays: on by its prices
    assert gate.engage_pipeline(4, 1, [0], loops=1) == {0}
    gate.cost[(CYCLE_BATCH, 4)] = 5.0
    taken = [gate.engage_pipeline(4, 1, [0], loops=1) for _ in range(9)]
    assert [i for i, t in enumerate(taken) if t] == [7]  # the gap started over at 8


def test_a_wider_unmeasured_width_is_priced_by_its_rows_until_measured():
    """Above every measured width a cycle is priced at the widest one's cost times the ratio of
    the widths (an upper bound), not by the decode costs' ratio: a cycle's R rows a slot grow
    with the width faster than decode's one, and the H200 C = 32 level turned the lanes on at
    each new width that way, then off again once it was measured."""
    gate = _gate(5.9, 2.46, width=8)
    gate.cost[(DECODE_BATCH, 32)] = 10.25
    slots = list(range(32))
    for slot in slots:
        _steady(gate, slot, 0.8)
    # 2.46 · 32/8 = 9.84: 32 · 0.8 / 9.84 = 2.6 tokens a ms against plain 32 / 10.25 = 3.1
    assert gate._scaled(CYCLE_BATCH, 32) == 2.46 * 4
    assert gate.engage_pipeline(32, 32, slots, loops=4) == set()
    # measured at 6.3 ms: 32 · 0.8 / 6.3 = 4.1 beats 3.1 (with the margin): lanes
    gate.cost[(CYCLE_BATCH, 32)] = 6.3
    gate._pipe_epoch = 0
    assert gate.engage_pipeline(32, 32, slots, loops=4) == set(slots)
    # between two measured widths: linear between them
    assert abs(gate._scaled(CYCLE_BATCH, 20) - (2.46 + (6.3 - 2.46) * 12 / 24)) < 1e-12
    # below every measured width: the narrowest one's cost scaled by the decode costs
    gate.cost[(DECODE_BATCH, 4)] = 5.0
    assert abs(gate._scaled(CYCLE_BATCH, 4) - 2.46 * 5.0 / 5.9) < 1e-12
    assert gate._scaled(CYCLE_BATCH, 2) is None  # no decode cost there to scale by
