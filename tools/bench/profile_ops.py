"""Where an artifact's CPU (or CUDA) time goes, op by op, from ONNX Runtime's own profiler.

    python -m tools.bench.profile_ops ART [--device cpu] [--prompt TEXT] [--new-tokens 64] \
        [--top 12] [--json out.json]

Runs greedy generation once to warm up, then again with every session profiled
(``LOOPCAST_ORT_PROFILE``, ort_runtime/loading/artifact.py), and prints per op type and per
node (layer numbers folded, so ``/loop#/layer#/mlp/gate_up_proj`` is every layer's) the total
time, the calls and the time per run of a session (one run: one prefill, decode or verify step).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path


def summarize(files: list[Path], top: int) -> dict:
    by_op: Counter = Counter()
    by_node: Counter = Counter()
    calls: Counter = Counter()
    runs = 0
    for f in files:
        for e in json.loads(f.read_text()):
            if e.get("cat") == "Session" and e.get("name") == "model_run":
                runs += 1
            if e.get("cat") != "Node" or not e["name"].endswith("_kernel_time"):
                continue
            node = re.sub(r"\d+", "#", e["name"].removesuffix("_kernel_time"))
            by_op[e["args"].get("op_name", "?")] += e["dur"]
            by_node[node] += e["dur"]
            calls[node] += 1
    per_run = max(runs, 1) * 1e3
    return {
        "runs": runs,
        "ops_ms_per_run": {k: v / per_run for k, v in by_op.most_common(top)},
        "nodes": [
            {"node": k, "ms_per_run": v / per_run, "calls": calls[k], "us_per_call": v / calls[k]}
            for k, v in by_node.most_common(top)
        ],
    }


def _worker(art: str, device: str, prompt: str, new_tokens: int) -> None:
    from loopcast.ort_runtime import load

    model = load(art, device)
    model.generate(prompt, new_tokens)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("artifact")
    p.add_argument("--device", default="cpu")
    p.add_argument("--prompt", default='def merge_sorted(a, b):\n    """Merge two sorted lists."""\n')
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--top", type=int, default=12)
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        _worker(args.artifact, args.device, args.prompt, args.new_tokens)
        return
    # one child warms the OS caches and the op library; a second, profiled, is measured
    cmd = [
        sys.executable,
        "-m",
        "tools.bench.profile_ops",
        args.artifact,
        "--device",
        args.device,
        "--prompt",
        args.prompt,
        "--new-tokens",
        str(args.new_tokens),
        "--worker",
    ]
    subprocess.run(cmd, check=True)
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "LOOPCAST_ORT_PROFILE": str(Path(tmp) / "prof")}
        subprocess.run(cmd, check=True, env=env)
        result = summarize(sorted(Path(tmp).glob("prof*.json")), args.top)
    print(f"{result['runs']} session runs ({args.new_tokens} new tokens); ms per run:")
    for op, ms in result["ops_ms_per_run"].items():
        print(f"  {op:40s} {ms:8.3f}")
    print("nodes (layers folded):")
    for n in result["nodes"]:
        print(
            f"  {n['node']:56s} {n['ms_per_run']:8.3f} ms/run {n['calls']:6d} calls "
            f"{n['us_per_call']:9.1f} us/call"
        )
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
