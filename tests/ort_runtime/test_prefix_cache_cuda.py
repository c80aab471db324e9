"""Prefix caching and chunked prefill on CUDA (needs onnxruntime-gpu and a GPU; skipped elsewhere;
the H200 phase `tools/gpu_machine/h200_run.sh serve` runs it): the device copy of a cached prefix
(ort_runtime/binding/device_move.py) is bit for bit, and cached and chunked prompts give the
tokens of cold whole ones."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from loopcast.ort_runtime import load
from loopcast.ort_runtime.batching.engine import BatchingEngine, BatchRequest
from loopcast.ort_runtime.binding.batch_generator import BatchGenerator

from tests.artifacts import artifact
from tests.ort_runtime.test_generator import DEMO_PROMPTS

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        "CUDAExecutionProvider" not in ort.get_available_providers(),
        reason="needs onnxruntime-gpu (CUDAExecutionProvider)",
    ),
]


@pytest.fixture(scope="module")
def model():
    return load(artifact("demo", "fp16", batch_invariant=True, ops="loopcast", max_batch=8), "cuda")


def test_device_prefix_copy_is_exact(model):
    gen = BatchGenerator(model.loaded, 4)
    ids = model.encode(DEMO_PROMPTS[0])
    gen.prefill(2, ids)
    gen.copy_prefix(2, 0, len(ids) - 1)
    for kv_slot in (0, model.config.num_kv_slots - 1):
        (k2, v2), (k0, v0) = gen.kv_arrays(kv_slot, 2), gen.kv_arrays(kv_slot, 0)
        n = len(ids) - 1
        assert np.array_equal(k2[..., :n, :], k0[..., :n, :]) and np.array_equal(
            v2[..., :n, :], v0[..., :n, :]
        )


def _run(model, work, **options):
    """The first request alone, then the rest at once: they arrive after its prefix is cached
    (how many of 12 requests submitted together hit depends on how fast the first prefills)."""
    engine = BatchingEngine(BatchGenerator(model.loaded, 8), **options).start()
    try:
        first = engine.submit(BatchRequest(work[0], 24))
        first.result(120)
        done = [first] + [engine.submit(BatchRequest(p, 24)) for p in work[1:]]
        return [c.result(120) for c in done], [c.cached_tokens for c in done]
    finally:
        engine.shutdown()


def test_cached_and_chunked_equal_cold(model):
    stem = model.encode("# A module of small helpers.\n" * 6)
    work = [stem + model.encode(p) for p in DEMO_PROMPTS[:12]]
    cold, _ = _run(model, work, prefix_caching=False, prefill_chunk=0)
    assert cold[0] == list(model.stream_ids(work[0], 24))
    cached, hits = _run(model, work, prefix_caching=True, prefill_chunk=16)
    assert cached == cold
    assert hits[0] == 0 and all(h >= len(stem) - 1 for h in hits[1:]), hits
