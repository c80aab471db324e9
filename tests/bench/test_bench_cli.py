"""`loopcast bench` defaults: the device that is there, results in the cache or a named --out,
a CPU report without GPU-only columns, progress on stderr, --device cuda refused up front."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from loopcast.bench.report import bandwidth_line
from loopcast.cli import main

from loopcast.devices import cuda_available, default_device
from tests.artifacts import checkpoint

FAST = [
    "--variant",
    "stock",
    "--past",
    "48",
    "--widths",
    "2",
    "--iters",
    "2",
    "--new-tokens",
    "8",
    "--alternate-tokens",
    "0",
]


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty cache root and an empty working directory (the bench must leave the latter alone)."""
    monkeypatch.setenv("LOOPCAST_CACHE", str(tmp_path / "cache"))
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")
    return tmp_path


@pytest.mark.skipif(cuda_available(), reason="this install can run CUDA")
def test_device_cuda_refused_before_any_export(cache) -> None:
    result = CliRunner().invoke(main, ["bench", str(checkpoint("llama-tied-gqa")), "--device", "cuda", *FAST])
    assert result.exit_code == 2
    assert result.output.count("\n") == 1 and result.output.startswith("error: --device cuda")
    assert "Traceback" not in result.output
    assert not (cache / "cache").exists() and not any((cache / "cwd").iterdir())


def test_defaults_write_into_the_cache_and_report_cpu_columns_only(cache) -> None:
    result = CliRunner().invoke(main, ["bench", str(checkpoint("llama-tied-gqa")), *FAST])
    assert result.exit_code == 0, result.output
    assert not any((cache / "cwd").iterdir())
    reports = list((cache / "cache" / "bench").glob("bench-*.json"))
    assert len(reports) == 1
    report = json.loads(reports[0].read_text())
    assert report["options"]["device"] == default_device()
    assert str(cache / "cache" / "bench" / "work") == report["options"]["work_dir"]
    out = result.stdout
    table = out[out.index("loopcast bench") :]
    if default_device() == "cpu":
        for gpu_only in ("captured", "None", "nan", "CUDA graph"):
            assert gpu_only not in table, gpu_only
    # progress for each long phase, on stderr
    for phase in ("exporting", "timing steps", "comparing verify rows", "end-to-end:"):
        assert phase in result.stderr, phase


def test_named_out(cache) -> None:
    out = cache / "results" / "tiny.json"
    result = CliRunner().invoke(
        main,
        [
            "bench",
            str(checkpoint("llama-tied-gqa")),
            "--out",
            str(out),
            "--no-torch",
            "--no-end-to-end",
            *FAST,
        ],
    )
    assert result.exit_code == 0, result.output
    assert json.loads(out.read_text())["runs"][0]["variant"] == "stock"
    assert f"wrote {out}" in result.stdout


def test_bandwidth_share_only_where_it_is_one() -> None:
    base = {
        "bytes_per_step": {"total": 10 * 2**20},
        "bandwidth_gbs": 20.0,
        "floor_ms": 0.5,
        "cache_bytes": 64 * 2**20,
    }
    assert "not a floor" in bandwidth_line(base, decode_ms=0.4) and "%" not in bandwidth_line(base, 0.4)
    base = {**base, "bytes_per_step": {"total": 2**30}, "floor_ms": 50.0}
    assert bandwidth_line(base, decode_ms=100.0).endswith("runs at 50% of bandwidth")
    assert "%" not in bandwidth_line(base, decode_ms=40.0)  # faster than the floor: no 125%


def test_quick_measures_what_export_writes_and_says_what_needs_torch(cache) -> None:
    """By default the bench measures the op set a user's export runs on the device, `--quick`
    keeps to a first look, and every log line is a sentence (no raw dicts)."""
    from loopcast.bench.harness import baseline_lines, default_variants

    result = CliRunner().invoke(
        main, ["bench", str(checkpoint("llama-tied-gqa")), "--device", "cpu", "--quick"]
    )
    assert result.exit_code == 0, result.output
    report = json.loads(next((cache / "cache" / "bench").glob("bench-*.json")).read_text())
    assert [run["variant"] for run in report["runs"]] == ["default"] == list(default_variants("cpu"))
    assert default_variants("cuda") == ("batch-invariant",)
    assert report["options"]["past"] == 128 and report["options"]["widths"] == [5]
    assert "{" not in result.stderr, result.stderr
    needs = baseline_lines({"error": "the PyTorch baseline needs torch (pip install torch); skipped"})
    assert needs == ["the PyTorch baseline needs torch (pip install torch); skipped"]
