"""Where a default-gated generation's time goes, against plain decoding, mode by mode.

    python -m tools.bench.gate_overhead [ARTIFACT|demo] [--device cpu|cuda] [--passes 4] [--new-tokens 64]
                                  [--dtype fp16] [--json OUT]

The modes take turns prompt by prompt (bench/harness.py's prompts), each after an untimed
8-token warm-up; per mode and token: wall time, the graph runs' time (the generator's step
timers, prefill apart), the mean decode step, the host time (wall less every graph run: the
pushes, pulls and the engine's Python) and the rounds and probes the gate ran. A
default-gated mode that stands down should cost what plain decoding costs; this says which
part does not (docs/perf.md).
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import time


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("artifact", nargs="?", default="demo")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument(
        "--dtype", default=None, help="when exporting the demo (default: fp32 on cpu, fp16 on cuda)"
    )
    p.add_argument("--passes", type=int, default=4)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--json")
    args = p.parse_args()

    from loopcast.bench.harness import BENCH_PROMPTS
    from loopcast.ort_runtime import load

    path = args.artifact
    if path == "demo":
        from loopcast.exporter.export import ExportOptions, export_checkpoint

        dtype = args.dtype or ("fp16" if args.device == "cuda" else "fp32")
        path = f"/tmp/gate-overhead-demo-{dtype}"
        # CUDA: the loopcast ops (captured, exact); CPU: the default op set (exact there)
        export_checkpoint(
            "demo",
            path,
            ExportOptions(dtype=dtype, max_length=1024, batch_invariant=args.device == "cuda"),
            overwrite=True,
        )
    model = load(path, args.device)
    prompts = [model.encode(t) for t in BENCH_PROMPTS]

    modes = {"plain": {}, "prompt-lookup": {"speculative": "prompt-lookup"}, "self": {"speculative": "self"}}
    rows: dict[str, list[dict]] = {name: [] for name in modes}
    for _ in range(args.passes):
        acc = {name: collections.defaultdict(float) for name in modes}
        for prompt in prompts:
            for name, kw in modes.items():
                model.generate(prompt, 8, stop_ids=(), **kw)
                t0 = time.perf_counter()
                out = model.generate(prompt, args.new_tokens, stop_ids=(), **kw)
                a, s = acc[name], out.stats
                a["wall"] += time.perf_counter() - t0
                a["tokens"] += len(out.tokens)
                a["prefill"] += s.step_seconds.get("prefill", 0.0)
                a["graph"] += sum(v for k, v in s.step_seconds.items() if k != "prefill")
                a["decode_s"] += s.step_seconds.get("decode", 0.0)
                a["decode_n"] += s.steps.get("decode", 0)
                a["rounds"] += s.rounds
                a["probes"] += (s.gate_report or {}).get("probes", 0)
        for name in modes:
            rows[name].append(dict(acc[name]))
    report = {}
    for name, passes in rows.items():

        def per(key, passes=passes):
            return statistics.median(1e6 * r[key] / r["tokens"] for r in passes)

        report[name] = {
            "ratio": statistics.median(
                p0["tokens"] / p0["wall"] / (pl["tokens"] / pl["wall"])
                for p0, pl in zip(passes, rows["plain"], strict=True)
            ),
            "wall_us": per("wall"),
            "graph_us": per("graph"),
            "prefill_us": per("prefill"),
            "host_us": statistics.median(
                1e6 * (r["wall"] - r["graph"] - r["prefill"]) / r["tokens"] for r in passes
            ),
            "decode_step_us": statistics.median(1e6 * r["decode_s"] / max(r["decode_n"], 1) for r in passes),
            "rounds": statistics.median(r["rounds"] for r in passes),
            "probes": statistics.median(r["probes"] for r in passes),
        }
    print(
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} {args.device} {path}: "
        f"{len(prompts)} prompts x "
        f"{args.new_tokens} tokens, {args.passes} interleaved passes (medians), per token in us"
    )
    print(
        f"{'mode':<14}{'ratio':>7}{'wall':>9}{'graphs':>9}{'decode step':>13}{'host':>9}{'prefill':>9}"
        f"{'rounds':>8}{'probes':>8}"
    )
    for name, r in report.items():
        print(
            f"{name:<14}{r['ratio']:>7.3f}{r['wall_us']:>9.1f}{r['graph_us']:>9.1f}{r['decode_step_us']:>13.1f}"
            f"{r['host_us']:>9.1f}{r['prefill_us']:>9.1f}{r['rounds']:>8.0f}{r['probes']:>8.0f}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
