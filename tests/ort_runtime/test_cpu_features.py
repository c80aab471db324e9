"""A CPU exactness declaration holds on the CPU it was measured on (loopcast/cpu_features.py):
the exporter records the signature of the CPU whose MLAS kernels it measured, and the runtime
treats the artifact's CPU rows as inexact on a CPU whose features pick other kernels."""

from __future__ import annotations

import pytest
from loopcast.ort_runtime import load

from loopcast import cpu_features
from loopcast.errors import LoopcastError
from loopcast.manifest import Manifest
from tests.artifacts import artifact, require_exact_cpu_artifacts

PROMPT = [5, 9, 11, 5, 9, 11, 5, 9, 11, 5, 9]

AVX512 = """processor\t: 0
vendor_id\t: GenuineIntel
flags\t\t: fpu sse2 avx avx2 fma f16c avx512f avx512bw avx512dq avx512vl avx512_vnni amx_int8 rdrand
bugs\t\t: spectre_v1
"""
NEOVERSE = """processor\t: 0
Features\t: fp asimd evtstrm aes asimddp sve i8mm bf16
CPU implementer\t: 0x41
"""


def test_the_signature_lists_the_kernel_flags_in_order() -> None:
    sig = cpu_features.signature_from_cpuinfo(AVX512, "x86_64")
    assert sig == "x86_64: amx_int8 avx avx2 avx512_vnni avx512bw avx512dq avx512f avx512vl f16c fma"
    assert cpu_features.signature_from_cpuinfo(NEOVERSE, "aarch64") == "aarch64: asimd asimddp bf16 i8mm sve"
    assert cpu_features.signature_from_cpuinfo("processor\t: 0\n", "x86_64") is None


def test_an_unreadable_signature_or_an_old_artifact_keeps_the_declaration(monkeypatch) -> None:
    monkeypatch.setattr(cpu_features, "cpu_signature", lambda: None)
    assert cpu_features.same_cpu_kernels("x86_64: avx avx2")
    monkeypatch.setattr(cpu_features, "cpu_signature", lambda: "x86_64: avx avx2")
    assert cpu_features.same_cpu_kernels(None)
    assert cpu_features.same_cpu_kernels("x86_64: avx avx2")
    assert not cpu_features.same_cpu_kernels("x86_64: avx avx2 avx512f")


def test_the_exporter_records_the_cpu_for_the_stock_kernels_only() -> None:
    require_exact_cpu_artifacts()
    stock_matmul = Manifest.read(artifact("llama-tied-gqa"))
    assert stock_matmul.op_set == "loopcast-attention" and stock_matmul.exact_verify["cpu"]
    assert stock_matmul.exact_verify_cpu == cpu_features.cpu_signature()
    invariant = Manifest.read(artifact("llama-tied-gqa", batch_invariant=True))
    assert invariant.op_set == "loopcast" and invariant.exact_verify_cpu is None


def test_another_cpus_declaration_is_not_trusted(monkeypatch) -> None:
    require_exact_cpu_artifacts()
    model = load(artifact("llama-tied-gqa"))
    plain = model.generate(PROMPT, 16).tokens
    assert model.loaded.exact_verify
    monkeypatch.setattr(cpu_features, "cpu_signature", lambda: "x86_64: avx avx2 some_other_cpu")
    assert not model.loaded.exact_verify
    with pytest.raises(LoopcastError, match="allow_inexact"):
        model.generate(PROMPT, 16, speculative="prompt-lookup", gate="always")
    # the loopcast ops are row-invariant on every CPU: their declaration stands
    invariant = load(artifact("llama-tied-gqa", batch_invariant=True))
    assert invariant.loaded.exact_verify
    got = invariant.generate(PROMPT, 16, speculative="prompt-lookup", gate="always")
    assert got.stats.exact_greedy and got.tokens == invariant.generate(PROMPT, 16).tokens
    assert plain  # the stock artifact's plain decoding is unaffected
    assert model.generate(PROMPT, 16).tokens == plain


def test_inspect_says_which_cpu_the_declaration_holds_on(monkeypatch) -> None:
    from loopcast.ort_runtime.loading.describe import describe_artifact

    require_exact_cpu_artifacts()
    here = cpu_features.cpu_signature()
    line = next(
        x for x in describe_artifact(artifact("llama-tied-gqa")).splitlines() if x.startswith("exact verify")
    )
    assert "cpu: true" in line and line.endswith(f"(cpu measured on {here}; this CPU too)")
    monkeypatch.setattr(cpu_features, "cpu_signature", lambda: "x86_64: avx some_other_cpu")
    line = next(
        x for x in describe_artifact(artifact("llama-tied-gqa")).splitlines() if x.startswith("exact verify")
    )
    assert "not this CPU (x86_64: avx some_other_cpu): false here" in line
    invariant = describe_artifact(artifact("llama-tied-gqa", batch_invariant=True))
    assert "exact verify    cpu: true" in invariant and "measured on" not in invariant
