"""tools/bench/loadgen.py runs end to end on a tiny batched artifact: both modes, plain and
self-speculating, every level, the same greedy tokens in every run, a JSON report (no timing
assertions)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from tests.artifacts import artifact, require_exact_cpu_artifacts

ROOT = Path(__file__).resolve().parents[2]


def test_loadgen_small(tmp_path):
    require_exact_cpu_artifacts()
    path = artifact("ouro-r3", max_batch=4)
    out = tmp_path / "r.json"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "tools.bench.loadgen",
            str(path),
            "--concurrency",
            "1,3",
            "--requests",
            "4",
            "--max-tokens",
            "5",
            "--prompt-len",
            "6",
            "--max-batch",
            "4",
            "--speculative",
            "none,self",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads(out.read_text())
    assert [(lv["mode"], lv["clients"]) for lv in report["levels"]] == [
        ("batched", 1),
        ("batched", 3),
        ("batched+self", 1),
        ("batched+self", 3),
        ("sequential", 1),
        ("sequential", 3),
        ("sequential+self", 1),
        ("sequential+self", 3),
    ]
    assert all(lv["requests"] == 4 and lv["tokens"] == 20 for lv in report["levels"])
    assert report["compared_requests"] == 8 and report["mismatched_requests"] == 0
    selfs = [lv for lv in report["levels"] if lv["mode"] == "batched+self"]
    assert all(lv["served_by"] == ["self"] for lv in selfs)
    assert sum(lv["engine_stats"]["self_rounds"] for lv in selfs) > 0


def test_loadgen_multi_turn_with_chunks_and_a_shared_prefix(tmp_path):
    """Second turns reuse their first turn's KV (cached tokens reported) and both engines give the
    same greedy tokens with chunked prefill on, as does the batched engine without the cache (the
    cold run the cached second turns' TTFT is priced against)."""
    require_exact_cpu_artifacts()
    out = tmp_path / "r.json"
    args = ["--concurrency", "2", "--requests", "4", "--max-tokens", "4", "--prompt-len", "6"]
    args += ["--max-batch", "4", "--multi-turn", "--shared-prefix", "8", "--prefill-chunk", "4"]
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "tools.bench.loadgen",
            str(artifact("ouro-r3", max_batch=4)),
            *args,
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads(out.read_text())
    batched, sequential, cold = report["levels"]
    assert batched["prefill_chunk"] == 4 and batched["prefix_caching"] == "on"
    assert cold["mode"] == "batched-cold" and cold["prefix_caching"].startswith("off")
    assert cold["second_turn_cached_tokens_mean"] == 0
    assert set(report["second_turn_ttft_cached_over_cold"]) == {"batched C=2"}
    # A second turn finds its first turn's 14 prompt tokens and 3 committed answer tokens unless
    # another request took that freed slot first (scheduling-dependent); the 8-token shared
    # prefix is held by the other conversations' slots either way.
    assert 8 <= batched["second_turn_cached_tokens_mean"] <= 8 + 6 + 3
    assert sequential["second_turn_cached_tokens_mean"] == 0
    assert batched["tokens"] == sequential["tokens"] == cold["tokens"] == 4 * 2 * 4
    assert report["compared_requests"] == 8 and report["mismatched_requests"] == 0  # both turns


def test_server_modules_do_not_import_torch():
    import pytest

    pytest.importorskip("fastapi")
    code = (
        "import sys; import loopcast.serve.app, loopcast.serve.state, loopcast.serve.launch, "
        "loopcast.ort_runtime.batching.engine; print('torch' in sys.modules)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.stdout.strip() == "False", result.stderr[-1000:]


def test_loadgen_batched_pipeline_with_oracle_drafts(tmp_path):
    """The batched pipeline beside batched plain on oracle drafts (92 % right), gate forced on:
    the pipeline runs in the batch, nearly every draft is accepted, the tokens are plain's."""
    require_exact_cpu_artifacts()
    out = tmp_path / "r.json"
    args = ["--concurrency", "1,3", "--requests", "4", "--max-tokens", "12", "--prompt-len", "6"]
    args += ["--max-batch", "4", "--modes", "batched", "--speculative", "none,pipeline,self"]
    args += ["--oracle-reject", "0.08", "--gate", "always"]
    result = subprocess.run(
        [sys.executable, "-m", "tools.bench.loadgen", str(artifact("ouro-r3", max_batch=4)), *args]
        + ["--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report["oracle_reject"] == 0.08 and report["gate"] == "always"
    assert report["compared_requests"] == 8 and report["mismatched_requests"] == 0
    piped = [lv for lv in report["levels"] if lv["mode"] == "batched+pipeline"]
    assert [lv["served_by"] for lv in piped] == [["pipeline"], ["pipeline"]]
    assert all(lv["engine_stats"]["pipeline_cycles"] > 0 for lv in piped)
    proposed = sum(lv["drafts_proposed"] for lv in piped)
    assert sum(lv["drafts_accepted"] for lv in piped) >= 0.8 * proposed > 0
    selfs = [lv for lv in report["levels"] if lv["mode"] == "batched+self"]
    assert sum(lv["drafts_accepted"] for lv in selfs) >= 0.8 * sum(lv["drafts_proposed"] for lv in selfs) > 0


def test_loadgen_names_a_kind_that_runs_uncaptured(tmp_path, monkeypatch, capsys):
    """A kind whose capture failed (graph_fallbacks) is said once a run, with its reason's first
    line, besides the report's per-level record: a captured benchmark that quietly ran eager
    is not the number it claims."""
    require_exact_cpu_artifacts()
    from loopcast.ort_runtime.binding import batch_generator

    from tools.bench import loadgen

    made = batch_generator.BatchGenerator.__init__

    def failing(self, *args, **kwargs):
        made(self, *args, **kwargs)
        self.graph_fallbacks["prefill"] = "ORT refused the capture\nsecond line"

    monkeypatch.setattr(batch_generator.BatchGenerator, "__init__", failing)
    out = tmp_path / "r.json"
    argv = [str(artifact("ouro-r3", max_batch=4)), "--modes", "batched", "--concurrency", "1,2"]
    argv += ["--requests", "2", "--max-tokens", "3", "--prompt-len", "4", "--max-batch", "4"]
    assert loadgen.main([*argv, "--out", str(out)]) == 0
    lines = [ln for ln in capsys.readouterr().out.splitlines() if "runs uncaptured" in ln]
    assert lines == ["  prefill runs uncaptured: ORT refused the capture"]
    report = json.loads(out.read_text())
    assert all(
        lv["graph_fallbacks"] == {"prefill": "ORT refused the capture\nsecond line"}
        for lv in report["levels"]
    )


def test_stalls_name_the_passes_over_three_steps_and_the_graph_runs_inside_them():
    """A pass over 3x the mean step is a stall; one whose time is a slow graph run's is named as
    inside ORT's run, one without as the host's; passes outside the level are left out."""
    from types import SimpleNamespace

    from loopcast.ort_runtime.batching.admission import EngineBase
    from loopcast.ort_runtime.binding.step_clock import StepClock

    from tools.bench.loadgen_report import stall_line, stalls

    engine = EngineBase(max_length=64, max_waiting=4)
    clock = StepClock()
    engine.gen = SimpleNamespace(clock=clock)
    for _ in range(20):
        engine._timed("step", 0.010)
        clock.record("decode_batch", 0.009, steady=True)
    assert not engine.slow_phases and not clock.slow
    start = time.perf_counter()
    clock.record("decode_batch", 0.040, steady=True)  # a slow run inside the next pass
    engine._timed("step", 0.045)
    time.sleep(0.06)  # the next pass's window (its end minus its time) starts after that run
    engine._timed("prefill", 0.040)  # a slow pass with no slow graph run: the host's
    engine._timed("step", 0.012)  # not a stall
    found = stalls(engine, start, time.perf_counter())
    assert [(f["phase"], round(f["ms"])) for f in found] == [("step", 45), ("prefill", 40)]
    assert [g["kind"] for g in found[0]["graph_runs"]] == ["decode_batch"] and not found[1]["graph_runs"]
    assert "2, 1 of them mostly one slow graph run (decode_batch)" in stall_line(found)
    assert stalls(engine, time.perf_counter(), time.perf_counter() + 1) == []
    engine.reset_phase_timer()
    assert not engine.phase_ms and not engine.slow_phases and stalls(engine, 0.0, 1e12) == []
