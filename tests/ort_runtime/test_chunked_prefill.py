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


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_captured_prefill_chunks_of_fixed_rows_equal_plain(model, prefix_caching):
    """``prefill_rows`` (a captured prefill graph per slot, here with stand-in capture sessions):
    every prefill call of a prompt of at least C tokens is exactly C tokens, the last one shifted
    back over the chunk before it (its rows recomputed bit for bit), shorter prompts run whole, and
    every request gets plain greedy's tokens, cached prefixes included; the warm-up made every
    slot's graph before the first request."""
    from loopcast.manifest import PREFILL
    from tests.ort_runtime.test_batch_decode import captured_stand_ins

    C = 5
    fake, stand_ins = captured_stand_ins(model.loaded)
    rng = random.Random(4)
    stem = [rng.randrange(3, 60) for _ in range(7)]
    prompts = [[rng.randrange(3, 60) for _ in range(n)] for n in (1, 4, 5, 6, 9, 10, 13, 18)]
    prompts += [stem + [11]]
    work = [(p, rng.randrange(2, 9)) for p in prompts]
    later = stem + [12, 13, 14]  # sent after the others finished: stem + [11]'s slot holds the stem
    gen = RecordingGenerator(fake, max_batch=3, cuda_graphs="always", prefill_rows=C)
    assert gen.prefill_rows == C
    engine = BatchingEngine(gen, prefill_chunk=4, prefix_caching=prefix_caching).start()
    try:
        assert len(stand_ins[PREFILL].graph_ids) == 3  # warm-up: one graph per slot
        done = [engine.submit(BatchRequest(p, k)) for p, k in work]
        assert [c.result(60) for c in done] == [list(model.stream_ids(p, k, stop_ids=())) for p, k in work]
        cached = engine.submit(BatchRequest(later, 5))
        assert cached.result(60) == list(model.stream_ids(later, 5, stop_ids=()))
        assert cached.cached_tokens == (7 if prefix_caching else 0)
    finally:
        engine.shutdown()
    sizes = [n for kind, n, _ in gen.log if kind == "prefill"]
    assert len([n for n in sizes if n != C]) == 2  # the prompts of 1 and 4 tokens, whole
    # ceil(len / C) calls of C tokens a prompt (18 in all); a cached stem saves the second stem
    # prompt's first chunk (its 3 new tokens run as one call shifted back over the stem)
    assert sizes.count(C) == (17 if prefix_caching else 18)
    assert len(stand_ins[PREFILL].graph_ids) == 3 + sizes.count(C)
