"""`loopcast bench` on the CPU with a tiny model: the report's structure and its exactness rows.

Timings are not asserted (benchmarks prove speed, tests prove behaviour)."""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
from click.testing import CliRunner
from loopcast.bench.harness import BenchOptions, run_bench
from loopcast.bench.profile import alternation, kernel_family
from loopcast.bench.report import format_table, write_report
from loopcast.cli import main
from loopcast.custom_ops.build import find_ort_include
from loopcast.ort_runtime import load

from tests.artifacts import artifact, checkpoint


def test_tiny_report_on_cpu(tmp_path) -> None:
    variants = ("stock", "batch-invariant") if find_ort_include() and shutil.which("c++") else ("stock",)
    opts = BenchOptions(
        str(checkpoint("ouro-r3")),
        tmp_path / "work",
        device="cpu",
        dtypes=("fp32",),
        variants=variants,
        past=40,
        widths=(2, 5),
        iters=2,
        new_tokens=8,
        alternate_tokens=0,
    )
    report = run_bench(opts, log=lambda line: None)
    assert [r["variant"] for r in report["runs"]] == list(variants)
    for run in report["runs"]:
        kinds = {(s["kind"], s["rows"]) for s in run["steps"]}
        assert {("decode", 1), ("verify", 2), ("verify", 5), ("draft", 1), ("verify_tail", 5)} <= kinds
        assert all(s["uncaptured_ms"] > 0 and s["captured_ms"] is None for s in run["steps"])
        modes = {"plain", "prompt-lookup", "self", "prompt-lookup (gate always)", "self (gate always)"}
        if run["variant"] == "batch-invariant":  # the loopcast ops: the cycle graph and oracle rows too
            modes |= {
                "pipeline",
                "pipeline (gate always)",
                "pipeline oracle 100%",
                "pipeline oracle 92%",
                "pipeline (one cycle per call, gate always)",
            }
            kinds_cycle = {s["kind"] for s in run["steps"]}
            assert "cycle" in kinds_cycle
            oracle = run["end_to_end"]["pipeline oracle 100%"]
            assert oracle["acceptance"] == 1.0 and oracle["core_calls_per_token"] < 1.5
        assert set(run["end_to_end"]) == modes
        assert run["end_to_end"]["self"]["gate"] == "auto" and run["end_to_end"]["self"]["gate_reasons"]
        assert all(e["divergent_prompts"] == 0 for e in run["end_to_end"].values())
        if run["variant"] == "batch-invariant":
            rows = run["rows_identical"]
            assert rows["bit_identical_rows"] == rows["rows"] > 0 and rows["max_abs_diff"] == 0.0
    base = report["baselines"]["fp32"]
    assert base["eager_ms"] > 0 and base["floor_ms"] > 0 and base["bytes_per_step"]["total"] > 0
    assert "fp32 / stock" in format_table(report)
    out = write_report(report, tmp_path / "r" / "bench.json")
    assert json.loads(out[0].read_text())["runs"][0]["dtype"] == "fp32"


def test_kernel_families() -> None:
    assert kernel_family("sm90_xmma_gemm_f16f16_f32") == "matmul"
    assert kernel_family("loopcast::bi_matmul_kernel<__half>") == "loopcast custom ops"
    assert kernel_family("void onnxruntime::cuda::_LayerNormKernel") == "rmsnorm"
    assert kernel_family("flash_fwd_splitkv_kernel") == "attention"


def test_bad_widths_is_one_line_error() -> None:
    result = CliRunner().invoke(main, ["bench", "demo", "--device", "cpu", "--widths", "2,x"])
    assert result.exit_code == 2 and "--widths" in result.output and "Traceback" not in result.output


def test_alternation_rewinds_to_reach_the_token_count() -> None:
    # 128 positions hold about two rounds of the three modes; 300 tokens need restarts.
    model = load(artifact("ouro-r3", draft_depth=1, max_length=128), "cpu")
    prompt = list(range(3, 19))
    result = alternation(model, prompt, tokens=300, chunk=10)
    assert result["tokens"] >= 300 and result["restarts"] >= 2
    assert set(result["steps"]) >= {"decode", "draft", "verify", "verify_tail"}
    assert result["fallbacks"] == {}  # CPU: nothing captured


def test_alternation_refuses_a_context_without_room() -> None:
    model = load(artifact("ouro-r3", draft_depth=1, max_length=128), "cpu")
    with pytest.raises(ValueError, match="room for 4 chunks"):
        alternation(model, list(range(3, 19)), tokens=10, chunk=40)


def test_edit_workload_rows_are_plain_and_prompt_lookup(tmp_path) -> None:
    from loopcast.bench.harness import EDIT_PROMPTS, end_to_end

    # each edit prompt is a function followed by its own first line: the answer can copy it
    for prompt in EDIT_PROMPTS:
        body, _, restart = prompt.rstrip("\n").rpartition("\n\n\n")
        assert body.startswith(restart) and len(body) > 3 * len(restart)
    model = load(artifact("ouro-r3"), "cpu")
    prompts = [[5, 6, 7, 8, 5, 6, 7], [9, 10, 11, 9, 10]]
    rows = end_to_end(model, prompts, 12, speculative=("prompt-lookup",), passes=3)
    assert set(rows) == {"plain", "prompt-lookup", "prompt-lookup (gate always)"}
    assert all(e["divergent_prompts"] == 0 and e["tokens"] == 24 for e in rows.values())
    # three interleaved passes: the ratio is the median of the per-pass ratios against plain
    assert rows["plain"]["pass_speedups"] == [1.0] * 3
    ratios = rows["prompt-lookup"]["pass_speedups"]
    assert len(ratios) == 3 and abs(rows["prompt-lookup"]["speedup"] - sorted(ratios)[1]) < 1e-3
    assert rows["prompt-lookup (gate always)"]["rounds"] > 0


def test_quantized_weights_are_benched_beside_float(tmp_path) -> None:
    """--quantize none --quantize int4: one run per weight format, each artifact exported with
    its scheme, speculation still equal to plain on the int4 one."""
    from loopcast.manifest import Manifest

    opts = BenchOptions(
        str(checkpoint("ouro-r3")),
        tmp_path / "work",
        device="cpu",
        dtypes=("fp32",),
        variants=("default",),
        past=40,
        widths=(5,),
        iters=1,
        new_tokens=6,
        alternate_tokens=0,
        oracle_rejects=(),
        quantize=("none", "int4"),
    )
    report = run_bench(opts, log=lambda line: None)
    assert [r["quantize"] for r in report["runs"]] == ["none", "int4"]
    arts = sorted(p for p in (tmp_path / "work").iterdir() if p.name.startswith("art-"))
    schemes = {p.name: Manifest.read(p).quantization for p in arts}
    assert sum(s is not None for s in schemes.values()) == 1, schemes
    assert all(e["divergent_prompts"] == 0 for e in report["runs"][1]["end_to_end"].values())
    assert "int4 weights" in format_table(report)


def test_recurrent_depth_report_per_r_on_cpu(tmp_path) -> None:
    """A Huginn checkpoint: per r a plain step and the pipeline's cycle, the cycle's leaving rows
    against decode rows, and plain vs the pipeline (prompt lookup, oracle rows)."""
    from tests.artifacts import huginn, require_exact_cpu_artifacts

    require_exact_cpu_artifacts()
    ckpt, _ = huginn(48)  # the recurrent-depth runtime tests' artifact (one cache key: 48 positional)
    opts = BenchOptions(
        str(ckpt),
        tmp_path / "work",
        device="cpu",
        dtypes=("fp32",),
        variants=("default", "batch-invariant"),  # loopcast-attention; every loopcast op
        past=40,
        iters=2,
        new_tokens=12,
        alternate_tokens=0,
        torch_baseline=False,
        oracle_rejects=(0.0, 0.1),
        loops=(1, 4),
    )
    report = run_bench(opts, log=lambda line: None)
    assert [(r["variant"], r["loops"]) for r in report["runs"]] == [
        ("default", 1),
        ("default", 4),
        ("batch-invariant", 1),
        ("batch-invariant", 4),
    ]
    for run in report["runs"]:
        assert {(s["kind"], s["rows"]) for s in run["steps"]} == {
            ("decode", 1),
            ("recurrent_cycle", run["loops"]),
        }
        rows = run["rows_identical"]
        assert rows["bit_identical_rows"] == rows["rows"] > 0 and rows["max_abs_diff"] == 0.0
        assert set(run["end_to_end"]) == {
            "plain",
            "pipeline prompt-lookup",
            "pipeline oracle 100%",
            "pipeline oracle 90%",
        }
        assert all(e["divergent_prompts"] == 0 for e in run["end_to_end"].values())
        oracle = run["end_to_end"]["pipeline oracle 100%"]
        assert run["loops"] == 1 or oracle["acceptance"] == 1.0  # r = 1: a lane leaves as it enters
    table = format_table(report)
    assert "fp32 / default (past" in table and "r = 4)" in table and "cycle rows bit-identical" in table


def test_loops_is_refused_for_a_looped_checkpoint(tmp_path) -> None:
    from loopcast.errors import RequestError

    opts = BenchOptions(
        str(checkpoint("ouro-r3")), tmp_path / "work", device="cpu", dtypes=("fp32",), loops=(4,)
    )
    with pytest.raises(RequestError, match="--loops and --kl-threshold are for a recurrent-depth"):
        run_bench(opts, log=lambda line: None)
    with pytest.raises(RequestError, match="--loops and --kl-threshold are for a recurrent-depth"):
        run_bench(dataclasses.replace(opts, loops=(), kl_threshold=0.3), log=lambda line: None)
