"""Adaptive depth on the demo model: quality and speed of static depths and the exit gate.

    python -m tools.bench.bench_depth                 # ~10 min on 2 cores; tables on stdout
    python -m tools.bench.bench_depth --json out.json --passes 48 --q 0.25 --speed-only

Quality (teacher-forced on held-out text: ``--windows`` windows of ``--window`` tokens from the
held-out documents of this interpreter's stdlib, tools/demo_model/demo_corpus.py): every token
is fed through the artifact's exits graph (every loop's head and gate, ORT, CPU fp32), read at
its exit loop, and scored there:
  * bits/byte: the cross-entropy at the exit loop over the window's bytes (the next token's
    text, UTF-8);
  * top-1 agreement with full depth: the exit loop's argmax against loop R's argmax of the
    model with full KV (the reference pass);
  * mean loops per token.
Under ``full`` the KV is the model's own whatever q, so one pass scores every q; under
``last-exited`` each q is its own pass (a token's exit loop's K/V is copied into the deeper
slots, ``Generator.fill_deeper_kv``: the KV a row stopped at its exit loop leaves, as the
runtime's loop-skipping rows leave it).

Speed: greedy generation of ``--new-tokens`` tokens after held-out code prompts
(tools/demo_model/demo_prompts.py), plain at every static depth and with the gate at a few q
(and at the last-exited q whose bits/byte is within 1 % of full depth's, ``within``): passes of
one prompt each, interleaved across the configurations (``speed``); the median tok/s, the
median of each pass's ratio to full depth in that pass, and the load average before and after
(the machine may be shared).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time

import numpy as np
from loopcast.exporter.demo_artifact import demo_artifact_dir
from loopcast.ort_runtime.api import load
from loopcast.ort_runtime.decoding.exits import exit_loop

from tools.demo_model.demo_corpus import read_split_with_paths
from tools.demo_model.demo_prompts import code_prompts

THRESHOLDS = (0.05, 0.1, 0.15, 0.2, 0.25, 0.26, 0.27, 0.28, 0.29, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)


def windows(model, count: int, length: int) -> list[list[int]]:
    """``count`` windows of ``length`` tokens, one per held-out document long enough, in path order."""
    docs = sorted(read_split_with_paths("heldout"))
    out = []
    for _, text in docs:
        ids = model.encode(text)
        if len(ids) > length:
            out.append(ids[:length])
        if len(out) == count:
            break
    return out


def _log_softmax(row: np.ndarray) -> np.ndarray:
    row = row.astype(np.float64)
    m = row.max()
    return row - m - math.log(np.exp(row - m).sum())


def score(model, window: list[int], q: float | None, last_exited: bool) -> dict:
    """One teacher-forced pass: per scored token its exit loop (None: per-depth records for the
    `full` pass), nats at the exit, argmax at the exit and at loop R."""
    gen = model.new_generator()
    R = model.config.num_loops
    rows = []
    for i in range(len(window) - 1):
        out = gen.run_exits(window[i], want_logits=True)
        target = window[i + 1]
        nats = [-float(_log_softmax(out.logits[r])[target]) for r in range(R)]
        e = exit_loop(out.gates, q, 0, R - 1) if q is not None else None
        if last_exited and e is not None and e < R - 1:
            gen.fill_deeper_kv(gen.n, e)
        gen.commit([window[i]])
        rows.append({"nats": nats, "argmax": out.next_ids.tolist(), "gates": out.gates.tolist(), "exit": e})
    return {"rows": rows}


def quality(model, wins: list[list[int]]) -> list[dict]:
    R = model.config.num_loops
    full = [score(model, w, None, False)["rows"] for w in wins]
    nbytes = sum(len(model.decode(w[1:]).encode()) for w in wins)
    results = []
    for k in range(1, R + 1):  # static depths (teacher-forced at depth k: loops 0..k-1's own KV)
        nats = sum(r["nats"][k - 1] for rows in full for r in rows)
        agree = sum(r["argmax"][k - 1] == r["argmax"][R - 1] for rows in full for r in rows)
        n = sum(len(rows) for rows in full)
        results.append(_row(f"loops={k}", "-", nats, nbytes, agree, n, float(k)))
    for q in THRESHOLDS:
        exits = [[exit_loop(r["gates"], q, 0, R - 1) for r in rows] for rows in full]
        nats = sum(r["nats"][e] for rows, es in zip(full, exits) for r, e in zip(rows, es))
        agree = sum(
            r["argmax"][e] == r["argmax"][R - 1] for rows, es in zip(full, exits) for r, e in zip(rows, es)
        )
        n = sum(len(es) for es in exits)
        mean = sum(e + 1 for es in exits for e in es) / n
        results.append(_row(f"q={q}", "full", nats, nbytes, agree, n, mean))
        passes = [score(model, w, q, True)["rows"] for w in wins]
        nats = sum(r["nats"][r["exit"]] for rows in passes for r in rows)
        agree = sum(
            r["argmax"][r["exit"]] == f["argmax"][R - 1]
            for rows, ref in zip(passes, full)
            for r, f in zip(rows, ref)
        )
        mean = sum(r["exit"] + 1 for rows in passes for r in rows) / n
        results.append(_row(f"q={q}", "last-exited", nats, nbytes, agree, n, mean))
    return results


def _row(name: str, policy: str, nats: float, nbytes: int, agree: int, n: int, mean: float) -> dict:
    return {
        "config": name,
        "kv_policy": policy,
        "bits_per_byte": round(nats / math.log(2) / nbytes, 4),
        "top1_agreement": round(agree / n, 4),
        "mean_loops": round(mean, 3),
        "tokens": n,
    }


def within(quality_rows: list[dict], tolerance: float = 0.01) -> dict | None:
    """The last-exited row with the fewest mean loops whose bits/byte is within ``tolerance`` of
    full depth's (None: no quality table)."""
    if not quality_rows:
        return None
    full = max((r for r in quality_rows if r["config"].startswith("loops=")), key=lambda r: r["mean_loops"])
    ok = [
        r
        for r in quality_rows
        if r["kv_policy"] == "last-exited" and r["bits_per_byte"] <= full["bits_per_byte"] * (1 + tolerance)
    ]
    return min(ok, key=lambda r: (r["mean_loops"], r["config"])) if ok else None


def depth_configs(R: int, extra_q: tuple[float, ...], forced: bool) -> list[tuple[str, dict]]:
    """Static depths R..1, the gate at 0.1, 0.2 and ``extra_q`` under both KV policies, and with
    ``forced`` a gate forced to exit at loop k (threshold 1e-9: the first loop ≥ min_loops = k
    exits), k = 1..R-1, under both policies: the exit path's cost on random weights."""
    configs = [(f"loops={k}", {"loops": k}) for k in range(R, 0, -1)]
    configs += [
        (f"q={q} {p}", {"exit_threshold": q, "kv_policy": p})
        for q in sorted({0.1, 0.2, *extra_q})
        for p in ("full", "last-exited")
    ]
    if forced:
        configs += [
            (f"exit at {k} {p}", {"exit_threshold": 1e-9, "min_loops": k, "kv_policy": p})
            for k in range(1, R)
            for p in ("full", "last-exited")
        ]
    return configs


def speed(
    model,
    ids: list[list[int]],
    new_tokens: int,
    passes: int,
    extra_q: tuple[float, ...] = (),
    forced: bool = False,
) -> list[dict]:
    """Each configuration's decode rate against full depth's. A pass generates ``new_tokens``
    from one prompt (the prompts in turn) under every configuration, in an order rotated from
    pass to pass, so load that drifts on a shared machine reaches them alike; a configuration's
    speedup is the median over passes of its rate over full depth's in the same pass (with the
    quartiles), and ``best`` the ratio of the two fastest passes (load only slows a pass)."""
    configs = depth_configs(model.config.num_loops, extra_q, forced)
    for prompt in ids[:1]:  # warm every session once
        for _, options in configs:
            model.generate(prompt, max_new_tokens=4, stop_ids=(), **options)
    rates: dict[str, list[float]] = {name: [] for name, _ in configs}
    loops: dict[str, list[float]] = {name: [] for name, _ in configs}
    core: dict[str, list[float]] = {name: [] for name, _ in configs}
    for i in range(passes):
        prompt, shift = ids[i % len(ids)], i % len(configs)
        for name, options in configs[shift:] + configs[:shift]:
            t0 = time.perf_counter()
            result = model.generate(prompt, max_new_tokens=new_tokens, stop_ids=(), **options)
            rates[name].append(len(result.tokens) / (time.perf_counter() - t0))
            loops[name].append(result.stats.mean_loops)
            core[name].append(result.stats.core_calls_per_token)
    full = rates[configs[0][0]]
    out = []
    for name, _ in configs:
        ratios = [a / b for a, b in zip(rates[name], full)]
        out.append(
            {
                "config": name,
                "tok_s": round(float(np.median(rates[name])), 1),
                "speedup": round(float(np.median(ratios)), 3),
                "speedup_quartiles": [round(float(np.percentile(ratios, p)), 3) for p in (25, 75)],
                "best": round(max(rates[name]) / max(full), 3),
                "mean_loops": round(float(np.mean(loops[name])), 3),
                "core_calls_per_token": round(float(np.mean(core[name])), 3),
            }
        )
    return out


def print_speed(rows: list[dict], R: int) -> None:
    print(
        f"| config | tok/s (median) | vs loops={R} (median of per-pass ratios) | quartiles | best vs best "
        "| mean loops | core passes/token | ms/token (median) |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        lo, hi = r["speedup_quartiles"]
        print(
            f"| {r['config']} | {r['tok_s']} | {r['speedup']}x | {lo}-{hi} | {r['best']}x "
            f"| {r['mean_loops']} | {r['core_calls_per_token']} | {1000 / r['tok_s']:.3f} |"
        )


def artifact_speed(args) -> None:
    """``--artifact``: the speed table of any looped artifact on ``--device`` (random weights: no
    quality), with forced-gate rows; prompts of 32 random ids when there is no tokenizer."""
    model = load(args.artifact, device=args.device)
    if model.tokenizer is not None:
        ids = [model.encode(p) for p in code_prompts(sorted(read_split_with_paths("heldout")), args.prompts)]
    else:
        rng = np.random.default_rng(0)
        ids = [rng.integers(0, model.config.vocab_size, 32).tolist() for _ in range(args.prompts)]
    s = speed(model, ids, args.new_tokens, args.passes, tuple(args.q), forced=True)
    print(f"{args.artifact} on {args.device}, {args.passes} passes of {args.new_tokens} tokens")
    print_speed(s, model.config.num_loops)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"speed": s, "args": vars(args)}, f, indent=1)


def memory(model) -> dict:
    """Resident memory (VmRSS, MiB) a fresh model gains when a generation first makes the
    exit gate's loop-step sessions, and then static depth 3's session."""

    def rss() -> float:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) / 1024 for line in f if line.startswith("VmRSS"))

    prompt = model.encode("import os\n")
    model.generate(prompt, max_new_tokens=4)
    plain = rss()
    model.generate(prompt, max_new_tokens=4, exit_threshold=0.2, kv_policy="last-exited")
    gated = rss()
    model.generate(prompt, max_new_tokens=4, loops=3)
    return {
        "plain_mib": round(plain),
        "loop_steps_mib": round(gated - plain),
        "depth3_mib": round(rss() - gated),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--windows", type=int, default=8)
    parser.add_argument("--window", type=int, default=129)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--passes", type=int, default=24)
    parser.add_argument("--q", type=float, action="append", default=[], help="more thresholds to time")
    parser.add_argument("--json", default=None)
    parser.add_argument("--speed-only", action="store_true", help="skip the quality tables")
    parser.add_argument(
        "--artifact",
        default=None,
        help="time this looped artifact instead of the demo (speed only, with forced-gate rows; "
        "random-id prompts when it has no tokenizer)",
    )
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    args = parser.parse_args()
    if args.artifact is not None:
        artifact_speed(args)
        return
    model = load(demo_artifact_dir(progress=True))
    mem = memory(model)
    print(
        f"resident memory: {mem['plain_mib']} MiB; the loop-step sessions +{mem['loop_steps_mib']} MiB; "
        f"static depth 3's session +{mem['depth3_mib']} MiB"
    )
    t0 = time.perf_counter()
    q = [] if args.speed_only else quality(model, windows(model, args.windows, args.window))
    print(f"quality: {time.perf_counter() - t0:.0f} s", flush=True)
    print("| config | KV policy | bits/byte | top-1 agreement with loops=4 | mean loops |")
    print("|---|---|---:|---:|---:|")
    for r in q:
        print(
            f"| {r['config']} | {r['kv_policy']} | {r['bits_per_byte']} | {r['top1_agreement']} "
            f"| {r['mean_loops']} |"
        )
    pick = within(q)
    if pick is not None:
        print(
            f"last-exited within 1% of full depth's bits/byte: {pick['config']} ({pick['mean_loops']} loops)"
        )
    extra = tuple(args.q) + ((float(pick["config"][2:]),) if pick is not None else ())
    prompts = code_prompts(sorted(read_split_with_paths("heldout")), args.prompts)
    load_before = os.getloadavg()
    s = speed(model, [model.encode(p) for p in prompts], args.new_tokens, args.passes, extra)
    load_after = os.getloadavg()
    print(f"load average (1, 5, 15 min) before {load_before}, after {load_after}")
    print_speed(s, model.config.num_loops)
    if args.json:
        with open(args.json, "w") as f:
            record = {
                "quality": q,
                "speed": s,
                "args": vars(args),
                "load": [load_before, load_after],
                "memory": mem,
            }
            json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
