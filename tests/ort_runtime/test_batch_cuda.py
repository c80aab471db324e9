"""Batched decode on CUDA (needs onnxruntime-gpu and a GPU; skipped elsewhere, as in CI; the H200
phase `tools/gpu_machine/h200_run.sh serve` runs it).

Captured per-width graphs give the tokens of eager batched runs (the same kernels); a width-1
batched step is the single-sequence decode graph's ops, so its greedy tokens equal plain greedy.
"""

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


@pytest.fixture(scope="module", params=["fp16", "bf16"])
def model(request):
    dtype = request.param
    return load(artifact("demo", dtype, batch_invariant=True, ops="loopcast", max_batch=8), "cuda")


def test_kv_blocks_hold_what_the_rows_wrote(model):
    """KV blocks bound by address (bf16 through its ONNX type number) come back as the values a
    one-sequence generator wrote at the same positions."""
    ids = model.encode(DEMO_PROMPTS[0])
    batch = BatchGenerator(model.loaded, 2)
    batch.prefill(1, ids)
    gen = model.new_generator()
    gen.prefill(ids)
    key, value = batch.kv_arrays(0, 1)
    want_key, want_value = gen.kv_arrays(0)
    n = len(ids)
    assert key.dtype == want_key.dtype
    assert np.array_equal(key[..., :n, :], want_key[..., :n, :])
    assert np.array_equal(value[..., :n, :], want_value[..., :n, :])


def _serve(model, prompts, max_batch, cuda_graphs):
    engine = BatchingEngine(BatchGenerator(model.loaded, max_batch, cuda_graphs=cuda_graphs)).start()
    try:
        done = [engine.submit(BatchRequest(model.encode(p), 32)) for p in prompts]
        return [c.result(120) for c in done], engine.gen
    finally:
        engine.shutdown()


def test_captured_equals_eager_batched(model):
    prompts = DEMO_PROMPTS[:12]
    eager, _ = _serve(model, prompts, 8, False)
    captured, gen = _serve(model, prompts, 8, True)
    assert gen.captured, gen.graph_fallbacks
    assert captured == eager


def test_captured_prefill_chunks_equal_eager_batched(model):
    """Prefill chunks of exactly 8 tokens through the prefill graph captured per slot (the last
    chunk of a prompt shifted back over the one before) give the tokens of eager batched runs."""
    from loopcast.manifest import PREFILL

    prompts = DEMO_PROMPTS[:12]
    eager, _ = _serve(model, prompts, 8, False)
    engine = BatchingEngine(
        BatchGenerator(model.loaded, 8, cuda_graphs=True, prefill_rows=8), prefill_chunk=8
    ).start()
    try:
        assert engine.gen.prefill_rows == 8, engine.gen.graph_fallbacks.get(PREFILL)
        done = [engine.submit(BatchRequest(model.encode(p), 32)) for p in prompts]
        assert [c.result(120) for c in done] == eager
        assert engine.gen.prefill_rows == 8, engine.gen.graph_fallbacks.get(PREFILL)  # no capture failed
    finally:
        engine.shutdown()


def test_width_one_equals_plain_greedy(model):
    prompts = DEMO_PROMPTS[:4]
    for cuda_graphs in (False, True):
        got, _ = _serve(model, prompts, 1, cuda_graphs)
        assert got == [list(model.stream_ids(p, 32)) for p in prompts]


def test_self_rounds_equal_plain_batched(model):
    """Self-speculation inside the batch (draft_batch and verify_tail_batch rounds, the gate
    forced on) gives the tokens of plain batched decoding, eager and captured."""
    from loopcast.ort_runtime.decoding.generation_config import GenerationConfig, SpeculationConfig

    from tests.ort_runtime.test_batch_self import _AlwaysSelf

    prompts = DEMO_PROMPTS[:12]
    plain, _ = _serve(model, prompts, 8, False)
    config = GenerationConfig(speculation=SpeculationConfig("self"))
    for cuda_graphs in (False, True):
        engine = BatchingEngine(
            BatchGenerator(model.loaded, 8, cuda_graphs=cuda_graphs), gate=_AlwaysSelf()
        ).start()
        try:
            done = [
                engine.submit(BatchRequest(model.encode(p), 32, speculative="self", config=config))
                for p in prompts
            ]
            assert [c.result(120) for c in done] == plain, cuda_graphs
            assert engine.stats["self_rounds"] > 0
        finally:
            engine.shutdown()


@pytest.mark.parametrize("wrong_every", [0, 3])
def test_pipeline_requests_equal_plain_batched(model, wrong_every):
    """Pipeline requests inside the batch (one cycle_batch call per step: RowAttention rows of
    several sequences, addressed through its sequence index on CUDA) give plain batched decoding's
    tokens, with oracle drafts all right and every third wrong, eager and captured."""
    from tests.ort_runtime.test_batch_pipeline import _oracle

    prompts = DEMO_PROMPTS[:12]
    plain, _ = _serve(model, prompts, 8, False)
    requests = [
        BatchRequest(model.encode(p), 32, speculative="pipeline" if i % 4 else "none")
        for i, p in enumerate(prompts)
    ]
    perturb = _oracle(model, requests, wrong_every)
    for cuda_graphs in (False, True):
        engine = BatchingEngine(
            BatchGenerator(model.loaded, 8, cuda_graphs=cuda_graphs), self_perturb=perturb
        ).start()
        try:
            done = [engine.submit(r) for r in requests]
            assert [c.result(120) for c in done] == plain, cuda_graphs
            assert engine.stats["pipeline_cycles"] > 0
        finally:
            engine.shutdown()
