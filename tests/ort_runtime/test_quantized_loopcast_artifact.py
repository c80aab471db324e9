"""Quantized artifacts with the loopcast op set (``export --quantize int4|int8 --ops loopcast``):
every projection is BatchInvariantMatMulNBits, so verify, verify_tail, cycle and the batched
kinds' rows are the M=1 decode rows bit for bit (CPU fp32), the exporter declares it
(``exact_verify``), speculation and the pipeline return plain greedy's tokens, and the logits
are the torch reference's on the dequantized weights."""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx
import pytest
import torch
from loopcast.ort_runtime import load
from loopcast.ort_runtime.binding.batch_generator import BatchGenerator
from loopcast.ort_runtime.decoding.exactness import decode_rows, rows_match_on_cpu

from loopcast.manifest import DRAFT, VERIFY, VERIFY_TAIL, Manifest
from loopcast.quant import QuantScheme, WeightFormat
from loopcast.vocab import GraphKind
from tests.artifacts import dequantized_reference, quantized_artifact, require_exact_cpu_artifacts

# accuracy_level 0: fp32 activations (the CPU and CUDA kernels); 4: int8 activations per block
# (the CPU kernel, matmul_nbits_q8_cpu.h)
INT4 = QuantScheme(WeightFormat.INT4, 32, True, WeightFormat.INT4, accuracy_level=0)
# asymmetric int8 layers under an int8 head, block 64; and int4 block 128 with a float head
INT8_ASYM = QuantScheme(WeightFormat.INT8, 64, False, WeightFormat.INT8, accuracy_level=0)
INT4_B128_FLOAT_HEAD = QuantScheme(WeightFormat.INT4, 128, False, WeightFormat.FLOAT, accuracy_level=0)
CASES = [("ouro-r3", INT4), ("llama-tied-gqa", INT8_ASYM), ("ouro-r2-gqa", INT4_B128_FLOAT_HEAD)]
IDS = ["ouro-int4-b32", "llama-tied-int8-asym-b64", "ouro-gqa-int4-b128-float-head"]
Q8 = [(name, dataclasses.replace(scheme, accuracy_level=4)) for name, scheme in CASES]
Q8_IDS = [f"{i}-int8-act" for i in IDS]
ALL, ALL_IDS = CASES + Q8, IDS + Q8_IDS


@pytest.fixture(scope="module", autouse=True)
def _exact_cpu():
    require_exact_cpu_artifacts()


def _art(name: str, scheme: QuantScheme):
    return quantized_artifact(name, scheme, ops="loopcast", max_batch=4)


@pytest.mark.parametrize("name,scheme", ALL, ids=ALL_IDS)
def test_declared_exact_and_built_from_the_invariant_op(name: str, scheme: QuantScheme) -> None:
    path = _art(name, scheme)
    manifest = Manifest.read(path)
    assert manifest.op_set == "loopcast" and manifest.quantization == scheme
    # int8 activations are the CPU kernel's; CUDA computes level 4 in the activation dtype
    assert manifest.exact_verify == {"cpu": True, "cuda": True}
    assert "BatchInvariantMatMulNBits" in manifest.custom_ops
    for spec in manifest.graphs.values():
        ops = {
            (n.domain, n.op_type)
            for n in onnx.load(str(path / spec.file), load_external_data=False).graph.node
        }
        assert ("com.microsoft", "MatMulNBits") not in ops, spec.file
        # loop_embed is the embedding lookup alone; exit_head is the head alone (float or quantized)
        projections = spec.kind != GraphKind.LOOP_EMBED and (
            spec.kind != GraphKind.EXIT_HEAD or scheme.head is not WeightFormat.FLOAT
        )
        if projections:
            assert ("loopcast", "BatchInvariantMatMulNBits") in ops, spec.file
    # the full artifact's rows (verify, draft + verify_tail, cycle), not only the twin's
    assert rows_match_on_cpu(path, prompt_lengths=(1, 6))


@pytest.mark.parametrize("name,scheme", ALL, ids=ALL_IDS)
def test_verify_and_verify_tail_rows_are_decode_rows(name: str, scheme: QuantScheme) -> None:
    model = load(_art(name, scheme))
    W = model.loaded.manifest.verify_width
    prompt = np.random.default_rng(3).integers(0, model.config.vocab_size, 7).tolist()
    fed, rows = decode_rows(model.new_generator(), prompt, W)
    gen = model.new_generator()
    gen.prefill(prompt)
    out = gen.run(VERIFY, gen.n, tokens=fed)
    for i in range(W):
        assert np.array_equal(out.logits[i], rows[i]), (i, float(np.abs(out.logits[i] - rows[i]).max()))
    if model.config.num_loops > 1:
        hidden = [gen.run(DRAFT, gen.n + i, tokens=[t]).hidden[0].copy() for i, t in enumerate(fed)]
        tail = gen.run(VERIFY_TAIL, gen.n, hidden=np.stack(hidden))
        for i in range(W):
            assert np.array_equal(tail.logits[i], rows[i]), i


@pytest.mark.parametrize("name,scheme", CASES[:2] + Q8[:2], ids=IDS[:2] + Q8_IDS[:2])
def test_batched_rows_are_decode_rows(name: str, scheme: QuantScheme) -> None:
    """decode_batch and verify_batch rows, with other sequences in the batch, are the
    single-sequence decode rows bit for bit."""
    model = load(_art(name, scheme))
    prompts = {0: [1, 2, 3, 4], 1: [5, 6, 7], 3: [9, 10, 11, 12, 13, 14]}
    W = model.loaded.manifest.verify_width
    single = {s: decode_rows(model.new_generator(), p, W + 2) for s, p in prompts.items()}
    bg = BatchGenerator(model.loaded)
    for slot, prompt in prompts.items():
        assert bg.prefill(slot, prompt)[0] == single[slot][0][0]
    step = bg.decode({s: single[s][0][0] for s in prompts}, want_logits=True)
    for slot in prompts:
        assert np.array_equal(step.logits[slot], single[slot][1][0]), slot
    bg2 = BatchGenerator(model.loaded)
    for slot, prompt in prompts.items():
        bg2.prefill(slot, prompt)
    drafts = {0: single[0][0][:W], 1: single[1][0][:2], 3: single[3][0][:1]}
    targets, logits = bg2.verify(drafts, want_logits=True)
    for slot, ids in drafts.items():
        for i in range(len(ids)):
            assert np.array_equal(logits[slot][i], single[slot][1][i]), (slot, i)


@pytest.mark.parametrize("name,scheme", [CASES[0], CASES[1]], ids=IDS[:2])
def test_logits_are_the_reference_on_dequantized_weights(name: str, scheme: QuantScheme) -> None:
    model = load(_art(name, scheme))
    ref = dequantized_reference(name, scheme)
    prompt = list(range(2, 11))
    fed, rows = decode_rows(model.new_generator(), prompt, 4)
    with torch.no_grad():
        logits = ref(torch.tensor([prompt + fed])).final_logits[0]
    for i, row in enumerate(rows):
        np.testing.assert_allclose(row, logits[len(prompt) + i].numpy(), atol=1e-4, rtol=1e-4)


@pytest.fixture(scope="module")
def demo_int4():
    return load(quantized_artifact("demo", dataclasses.replace(INT4, accuracy_level=4), ops="loopcast"))


@pytest.mark.parametrize("mode", ["self", "pipeline", "prompt-lookup"])
def test_speculation_equals_plain_greedy_on_int4(demo_int4, mode: str) -> None:
    from tests.ort_runtime.test_generator import DEMO_PROMPTS

    accepted = 0
    for prompt in DEMO_PROMPTS[:2]:
        plain = demo_int4.generate(prompt, 40)
        spec = demo_int4.generate(prompt, 40, speculative=mode, gate="always")
        assert spec.tokens == plain.tokens, (mode, prompt)
        accepted += spec.stats.accepted
    assert accepted > 0  # the int4 model still drafts tokens its full depth accepts
