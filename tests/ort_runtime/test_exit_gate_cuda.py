"""The exit gate's loop steps on CUDA (needs onnxruntime-gpu and a GPU; skipped elsewhere, as in
CI): under both KV policies the tokens and exit loops of an fp32 artifact equal the torch
reference's (``last-exited`` fills the deeper slots with the op library's device copy)."""

from __future__ import annotations

import onnxruntime as ort
import pytest
from loopcast.exporter.reference_depth import depth_generate
from loopcast.ort_runtime.api import load
from loopcast.ort_runtime.decoding.generation_config import GenerationConfig

from tests.artifacts import artifact, reference

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        "CUDAExecutionProvider" not in ort.get_available_providers(),
        reason="needs onnxruntime-gpu (CUDAExecutionProvider)",
    ),
]
PROMPT = [3, 5, 7, 11, 2, 9]


@pytest.mark.parametrize("kv_policy", ["full", "last-exited"])
def test_gated_exits_equal_the_reference_on_cuda(kv_policy: str) -> None:
    model, ref = load(artifact("ouro-r3"), device="cuda"), reference("ouro-r3")
    for q in (0.1, 0.3, 0.5):
        config = GenerationConfig(16, exit_threshold=q, kv_policy=kv_policy, stop_ids=())
        got, want = model.generate(PROMPT, config=config), depth_generate(ref, PROMPT, config)
        assert got.tokens == want.tokens, q
        assert got.stats.exit_histogram == want.depth_stats()["exit_histogram"]


def test_gated_lanes_equal_plain_gated_on_cuda() -> None:
    """The pipeline's gated lanes (ort_runtime/decoding/exit_lanes.py) on CUDA: the cycle graph's
    per-row gates and heads decide as the loop steps do, so the tokens are plain gated ``full``'s
    (a batch-invariant fp16 artifact: its cycle rows are decode rows bit for bit on the GPU)."""
    for name, dtype in (("ouro-r3", "fp32"), ("ouro-r4-1layer", "fp16")):
        model = load(artifact(name, dtype=dtype, batch_invariant=True), device="cuda")
        for q in (0.1, 0.3, 0.5):
            plain = model.generate(PROMPT, 24, exit_threshold=q, stop_ids=())
            for gate in ("always", "auto"):
                got = model.generate(
                    PROMPT, 24, exit_threshold=q, speculative="pipeline", gate=gate, stop_ids=()
                )
                assert got.tokens == plain.tokens, (name, dtype, q, gate)
                assert got.stats.exit_histogram == plain.stats.exit_histogram
