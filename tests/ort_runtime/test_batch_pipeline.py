"""The pipeline inside the continuous batch (ort_runtime/batching/pipeline_lanes.py): pipeline
requests' lanes share one cycle_batch call per step while other requests take decode_batch rows,
and every response equals plain greedy generation alone: concurrency 16, requests joining and
leaving mid-flight, forced rejections (none, every third, all), stop ids, max_tokens and the KV
length limit with lanes in flight, a cached prefix (CPU, fp32, loopcast-attention)."""

from __future__ import annotations

import random

import pytest
from loopcast.ort_runtime import load
from loopcast.ort_runtime.batching.batch_gate import BatchCostGate
from loopcast.ort_runtime.batching.engine import BatchingEngine, BatchRequest
from loopcast.ort_runtime.binding.batch_generator import BatchGenerator
from loopcast.ort_runtime.decoding.sampling import SamplingParams

from tests.artifacts import artifact, require_exact_cpu_artifacts


@pytest.fixture(scope="module")
def model():
    require_exact_cpu_artifacts()
    return load(artifact("ouro-r3", max_batch=16, max_length=64))


def _requests(seed: int, n: int, modes=("pipeline", "pipeline", "pipeline", "none")):
    rng = random.Random(seed)
    return [
        BatchRequest(
            [rng.randrange(90) for _ in range(rng.randrange(1, 9))],
            rng.randrange(2, 20),
            speculative=modes[i % len(modes)],
        )
        for i in range(n)
    ]


def _plain(model, r: BatchRequest) -> list[int]:
    return list(model.stream_ids(r.ids, r.max_new_tokens, stop_ids=r.stop_ids))


def _oracle(model, requests, wrong_every: int = 0):
    """Drafts from plain greedy's continuation (every draft right), or wrong at every
    ``wrong_every``-th position (1: every draft wrong)."""
    full = [r.ids + list(model.stream_ids(r.ids, r.max_new_tokens + 4, stop_ids=())) for r in requests]

    def perturb(sequence, token):
        if wrong_every and len(sequence) % wrong_every == 0:
            return (token + 1) % 90
        for seq in full:
            if len(seq) > len(sequence) and seq[: len(sequence)] == sequence:
                return seq[len(sequence)]
        return token

    return perturb


class _AlwaysPipeline(BatchCostGate):
    """Every pipeline request runs its lanes on every step (the schedule under test)."""

    def engage_pipeline(self, width, running, candidates, loops):
        return set(candidates)


class _Switching(BatchCostGate):
    """Lanes on for ``on`` steps, then plain rows for ``off``: lanes dropped mid-flight."""

    def __init__(self, on: int, off: int) -> None:
        super().__init__()
        self.on, self.off, self.calls = on, off, 0

    def engage_pipeline(self, width, running, candidates, loops):
        self.calls += 1
        if self.calls % (self.on + self.off) < self.on:
            return set(candidates)
        return set(candidates[::2]) if self.calls % 2 else set()  # some requests, or none


def _run(model, requests, max_batch=16, gate=None, **options):
    gate = gate or _AlwaysPipeline()
    engine = BatchingEngine(BatchGenerator(model.loaded, max_batch), gate=gate, **options).start()
    try:
        done = [engine.submit(r) for r in requests]
        return [c.result(300) for c in done], done, engine.stats
    finally:
        engine.shutdown()


@pytest.mark.parametrize("wrong_every", [None, 0, 3, 1], ids=["model", "oracle", "every-third", "all-wrong"])
def test_pipeline_requests_equal_plain_greedy_at_concurrency_16(model, wrong_every):
    requests = _requests(0, 24)  # 24 requests through 16 slots: they join and leave mid-flight
    expected = [_plain(model, r) for r in requests]
    options = {} if wrong_every is None else {"self_perturb": _oracle(model, requests, wrong_every)}
    got, done, stats = _run(model, requests, **options)
    assert got == expected
    assert stats["pipeline_cycles"] > 0 and stats["proposed"] > 0
    assert {c.speculative for c in done} == {"pipeline", "none"}
    piped = [c for c in done if c.speculative == "pipeline"]
    accepted, proposed = sum(c.accepted for c in piped), sum(c.proposed for c in piped)
    if wrong_every == 0:
        assert accepted == proposed
    elif wrong_every == 1:
        assert accepted == 0
    elif wrong_every == 3:
        assert 0 < accepted < proposed


@pytest.mark.parametrize("on, off", [(1, 1), (3, 2), (5, 7)])
def test_lanes_dropped_and_restarted_by_the_gate_keep_plain_tokens(model, on, off):
    """The gate stands the pipeline down and up again mid-flight, for all pipeline requests or
    some of them: their lanes are dropped (plain rows take over) and restart cold."""
    requests = _requests(5, 16)
    got, _, stats = _run(model, requests, gate=_Switching(on, off), self_perturb=_oracle(model, requests, 3))
    assert got == [_plain(model, r) for r in requests]
    assert stats["pipeline_cycles"] > 0 and stats["decode_steps"] > 0


def test_the_default_gate_keeps_plain_tokens(model):
    requests = _requests(6, 16)
    got, _, _ = _run(model, requests, gate=BatchCostGate(), self_perturb=_oracle(model, requests, 3))
    assert got == [_plain(model, r) for r in requests]


def test_warm_up_captures_every_width_at_start_and_keeps_plain_tokens(model):
    """With captured graphs the engine runs every width of every batched kind once at start
    (dummy rows, unused cycle rows), so serving makes no new binding; the dummy rows' KV writes
    change no token, a cached prefix included."""
    from tests.ort_runtime.test_batch_decode import captured_stand_ins

    fake, stand_ins = captured_stand_ins(model.loaded)
    gen = BatchGenerator(fake, 8, cuda_graphs="always")
    kinds = sorted(gen.captured)
    assert len(kinds) == 4
    requests = _requests(8, 12)
    requests += [BatchRequest(requests[0].ids + [7, 8], 6, speculative="pipeline")]  # a cached prefix
    engine = BatchingEngine(gen, gate=_AlwaysPipeline(), self_perturb=_oracle(model, requests, 3)).start()
    try:
        assert engine.stats["warm_up_runs"] == 5 * 8  # 4 kinds and cycle_batch, widths 1..8
        runs = {k: len(stand_ins[k].graph_ids) for k in (*kinds, "cycle_batch")}
        assert runs == {k: 8 for k in (*kinds, "cycle_batch")}
        before = set(gen._runners) | {("cycle_batch", w) for w in engine.pipeline.cycle._runners}
        got = [c.result(300) for c in [engine.submit(r) for r in requests]]
        after = set(gen._runners) | {("cycle_batch", w) for w in engine.pipeline.cycle._runners}
    finally:
        engine.shutdown()
    assert got == [_plain(model, r) for r in requests]
    assert engine.stats["prefix_hits"] >= 1 and engine.stats["pipeline_cycles"] > 0
    assert after == before  # every step replayed a width made at start
    assert gen.warm_up() == 0 and engine.pipeline.cycle.warm_up() == 0  # made once


def test_dummy_rows_over_lanes_in_flight_are_caught(model, monkeypatch):
    """Without ``hold`` a pipeline slot's decode_batch dummy row writes at its committed length,
    over KV its younger lanes read: the equality above fails (the test can fail)."""
    monkeypatch.setattr(BatchGenerator, "hold", lambda self, slot, count: None)
    requests = _requests(2, 8, modes=("pipeline", "none"))
    got, _, _ = _run(model, requests, max_batch=8, self_perturb=_oracle(model, requests))
    assert got != [_plain(model, r) for r in requests]


def test_stop_ids_max_tokens_and_the_kv_limit_with_lanes_in_flight(model):
    """A stop id and max_tokens reached while younger lanes are in flight, and requests running
    into the KV capacity (64): plain greedy's tokens and finish reasons."""
    base = _plain(model, BatchRequest([5, 6, 7], 12))
    long_prompt = [(3 * i) % 90 for i in range(50)]
    requests = [
        BatchRequest([5, 6, 7], 12, stop_ids=(base[4],), speculative="pipeline"),
        BatchRequest([5, 6, 7], 7, speculative="pipeline"),
        BatchRequest(long_prompt, 40, speculative="pipeline"),  # stops with "length" at 64
        BatchRequest(long_prompt[:45], 40, speculative="pipeline"),
        BatchRequest([1, 2], 9),
    ]
    perturb = _oracle(model, requests)
    got, done, _ = _run(model, requests, max_batch=4, self_perturb=perturb)
    assert got == [_plain(model, r) for r in requests]
    assert done[0].finish_reason == "eos" and got[0][-1] == base[4]
    assert [c.finish_reason for c in done[1:]] == ["length", "length", "length", "length"]
    assert len(got[2]) == 64 - 50 + 1 and len(got[3]) == 64 - 45 + 1  # the last token needs no KV


def test_a_cached_prefix_gives_the_cold_tokens(model):
    prefix = [(7 * i) % 90 for i in range(20)]
    requests = [BatchRequest(prefix + [1, 2], 12, speculative="pipeline") for _ in range(2)]
    requests += [BatchRequest(prefix + [3], 10, speculative="pipeline")]
    engine = BatchingEngine(BatchGenerator(model.loaded, 4), gate=_AlwaysPipeline()).start()
    try:
        first = engine.submit(requests[0])
        assert first.result(120) == _plain(model, requests[0])
        later = [engine.submit(r) for r in requests[1:]]
        assert [c.result(120) for c in later] == [_plain(model, r) for r in requests[1:]]
        assert all(c.cached_tokens >= 20 for c in later)
    finally:
        engine.shutdown()


def test_sampled_pipeline_requests_decode_plainly_and_say_why(model):
    params = SamplingParams(temperature=0.8, seed=1)
    _, done, _ = _run(model, [BatchRequest([4, 5], 6, sampling=params, speculative="pipeline")], max_batch=2)
    assert done[0].speculative == "none (the batched pipeline runs greedy requests only)"


def test_without_cycle_batch_pipeline_is_refused(model):
    older = load(model.loaded.path, kinds=("prefill", "decode", "verify", "decode_batch", "verify_batch"))
    engine = BatchingEngine(BatchGenerator(older.loaded))
    assert "pipeline" not in engine.speculative_modes
    assert engine.pipeline_state.startswith("off (the artifact has no cycle_batch graph")
