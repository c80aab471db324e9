"""``LOOPCAST_ORT_PROFILE`` (ort_runtime/loading/artifact.py) and tools/bench/profile_ops.py's
summary: every session the runtime opens is profiled, and the summary counts one run a step and
folds the layers' nodes into one row each. Timings are not asserted."""

from __future__ import annotations

import gc

from loopcast.ort_runtime import load

from tests.artifacts import artifact
from tools.bench.profile_ops import summarize


def test_profiled_steps_summarized_per_layer_node(tmp_path, monkeypatch):
    art = artifact("llama-tied-gqa")
    new_tokens = 6
    monkeypatch.setenv("LOOPCAST_ORT_PROFILE", str(tmp_path / "prof"))
    model = load(art, "cpu")
    out = model.generate([3, 1, 4, 1, 5], new_tokens, stop_ids=())
    assert len(out.tokens) == new_tokens
    del model, out
    gc.collect()  # ONNX Runtime writes a session's profile when the session ends
    files = sorted(tmp_path.glob("prof*.json"))
    assert files, "no profile written"
    result = summarize(files, top=1000)
    # one prefill, then one decode step a token after the first
    assert result["runs"] == new_tokens
    nodes = {n["node"]: n for n in result["nodes"]}
    folded = [name for name in nodes if "layer#" in name]
    assert folded and all(not any(c.isdigit() for c in name) for name in nodes)
    layers = max(n["calls"] for n in result["nodes"] if "layer#" in n["node"])
    assert layers % result["runs"] == 0 and layers > result["runs"]  # several layers a step
    assert sum(result["ops_ms_per_run"].values()) > 0


def test_verify_rows_profiled_per_row_count(monkeypatch, tmp_path):
    """--verify-rows: each row count's steps are told apart from the prompt's prefill and from
    each other, and a step's node time grows with its rows (the products' work does)."""
    from tools.bench.profile_ops import _verify_rows

    monkeypatch.setenv("LOOPCAST_ORT_PROFILE", str(tmp_path / "prof"))
    art = artifact("llama-tied-gqa", verify_width=5)
    result = _verify_rows(str(art), "cpu", [1, 5], past=12, calls=4)
    one, five = result["nodes_ms"][1], result["nodes_ms"][5]
    assert one.keys() == five.keys() and any("layer#" in k for k in one)
    assert all(result["run_ms"][m] > 0 for m in (1, 5))
    assert sum(five.values()) > sum(one.values())


def test_verify_rows_summary_assigns_runs_in_order():
    from tools.bench.profile_ops import summarize_rows

    def run(ts):
        return {"cat": "Session", "name": "model_run", "ts": ts, "dur": 10}

    def node(ts, dur):
        return {"cat": "Node", "name": "/layer3/mlp_kernel_time", "ts": ts, "dur": dur}

    # a prefill run, then two runs at 1 row and two at 2 rows
    events = [run(0), node(1, 999), run(100), node(101, 2000), run(200), node(201, 4000)]
    events += [run(300), node(301, 6000), run(400), node(401, 8000)]
    result = summarize_rows(events, [1, 2], calls=2)
    assert result["nodes_ms"] == {1: {"/layer#/mlp": 3.0}, 2: {"/layer#/mlp": 7.0}}
    assert result["run_ms"] == {1: 0.01, 2: 0.01}
