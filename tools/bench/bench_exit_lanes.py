"""The exit gate through the pipeline on the demo model (docs/adaptive-depth.md): gated ``full``
with ``speculative='pipeline'`` against the full-depth pipeline and plain decoding.

    python -m tools.bench.bench_exit_lanes                    # ~3 min on 2 cores, 24 passes
    python -m tools.bench.bench_exit_lanes --q 0.1 --q 0.2 --passes 24 --json out.json
    python -m tools.bench.bench_exit_lanes --artifact DEMO_FP16 --device cuda   # a --target cuda export

Greedy generation of ``--new-tokens`` tokens after held-out code prompts
(tools/demo_model/demo_prompts.py) under every configuration, in passes of one prompt each with
the order rotated from pass to pass (a shared machine's drifting load reaches them alike). Each
configuration's speedup is the median over passes of its rate over the full-depth pipeline's in
the same pass (with the quartiles), and against plain full-depth decoding (no ratio of the
fastest passes: the prompts take turns, and a pipeline's rate depends on its prompt's drafts).
Core passes per token count the passes over the core layers (``stats.core_passes``: a cycle
is one, a loop step one, a decode step R), the work a token costs. The gated rows'
tokens are checked against plain gated decoding's at the same q on every pass.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np
from loopcast.exporter.demo_artifact import demo_artifact_dir
from loopcast.ort_runtime.api import load

from tools.demo_model.demo_corpus import read_split_with_paths
from tools.demo_model.demo_prompts import code_prompts

PLAIN, PIPELINE = "plain", "pipeline"


def configurations(thresholds: list[float]) -> list[tuple[str, dict]]:
    configs = [
        (PLAIN, {}),
        (PIPELINE, {"speculative": "pipeline"}),
        ("pipeline always", {"speculative": "pipeline", "gate": "always"}),
        (
            "pipeline always, host lanes",
            {"speculative": "pipeline", "gate": "always", "pipeline_device_lanes": False},
        ),
    ]
    for q in thresholds:
        configs += [
            (f"q={q} plain", {"exit_threshold": q}),
            (f"q={q} pipeline", {"exit_threshold": q, "speculative": "pipeline"}),
            (f"q={q} pipeline always", {"exit_threshold": q, "speculative": "pipeline", "gate": "always"}),
        ]
    return configs


def speed(model, prompts: list[str], new_tokens: int, passes: int, thresholds: list[float]) -> list[dict]:
    configs = configurations(thresholds)
    ids = [model.encode(p) for p in prompts]
    for _, options in configs:  # warm every session once
        model.generate(ids[0], max_new_tokens=4, stop_ids=(), **options)
    rates: dict[str, list[float]] = {name: [] for name, _ in configs}
    stats: dict[str, list] = {name: [] for name, _ in configs}
    for i in range(passes):
        prompt, shift = ids[i % len(ids)], i % len(configs)
        tokens = {}
        for name, options in configs[shift:] + configs[:shift]:
            t0 = time.perf_counter()
            result = model.generate(prompt, max_new_tokens=new_tokens, stop_ids=(), **options)
            rates[name].append(len(result.tokens) / (time.perf_counter() - t0))
            stats[name].append(result.stats)
            tokens[name] = result.tokens
        for q in thresholds:  # exactness on every pass: the lanes give plain gated decoding's tokens
            for name in (f"q={q} pipeline", f"q={q} pipeline always"):
                if tokens[name] != tokens[f"q={q} plain"]:
                    raise AssertionError(f"{name}: tokens differ from plain gated decoding (pass {i})")
    out = []
    for name, _ in configs:
        vs_pipe = [a / b for a, b in zip(rates[name], rates[PIPELINE])]
        vs_plain = [a / b for a, b in zip(rates[name], rates[PLAIN])]
        runs = stats[name]
        emitted = sum(s.new_tokens for s in runs)
        out.append(
            {
                "config": name,
                "tok_s": round(float(np.median(rates[name])), 1),
                "vs_pipeline": round(float(np.median(vs_pipe)), 3),
                "vs_pipeline_quartiles": [round(float(np.percentile(vs_pipe, p)), 3) for p in (25, 75)],
                "vs_plain": round(float(np.median(vs_plain)), 3),
                "core_passes_per_token": round(sum(s.core_passes for s in runs) / emitted, 3),
                "accepted": round(sum(s.accepted for s in runs) / max(sum(s.proposed for s in runs), 1), 3),
                "mean_loops": round(float(np.mean([s.mean_loops for s in runs])), 3),
            }
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--passes", type=int, default=24)
    parser.add_argument(
        "--q", type=float, action="append", default=[], help="thresholds (default 0.05, 0.1, 0.2, 0.25, 0.3)"
    )
    parser.add_argument("--json", default=None)
    parser.add_argument("--artifact", default=None, help="a demo export to time instead of the shipped one")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    args = parser.parse_args()
    thresholds = args.q or [0.05, 0.1, 0.2, 0.25, 0.3]
    model = load(args.artifact or demo_artifact_dir(progress=True), args.device)
    prompts = code_prompts(sorted(read_split_with_paths("heldout")), args.prompts)
    load_before = os.getloadavg()
    rows = speed(model, prompts, args.new_tokens, args.passes, thresholds)
    load_after = os.getloadavg()
    print(f"load average (1, 5, 15 min) before {load_before}, after {load_after}")
    print(
        "| configuration | tok/s (median) | vs full-depth pipeline (median) | quartiles | vs plain "
        "| core passes / token | drafts accepted | mean loops |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        lo, hi = r["vs_pipeline_quartiles"]
        print(
            f"| {r['config']} | {r['tok_s']} | {r['vs_pipeline']}x | {lo}-{hi} | {r['vs_plain']}x "
            f"| {r['core_passes_per_token']} | {r['accepted']} | {r['mean_loops']} |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"speed": rows, "args": vars(args), "load": [load_before, load_after]}, f, indent=1)


if __name__ == "__main__":
    main()
