"""Quantized artifacts on CUDA (needs onnxruntime-gpu and a GPU; skipped elsewhere, as in CI):
``export --target cuda --dtype fp16|bf16 --quantize int4|int8`` runs every projection through
BatchInvariantMatMulNBits, so verify, verify_tail and cycle rows are the M=1 decode rows bit for
bit, captured graphs give eager's tokens, speculation equals plain greedy of the same dtype, and
the logits track the CPU fp32 artifact of the same scheme."""

from __future__ import annotations

import dataclasses

import numpy as np
import onnxruntime as ort
import pytest
from loopcast.ort_runtime import load
from loopcast.ort_runtime.decoding.exactness import cycle_rows_match, decode_rows

from loopcast.manifest import DECODE, DRAFT, VERIFY, VERIFY_TAIL, Manifest
from loopcast.quant import QuantScheme, WeightFormat
from tests.artifacts import quantized_artifact
from tests.ort_runtime.test_generator import DEMO_PROMPTS

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        "CUDAExecutionProvider" not in ort.get_available_providers(),
        reason="needs onnxruntime-gpu (CUDAExecutionProvider)",
    ),
]
INT4 = QuantScheme(WeightFormat.INT4, 32, True, WeightFormat.INT4)
INT8_ASYM = QuantScheme(WeightFormat.INT8, 64, False, WeightFormat.INT8)
CASES = [("fp16", INT4), ("bf16", INT4), ("fp16", INT8_ASYM)]
IDS = ["fp16-int4", "bf16-int4", "fp16-int8-asym"]
TOLERANCE = {"fp16": 0.08, "bf16": 0.5}  # max |logit diff| vs the CPU fp32 artifact


def _model(dtype: str, scheme: QuantScheme, **kw):
    return load(quantized_artifact("demo", scheme, ops="loopcast", dtype=dtype), "cuda", **kw)


@pytest.mark.parametrize("dtype,scheme", CASES, ids=IDS)
def test_rows_are_decode_rows_bit_for_bit(dtype: str, scheme: QuantScheme) -> None:
    model = _model(dtype, scheme)
    assert model.loaded.manifest.exact_verify["cuda"]
    W, R = model.loaded.manifest.verify_width, model.config.num_loops
    for prompt in DEMO_PROMPTS[:3]:
        ids = model.encode(prompt)
        fed, rows = decode_rows(model.new_generator(), ids, max(W, 2 * R))
        gen = model.new_generator()
        gen.prefill(ids)
        verify = gen.run(VERIFY, gen.n, tokens=fed[:W]).logits
        for i in range(W):
            assert np.array_equal(verify[i], rows[i]), (prompt, i)
        hidden = [gen.run(DRAFT, gen.n + i, tokens=[t]).hidden[0].copy() for i, t in enumerate(fed[:W])]
        tail = gen.run(VERIFY_TAIL, gen.n, hidden=np.stack(hidden)).logits
        for i in range(W):
            assert np.array_equal(tail[i], rows[i]), (prompt, i)
        assert cycle_rows_match(model.new_generator(), ids, fed, rows), prompt


@pytest.mark.parametrize("dtype,scheme", CASES[:2], ids=IDS[:2])
def test_captured_equals_eager_and_speculation_is_plain_greedy(dtype: str, scheme: QuantScheme) -> None:
    captured, eager = _model(dtype, scheme), _model(dtype, scheme, cuda_graphs=False)
    for prompt in DEMO_PROMPTS[:4]:
        plain = captured.generate(prompt, 64).tokens
        assert eager.generate(prompt, 64).tokens == plain, prompt
        for mode in ("prompt-lookup", "self", "pipeline"):
            assert captured.generate(prompt, 64, speculative=mode, gate="always").tokens == plain, (
                mode,
                prompt,
            )


@pytest.mark.parametrize("dtype,scheme", CASES, ids=IDS)
def test_logits_track_the_cpu_fp32_artifact(dtype: str, scheme: QuantScheme) -> None:
    gpu = _model(dtype, scheme)
    # fp32 activations on the CPU (accuracy_level 4 would add int8 activations' error)
    cpu_path = quantized_artifact("demo", dataclasses.replace(scheme, accuracy_level=0), ops="loopcast")
    assert Manifest.read(cpu_path).exact_verify["cpu"]
    cpu = load(cpu_path)
    for prompt in DEMO_PROMPTS[:3]:
        ids = cpu.encode(prompt)
        a, b = cpu.new_generator(), gpu.new_generator()
        a.prefill(ids[:-1])
        b.prefill(ids[:-1])
        row_a = a.run(DECODE, a.n, tokens=[ids[-1]]).logits[0].copy()
        row_b = b.run(DECODE, b.n, tokens=[ids[-1]]).logits[0]
        assert float(np.abs(row_a - row_b).max()) < TOLERANCE[dtype], prompt
