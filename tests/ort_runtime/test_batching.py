"""Continuous batching (ort_runtime/batching/engine.py): requests that join and leave between steps get
exactly the tokens of plain generation; stop ids, max tokens, sampling, cancellation, admission."""

from __future__ import annotations

import random
import threading

import pytest
from loopcast.ort_runtime import load
from loopcast.ort_runtime.batching.engine import (
    BatchCostGate,
    BatchingEngine,
    BatchRequest,
    CapacityError,
)
from loopcast.ort_runtime.batching.sequential import SequentialEngine
from loopcast.ort_runtime.binding.batch_generator import BatchGenerator
from loopcast.ort_runtime.decoding.sampling import SamplingParams

from loopcast.errors import RequestError
from tests.artifacts import artifact, require_exact_cpu_artifacts


@pytest.fixture(scope="module")
def model():
    require_exact_cpu_artifacts()
    return load(artifact("ouro-r3", max_batch=4))


def _workload(seed: int, n: int, vocab: int = 90):
    rng = random.Random(seed)
    return [
        ([rng.randrange(vocab) for _ in range(rng.randrange(1, 10))], rng.randrange(1, 16)) for _ in range(n)
    ]


def test_join_and_leave_equal_plain_greedy(model):
    """12 requests with different lengths through 3 slots: they join as others leave, each slot is
    reused, and every token equals the single-sequence API's."""
    work = _workload(0, 12)
    expected = [list(model.stream_ids(p, k, stop_ids=())) for p, k in work]
    engine = BatchingEngine(BatchGenerator(model.loaded, max_batch=3)).start()
    try:
        done = [engine.submit(BatchRequest(p, k)) for p, k in work]
        assert [c.result(60) for c in done] == expected
        assert all(c.finish_reason == "length" for c in done)
        assert engine.peak_batch == 3
    finally:
        engine.shutdown()


def test_submitted_from_threads(model):
    work = _workload(1, 8)
    expected = [list(model.stream_ids(p, k, stop_ids=())) for p, k in work]
    engine = BatchingEngine(BatchGenerator(model.loaded)).start()
    got = [None] * len(work)

    def client(i):
        got[i] = engine.submit(BatchRequest(*work[i])).result(60)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(work))]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert got == expected
    finally:
        engine.shutdown()


def test_stop_ids_and_sampling(model):
    prompt = [5, 6, 7]
    plain = list(model.stream_ids(prompt, 12, stop_ids=()))
    stop = plain[4]
    engine = BatchingEngine(BatchGenerator(model.loaded)).start()
    try:
        c = engine.submit(BatchRequest(prompt, 12, stop_ids=(stop,)))
        assert c.result(30) == plain[: plain.index(stop) + 1] and c.finish_reason == "eos"
        params = SamplingParams(temperature=0.9, top_k=20, seed=7)
        sampled = [engine.submit(BatchRequest(p, 10, sampling=params)) for p in ([1, 2], [3, 4, 5], [1, 2])]
        expected = [
            list(model.stream_ids(p, 10, stop_ids=(), sampling=params)) for p in ([1, 2], [3, 4, 5], [1, 2])
        ]
        assert [c.result(30) for c in sampled] == expected
    finally:
        engine.shutdown()


def test_cancel_frees_the_slot(model):
    engine = BatchingEngine(BatchGenerator(model.loaded, max_batch=1)).start()
    try:
        seen = threading.Event()
        long = engine.submit(BatchRequest([1, 2, 3], 10_000), on_event=lambda kind, value: seen.set())
        queued = engine.submit(BatchRequest([4, 5], 6))
        assert seen.wait(30)
        long.cancel()
        assert queued.result(30) == list(model.stream_ids([4, 5], 6, stop_ids=()))
        assert long.finish_reason == "cancelled" and 0 < len(long.tokens) < 10_000
        waiting = engine.submit(BatchRequest([4, 5], 6))
        waiting.cancel()
        waiting.result(30)
        assert waiting.finish_reason in ("cancelled", "length")
    finally:
        engine.shutdown()


def test_admission(model):
    engine = BatchingEngine(BatchGenerator(model.loaded, max_batch=1), max_waiting=1)
    # not started: the first request waits, the second finds the queue full
    engine.submit(BatchRequest([1], 4))
    with pytest.raises(CapacityError, match="max_waiting=1"):
        engine.submit(BatchRequest([1], 4))
    with pytest.raises(RequestError, match="KV capacity"):
        engine.submit(BatchRequest([1] * model.loaded.manifest.max_length, 4))
    with pytest.raises(RequestError, match="max_new_tokens"):
        BatchRequest([1], 0)
    engine.start()
    engine.shutdown()
    with pytest.raises(CapacityError, match="shutting down"):
        engine.submit(BatchRequest([1], 4))


def test_capacity_ends_with_length(model):
    max_length = model.loaded.manifest.max_length
    prompt = [3] * (max_length - 3)
    engine = BatchingEngine(BatchGenerator(model.loaded)).start()
    try:
        c = engine.submit(BatchRequest(prompt, 100))
        assert c.result(60) == list(model.stream_ids(prompt, 100, stop_ids=()))
        assert c.finish_reason == "length" and len(c.tokens) == 4
    finally:
        engine.shutdown()


def test_sequential_engine_matches(model):
    work = _workload(2, 4)
    engine = SequentialEngine(model).start()
    try:
        assert [engine.submit(BatchRequest(p, k)).result(60) for p, k in work] == [
            list(model.stream_ids(p, k, stop_ids=())) for p, k in work
        ]
    finally:
        engine.shutdown()


class _AlwaysVerify(BatchCostGate):
    def engage(self, width: int, running: int, proposing: int) -> bool:
        return True


class _WrongProposer:
    """Always proposes a token that greedy never produces in this test (forced rejections)."""

    def __init__(self, token: int) -> None:
        self.token = token

    def propose(self, context, k):
        return [self.token] * k


@pytest.mark.parametrize("proposer", ["prompt-lookup", "always-wrong"])
def test_speculation_per_request_equals_plain_greedy(model, proposer):
    """Prompt lookup per request through verify_batch (gate forced on, so every step with a draft
    verifies): greedy requests get plain greedy's tokens, forced rejections included, beside a
    sampled request that speculates in the same steps; stop ids still stop."""
    rng = random.Random(3)
    work = [([rng.randrange(5) for _ in range(rng.randrange(4, 12))], rng.randrange(1, 30)) for _ in range(8)]
    expected = [list(model.stream_ids(p, k, stop_ids=())) for p, k in work]
    never = min(set(range(model.config.vocab_size)) - {t for e in expected for t in e} - {1, 2, 3})
    factory = {"prompt-lookup": None, "always-wrong": lambda: _WrongProposer(never)}[proposer]
    kwargs = {"proposer_factory": factory} if factory else {}
    engine = BatchingEngine(BatchGenerator(model.loaded, max_batch=3), gate=_AlwaysVerify(), **kwargs).start()
    params = SamplingParams(temperature=0.9, seed=11)
    try:
        sampled = engine.submit(BatchRequest([1, 2, 3], 12, sampling=params, speculative="prompt-lookup"))
        done = [engine.submit(BatchRequest(p, k, speculative="prompt-lookup")) for p, k in work]
        stop = expected[0][min(3, len(expected[0]) - 1)]
        stopped = engine.submit(
            BatchRequest(work[0][0], work[0][1], stop_ids=(stop,), speculative="prompt-lookup")
        )
        assert [c.result(60) for c in done] == expected
        # the sampled request speculates as well: exact in distribution, not per seed
        # (tests/ort_runtime/test_batch_sampled_speculation.py)
        assert len(sampled.result(60)) == 12
        assert stopped.result(60) == expected[0][: expected[0].index(stop) + 1]
        assert engine.stats["verify_steps"] > 0 and engine.stats["proposed"] > 0
        if proposer == "always-wrong":
            assert engine.stats["accepted"] == 0
        else:
            assert engine.stats["accepted"] > 0
        assert done[0].speculative == "prompt-lookup" and sampled.speculative == "prompt-lookup"
    finally:
        engine.shutdown()


def test_gate_turns_verify_off_when_it_does_not_pay():
    gate = BatchCostGate(probe_every=4)
    assert not gate.engage(2, 2, 1)  # no decode cost at this width yet: measure it
    for seconds in (1.0, 0.01, 0.01):  # the first run of a binding is left out
        gate.observe_cost("decode_batch", 2, seconds)
    assert gate.engage(2, 2, 1)  # verify cost unknown: try it
    for seconds in (1.0, 0.05, 0.05):
        gate.observe_cost("verify_batch", 2, seconds)
    gate.observe_accept(0.0)
    for _ in range(20):
        gate.observe_accept(0.0)
    decisions = [gate.engage(2, 2, 1) for _ in range(8)]
    assert decisions.count(True) == 2  # only the probes every 4 steps


def test_warm_up_runs_on_the_engine_thread_and_its_error_reaches_start(model, monkeypatch):
    """ORT's CUDA provider keeps a captured graph per calling thread, so the warm-up that captures
    every width runs on the thread whose steps replay them; start() waits for it and raises its
    error in the caller."""
    gen = BatchGenerator(model.loaded, max_batch=2)
    ran_on = []
    monkeypatch.setattr(gen, "warm_up", lambda: ran_on.append(threading.current_thread()) or 3)
    engine = BatchingEngine(gen)
    assert not ran_on and engine.stats["warm_up_runs"] == 0  # not before start
    engine.start()
    try:
        assert ran_on == [engine._thread] and engine.stats["warm_up_runs"] == 3
        assert engine.submit(BatchRequest([1, 2, 3], 3)).result(60) == list(
            model.stream_ids([1, 2, 3], 3, stop_ids=())
        )
    finally:
        engine.shutdown()

    broken = BatchGenerator(model.loaded, max_batch=2)

    def fail() -> int:
        raise RequestError("warm-up failed")

    monkeypatch.setattr(broken, "warm_up", fail)
    with pytest.raises(RequestError, match="warm-up failed"):
        BatchingEngine(broken).start()
