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
