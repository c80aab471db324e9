"""Quantized artifacts through the Python API: greedy equals the reference's greedy on the
dequantized weights, and speculation is exact exactly where the manifest (measured by the
exporter's probe) says so (docs/architecture.md, "Quantized weights")."""

from __future__ import annotations

import pytest
from loopcast.exporter.reference_generate import greedy_generate
from loopcast.ort_runtime import load

from loopcast.errors import LoopcastError
from loopcast.manifest import Manifest
from loopcast.quant import QuantScheme, WeightFormat
from tests.artifacts import dequantized_reference, quantized_artifact, require_exact_cpu_artifacts

# accuracy_level 0: fp32 compute, within 1e-4 of the dequantized reference, rows not invariant
FP32_COMPUTE = QuantScheme(WeightFormat.INT4, 32, True, WeightFormat.INT8, accuracy_level=0)
# accuracy_level 4 at block 32: int8 activations, row-invariant (tools/probes/check_matmulnbits_rows.py)
INT8_ACTIVATIONS = QuantScheme(WeightFormat.INT4, 32, True, WeightFormat.INT4, accuracy_level=4)
# the same, the embedding int4 too (GatherBlockQuantized): the smallest artifact
INT4_EVERYWHERE = QuantScheme(
    WeightFormat.INT4, 32, True, WeightFormat.INT4, WeightFormat.INT4, accuracy_level=4
)
PROMPT = [5, 9, 11, 5, 9, 11, 5, 9, 11, 5, 9]  # repetitive: prompt lookup drafts


@pytest.mark.parametrize("name", ["ouro-r3", "llama-tied-gqa"])
def test_greedy_equals_the_reference_on_dequantized_weights(name: str) -> None:
    model = load(quantized_artifact(name, FP32_COMPUTE))
    ref = greedy_generate(dequantized_reference(name, FP32_COMPUTE), PROMPT, 24, stop_ids=model.eos_token_ids)
    assert model.generate(PROMPT, 24).tokens == ref.tokens


def test_the_manifest_declares_what_the_probe_measured() -> None:
    require_exact_cpu_artifacts()
    assert Manifest.read(quantized_artifact("ouro-r3", INT8_ACTIVATIONS)).exact_verify["cpu"] is True
    assert Manifest.read(quantized_artifact("ouro-r3", FP32_COMPUTE)).exact_verify["cpu"] is False
    assert Manifest.read(quantized_artifact("ouro-r3", FP32_COMPUTE)).exact_verify["cuda"] is False


@pytest.mark.parametrize(
    "scheme", [INT8_ACTIVATIONS, INT4_EVERYWHERE], ids=["float-embedding", "int4-embedding"]
)
@pytest.mark.parametrize("mode", ["prompt-lookup", "self", "pipeline"])
def test_every_speculative_mode_is_plain_greedy_where_declared_exact(mode: str, scheme: QuantScheme) -> None:
    require_exact_cpu_artifacts()
    path = quantized_artifact("ouro-r3", scheme)
    assert Manifest.read(path).exact_verify["cpu"]
    model = load(path)
    plain = model.generate(PROMPT, 40).tokens
    got = model.generate(PROMPT, 40, speculative=mode, gate="always")
    assert got.tokens == plain
    assert got.stats.exact_greedy


def test_prompt_lookup_on_a_quantized_llama_is_plain_greedy() -> None:
    require_exact_cpu_artifacts()
    path = quantized_artifact("llama-tied-gqa", INT8_ACTIVATIONS)
    assert Manifest.read(path).exact_verify["cpu"]
    model = load(path)
    plain = model.generate(PROMPT, 40).tokens
    assert model.generate(PROMPT, 40, speculative="prompt-lookup", gate="always").tokens == plain


@pytest.mark.parametrize("mode", ["prompt-lookup", "self", "pipeline"])
def test_speculation_is_refused_where_declared_inexact(mode: str) -> None:
    path = quantized_artifact("ouro-r3", FP32_COMPUTE)
    assert not Manifest.read(path).exact_verify["cpu"]
    model = load(path)
    with pytest.raises(LoopcastError, match="allow_inexact"):
        model.generate(PROMPT, 8, speculative=mode)
    got = model.generate(PROMPT, 8, speculative=mode, allow_inexact=True)
    assert not got.stats.exact_greedy


def test_a_quantized_artifact_is_refused_on_cuda() -> None:
    from loopcast.ort_runtime.loading.artifact import open_artifact

    with pytest.raises(LoopcastError, match="CPU only|cuda|CUDA"):
        open_artifact(quantized_artifact("llama-tied-gqa", FP32_COMPUTE), "cuda")
