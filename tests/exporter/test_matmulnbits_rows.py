"""The fp32 "auto" export of int8-activation quantized weights asks this CPU whether MatMulNBits
keeps rows invariant (exporter/matmulnbits_rows.py) and builds the loopcast op set where it does
not, so that the artifact's speculation stays exact on every CPU."""

from __future__ import annotations

import pytest
from loopcast.exporter import export as export_module
from loopcast.exporter import matmulnbits_rows
from loopcast.exporter.export import export_checkpoint
from loopcast.exporter.export_options import ExportOptions

from loopcast.quant import QuantLinear, QuantScheme, WeightFormat, quantized_linears
from tests.artifacts import checkpoint, config_of, require_exact_cpu_artifacts

INT4_LEVEL4 = QuantScheme(WeightFormat.INT4, 32, True, WeightFormat.INT4, accuracy_level=4)


def test_the_probe_sees_rows_that_change_with_the_row_count() -> None:
    # fp32 compute (level 0): MLAS runs one row on its GEMV path and several on its GEMM path,
    # so the rows differ on every CPU measured (docs/architecture.md, "Quantized weights")
    linear = QuantLinear("w", 576, 960, 4, 32, True, 0)
    assert not matmulnbits_rows.stock_rows_invariant({"w": linear})


def test_the_probe_covers_every_distinct_matrix(monkeypatch) -> None:
    linears = quantized_linears(config_of("ouro-r3"), INT4_LEVEL4)
    seen = []

    def fake_differ(sess, k, rows, rng):
        seen.append(k)
        return 0.0

    monkeypatch.setattr(matmulnbits_rows, "rows_differ", fake_differ)
    assert matmulnbits_rows.stock_rows_invariant(linears)
    distinct = {(q.k, q.n, q.bits) for q in linears.values() if not q.gathered}
    assert len(seen) == len(distinct) >= 4


@pytest.mark.parametrize("invariant", [True, False])
def test_auto_takes_the_loopcast_op_where_the_stock_rows_differ(
    tmp_path, monkeypatch, invariant: bool
) -> None:
    require_exact_cpu_artifacts()
    monkeypatch.setattr(matmulnbits_rows, "stock_rows_invariant", lambda linears: invariant)
    manifest = export_checkpoint(
        checkpoint("llama-tied-gqa"), tmp_path / "q", ExportOptions(quantization=INT4_LEVEL4)
    )
    assert manifest.op_set == ("loopcast-attention" if invariant else "loopcast")
    if not invariant:
        assert manifest.exact_verify["cpu"]


def test_fp32_compute_keeps_matmulnbits(monkeypatch) -> None:
    # levels 0/1: the stock fp32 path is the faster, never row-invariant; no probe is run
    def no_probe(linears):
        raise AssertionError("probed at level 0")

    monkeypatch.setattr(matmulnbits_rows, "stock_rows_invariant", no_probe)
    scheme = QuantScheme(WeightFormat.INT4, 32, True, WeightFormat.INT4, accuracy_level=0)
    op_set = export_module._auto_op_set(
        config_of("llama-tied-gqa"), ExportOptions(quantization=scheme), print
    )
    assert op_set == "loopcast-attention"


def test_this_cpus_auto_export_is_exact() -> None:
    require_exact_cpu_artifacts()
    from loopcast.manifest import Manifest
    from tests.artifacts import quantized_artifact

    manifest = Manifest.read(quantized_artifact("ouro-r3", INT4_LEVEL4))
    linears = quantized_linears(manifest.config, INT4_LEVEL4)
    expected = "loopcast-attention" if matmulnbits_rows.stock_rows_invariant(linears) else "loopcast"
    assert manifest.op_set == expected and manifest.exact_verify["cpu"] is True
