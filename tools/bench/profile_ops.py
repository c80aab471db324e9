"""Where an artifact's CPU (or CUDA) time goes, op by op, from ONNX Runtime's own profiler.

    python -m tools.bench.profile_ops ART [--device cpu] [--prompt TEXT] [--new-tokens 64] \
        [--top 12] [--json out.json]
    python -m tools.bench.profile_ops ART --verify-rows 1,2,4,8 [--past 250] [--calls 30]

Runs greedy generation once to warm up, then again with every session profiled
(``LOOPCAST_ORT_PROFILE``, ort_runtime/loading/artifact.py), and prints per op type and per
node (layer numbers folded, so ``/loop#/layer#/mlp/gate_up_proj`` is every layer's) the total
time, the calls and the time per run of a session (one run: one prefill, decode or verify step).

``--verify-rows`` asks what a speculative round's rows cost instead: after a random prompt of
``--past`` tokens, ``--calls`` verify steps at each row count in turn, all at the same positions,
then per node the ms of one step at each count, and each node's ms per row added past the first
(from the fewest rows to the most): the price the cost gate pays for each draft.
"""

from __future__ import annotations

import argparse
import bisect
import json
import os
import re
import statistics
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
            node = _node(e)
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


def _node(event: dict) -> str:
    return re.sub(r"\d+", "#", event["name"].removesuffix("_kernel_time"))


def summarize_rows(events: list[dict], row_counts: list[int], calls: int) -> dict:
    """A verify session's profile whose last ``calls * len(row_counts)`` runs are ``calls`` runs
    at each row count in turn: per count, each node's ms a run and the runs' median wall ms."""
    runs = sorted((e for e in events if e.get("cat") == "Session" and e.get("name") == "model_run"), key=_ts)
    runs = runs[len(runs) - calls * len(row_counts) :]
    if len(runs) < calls * len(row_counts):
        raise SystemExit(f"error: the profile holds {len(runs)} runs, not {calls} at each of {row_counts}")
    starts = [r["ts"] for r in runs]
    per: dict[int, Counter] = {m: Counter() for m in row_counts}
    for e in events:
        if e.get("cat") != "Node" or not e["name"].endswith("_kernel_time"):
            continue
        i = bisect.bisect_right(starts, e["ts"]) - 1
        if i < 0 or e["ts"] > runs[i]["ts"] + runs[i]["dur"]:
            continue  # an earlier run's node (the prompt's prefill)
        per[row_counts[i // calls]][_node(e)] += e["dur"] / calls / 1e3
    wall = {
        m: statistics.median(r["dur"] / 1e3 for r in runs[i * calls : (i + 1) * calls])
        for i, m in enumerate(row_counts)
    }
    return {"nodes_ms": {m: dict(c) for m, c in per.items()}, "run_ms": wall}


def _verify_rows(art: str, device: str, row_counts: list[int], past: int, calls: int) -> dict:
    import numpy as np
    from loopcast.ort_runtime.binding.generator import Generator
    from loopcast.ort_runtime.loading.artifact import open_artifact

    from loopcast.manifest import VERIFY

    loaded = open_artifact(art, device)
    if VERIFY not in loaded.sessions:
        raise SystemExit(f"error: {art} has no verify graph")
    width = loaded.manifest.graphs[VERIFY].rows
    if max(row_counts) > width or min(row_counts) < 1:
        raise SystemExit(f"error: --verify-rows: the verify graph takes 1..{width} rows")
    if past + width > loaded.manifest.max_length:
        limit = loaded.manifest.max_length
        raise SystemExit(f"error: --past {past}: {width} rows past it exceed the max length {limit}")
    gen = Generator(loaded)
    gen.prefill(np.random.default_rng(0).integers(0, loaded.config.vocab_size, past).tolist())
    for m in row_counts:  # warm-up: each count's first call binds its buffers
        gen.run(VERIFY, past, tokens=[1] * m)
    for m in row_counts:
        for _ in range(calls):
            gen.run(VERIFY, past, tokens=[1] * m)
    session = loaded.sessions[VERIFY]
    events = json.loads(Path(getattr(session, "session", session).end_profiling()).read_text())
    return summarize_rows(events, row_counts, calls)


def _ts(event: dict) -> int:
    return event["ts"]


def _print_rows(result: dict, row_counts: list[int], top: int) -> None:
    nodes = result["nodes_ms"]
    lo, hi = row_counts[0], row_counts[-1]
    order = sorted(nodes[hi], key=lambda k: -nodes[hi][k])[:top]
    head = " ".join(f"{f'{m} rows':>9}" for m in row_counts)
    print(f"ms per verify step, per node (layers folded); last column: ms per row added, {lo} to {hi} rows")
    print(f"  {'node':48s} {head} {'per row':>9}")
    for k in order:
        cells = " ".join(f"{nodes[m].get(k, 0.0):9.3f}" for m in row_counts)
        added = (nodes[hi].get(k, 0.0) - nodes[lo].get(k, 0.0)) / max(1, hi - lo)
        print(f"  {k[-48:]:48s} {cells} {added:9.3f}")
    totals = {m: sum(nodes[m].values()) for m in row_counts}
    print(
        f"  {'all nodes':48s} "
        + " ".join(f"{totals[m]:9.3f}" for m in row_counts)
        + f" {(totals[hi] - totals[lo]) / max(1, hi - lo):9.3f}"
    )
    print(f"  {'step (wall, median)':48s} " + " ".join(f"{result['run_ms'][m]:9.3f}" for m in row_counts))


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
    p.add_argument("--verify-rows", default=None, help="row counts (1,2,4,8): profile verify steps instead")
    p.add_argument("--past", type=int, default=250, help="--verify-rows: prompt positions before the rows")
    p.add_argument("--calls", type=int, default=30, help="--verify-rows: steps timed at each row count")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.verify_rows is not None:
        row_counts = sorted({int(m) for m in args.verify_rows.split(",")})
        # the first pass warms the OS caches and the op library; the second is measured
        with tempfile.TemporaryDirectory() as tmp:
            os.environ["LOOPCAST_ORT_PROFILE"] = str(Path(tmp) / "prof")
            _verify_rows(args.artifact, args.device, row_counts, args.past, 2)
            result = _verify_rows(args.artifact, args.device, row_counts, args.past, args.calls)
        _print_rows(result, row_counts, args.top)
        if args.json:
            args.json.write_text(json.dumps(result, indent=2))
        return
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
