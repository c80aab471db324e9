"""tools/bench/loadgen.py runs end to end on a tiny batched artifact: both modes, every level, the
same greedy tokens in both modes, a JSON report (no timing assertions)."""

from __future__ import annotations

import json
import subprocess
import sys
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
        ("sequential", 1),
        ("sequential", 3),
    ]
    assert all(lv["requests"] == 4 and lv["tokens"] == 20 for lv in report["levels"])
    assert report["compared_requests"] == 8 and report["mismatched_requests"] == 0


def test_server_modules_do_not_import_torch():
    import pytest

    pytest.importorskip("fastapi")
    code = (
        "import sys; import loopcast.serve.app, loopcast.serve.state, loopcast.serve.launch, "
        "loopcast.ort_runtime.batching.engine; print('torch' in sys.modules)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.stdout.strip() == "False", result.stderr[-1000:]
