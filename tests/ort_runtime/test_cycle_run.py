"""The cycle run: the pipeline's greedy lanes, K cycles per call with the lane schedule on the
device (graphs/cycles.py, loopcast.LaneStep), return plain greedy's tokens, and the device's
schedule is the host scheduler's cycle for cycle (CPU fp32).

Every cycle of a device run is compared with the same generation scheduled by the host one
cycle per call, and with the teacher-forced serial reference of test_pipeline.py; generations
that stop inside a run (EOS, the length limit, the KV capacity) leave the generator where plain
decoding leaves it."""

from __future__ import annotations

import numpy as np
import pytest
from loopcast.ort_runtime import load

from loopcast.manifest import CYCLE, CYCLE_RUN, DECODE, DRAFT, PREFILL, VERIFY, VERIFY_TAIL
from tests.artifacts import artifact

# the fixtures too: exact CPU artifacts required for the module, one loaded demo model
from tests.ort_runtime.test_pipeline import LOOPED, _exact_artifacts, check_cycles, demo, draft_reference, run  # noqa: F401


def _active(cycle: tuple) -> tuple:
    """A trace entry without what inactive rows hold (their rows compute on leftover states)."""
    positions, ids, entering = cycle
    return (
        positions,
        [t if p >= 0 else None for p, t in zip(positions, ids)],
        entering if positions[0] >= 0 else None,
    )


def _first_difference(a: list, b: list) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if _active(x) != _active(y)), None)


@pytest.mark.parametrize("name", LOOPED)
def test_device_schedule_is_the_host_schedule_cycle_for_cycle(name: str) -> None:
    model = load(artifact(name))
    gen = model.new_generator()
    R = model.config.num_loops
    rng = np.random.default_rng(5)
    prompt = rng.integers(0, model.config.vocab_size, 6).tolist()
    plain, _ = run(gen, prompt, 48)
    sequence = prompt + plain
    drafts = draft_reference(gen, sequence, len(prompt))
    for exit_depth in range(1, R):
        device, d_stats = run(
            gen, prompt, 48, speculative="pipeline", gate="always", pipeline_exit=exit_depth, trace=True
        )
        calls = gen.clock.runs(CYCLE_RUN)
        host, h_stats = run(
            gen,
            prompt,
            48,
            speculative="pipeline",
            gate="always",
            pipeline_exit=exit_depth,
            trace=True,
            pipeline_device_lanes=False,
        )
        assert device == host == plain, exit_depth
        d_trace, h_trace = d_stats.pipeline_trace, h_stats.pipeline_trace
        # The host stops at the last token; the device finishes its run (at most K - 1 cycles more).
        assert len(h_trace) <= len(d_trace) < len(h_trace) + gen.cycle_run.cycles
        assert _first_difference(d_trace, h_trace) is None, (exit_depth, _first_difference(d_trace, h_trace))
        assert (
            check_cycles(d_trace, sequence, len(prompt), R, exit_depth, drafts if exit_depth == 1 else None)
            >= len(plain) - 1
        )
        assert (d_stats.accepted, d_stats.proposed) == (h_stats.accepted, h_stats.proposed)
        assert d_stats.cycles == len(d_trace) > 0 and calls > 0


def test_demo_equals_plain_and_counts_every_cycle(demo) -> None:  # noqa: F811  (the fixture imported above)
    from tests.ort_runtime.test_generator import DEMO_PROMPTS

    K = None
    for prompt in DEMO_PROMPTS[:6]:
        plain = demo.generate(prompt, 64)
        for gate in ("always", "auto"):
            got = demo.generate(prompt, 64, speculative="pipeline", gate=gate)
            assert got.tokens == plain.tokens and got.finish_reason == plain.finish_reason, (prompt, gate)
        gen = demo.new_generator()
        got, stats = run(gen, demo.encode(prompt), 64, speculative="pipeline", gate="always")
        K = gen.cycle_run.cycles
        # the first round (from plain decoding) cycle by cycle, every later one in runs
        R = demo.config.num_loops
        assert gen.clock.runs(CYCLE) == R and stats.cycles == K * gen.clock.runs(CYCLE_RUN) + R
        assert stats.core_calls_per_token == pytest.approx(stats.cycles / len(got), abs=1e-4)
    assert K is not None and K >= demo.config.num_loops


def test_eos_and_length_limit_inside_a_run(demo) -> None:  # noqa: F811  (the fixture imported above)
    gen = demo.new_generator()
    prompt = demo.encode("class Queue:\n    def __init__(self):\n")
    plain, _ = run(gen, prompt, 48)
    for i in (0, 3, 9, 20):
        eos = plain[i]
        want, want_stats = run(gen, prompt, 48, stop_ids=(eos,))
        n_after = gen.n
        got, stats = run(gen, prompt, 48, stop_ids=(eos,), speculative="pipeline", gate="always")
        assert got == want and stats.finish_reason == want_stats.finish_reason == "eos"
        assert gen.n == n_after
        # the rounds the run finished past the stop are dropped: plain decoding goes on exactly
        cont = list(demo.stream_ids([want[-1]], 12, stop_ids=(), generator=gen))
        assert want + cont == plain[: len(want) + 12]
    for limit in (1, 2, 5, 17):
        got, stats = run(gen, prompt, limit, speculative="pipeline", gate="always")
        assert got == plain[:limit] and stats.finish_reason == "length"
        assert gen.n == len(prompt) + limit - 1
    assert run(gen, prompt, 48)[0] == plain


def test_kv_capacity_inside_a_run() -> None:
    """No lane of a run is placed past the KV capacity; the generation ends there as plain does."""
    model = load(artifact("ouro-r4-1layer", max_length=24))
    gen = model.new_generator()
    prompt = [5, 9, 2, 11]
    plain, plain_stats = run(gen, prompt, 100)
    assert plain_stats.finish_reason == "length"
    got, stats = run(gen, prompt, 100, speculative="pipeline", gate="always", trace=True)
    assert got == plain and stats.finish_reason == "length" and gen.clock.runs(CYCLE_RUN) > 0
    assert all(p < 24 for positions, _, _ in stats.pipeline_trace for p in positions)


def test_without_the_run_graph_lanes_go_one_cycle_per_call(demo) -> None:  # noqa: F811  (the fixture imported above)
    """An artifact opened without cycle_run (or exported before it) schedules lanes on the host."""
    model = load(artifact("demo"), kinds=(PREFILL, DECODE, VERIFY, DRAFT, VERIFY_TAIL, CYCLE))
    gen = model.new_generator()
    prompt = demo.encode("def add(a, b):\n")
    plain, _ = run(gen, prompt, 24)
    got, stats = run(gen, prompt, 24, speculative="pipeline", gate="always")
    assert got == plain and gen.clock.runs(CYCLE) > 0 and not gen.has_kind(CYCLE_RUN)
