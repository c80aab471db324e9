"""Chunked prefill (ort_runtime/batching/engine.py ``prefill_chunk``): joining prompts are prefilled
at most one chunk between two decode steps, so a running request waits at most one chunk for
its next token, and every request still gets plain greedy's tokens (CPU fp32)."""

from __future__ import annotations

import random

import pytest
from loopcast.ort_runtime import load
from loopcast.ort_runtime.batching.engine import BatchingEngine, BatchRequest
from loopcast.ort_runtime.binding.batch_generator import BatchGenerator
from loopcast.ort_runtime.decoding.sampling import SamplingParams

from tests.artifacts import artifact, require_exact_cpu_artifacts


@pytest.fixture(scope="module")
def model():
    require_exact_cpu_artifacts()
    return load(artifact("ouro-r3", max_batch=4))


class RecordingGenerator(BatchGenerator):
    """The batch generator, with a log of the calls the engine makes: ("prefill", tokens,
    sequences decoding meanwhile) and ("step", rows, 0)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.log: list[tuple[str, int, int]] = []
        self.decoding: set[int] = set()

    def prefill(self, slot, ids, **kwargs):
        self.log.append(("prefill", len(ids), len(self.decoding - {slot})))
        return super().prefill(slot, ids, **kwargs)

    def _step(self, kind, rows, want_logits):
        self.log.append(("step", len(rows), 0))
        self.decoding |= set(rows)
        return super()._step(kind, rows, want_logits)

    def release(self, slot, keep=0):
        self.decoding.discard(slot)
        return super().release(slot, keep)


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_chunked_prefill_interleaves_and_equals_plain(model, prefix_caching):
    rng = random.Random(1)
    chunk = 4
    work = [
        ([rng.randrange(3, 60) for _ in range(rng.randrange(1, 19))], rng.randrange(2, 14)) for _ in range(9)
    ]
    expected = [list(model.stream_ids(p, k, stop_ids=())) for p, k in work]
    params = SamplingParams(temperature=0.8, seed=3)
    sampled_prompt = [rng.randrange(3, 60) for _ in range(11)]
    gen = RecordingGenerator(model.loaded, max_batch=3)
    engine = BatchingEngine(gen, prefill_chunk=chunk, prefix_caching=prefix_caching).start()
    try:
        sampled = engine.submit(BatchRequest(sampled_prompt, 8, sampling=params))
        done = [
            engine.submit(BatchRequest(p, k, speculative="prompt-lookup" if i % 3 == 0 else "none"))
            for i, (p, k) in enumerate(work)
        ]
        assert [c.result(60) for c in done] == expected
        assert sampled.result(60) == list(model.stream_ids(sampled_prompt, 8, stop_ids=(), sampling=params))
    finally:
        engine.shutdown()
    # while any sequence decodes, at most one chunk of prompt tokens is prefilled between two steps
    between, worst, delayed = 0, 0, 0
    for kind, n, decoding in gen.log:
        if kind == "prefill":
            assert n <= chunk
            between += n if decoding else 0
            delayed += bool(decoding)
        else:
            worst, between = max(worst, between), 0
    assert worst == chunk and delayed > 0  # prompts did join running sequences, one chunk a step
    assert any(n == chunk for kind, n, _ in gen.log if kind == "prefill")  # long prompts were chunked


def test_whole_prompts_without_a_chunk(model):
    gen = RecordingGenerator(model.loaded, max_batch=2)
    engine = BatchingEngine(gen, prefill_chunk=0, prefix_caching=False).start()
    try:
        prompt = list(range(3, 23))
        assert engine.submit(BatchRequest(prompt, 3)).result(30) == list(
            model.stream_ids(prompt, 3, stop_ids=())
        )
    finally:
        engine.shutdown()
    assert ("prefill", 20, 0) in gen.log and engine.prefill_chunk is None
