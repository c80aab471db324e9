"""Self-speculation with and without the alternate suffix on the demo model, in one run.

    python -m tools.bench.bench_alternate [--tokens 128] [--passes 2] [--threads N] [--json OUT]
    python -m tools.bench.bench_alternate --device cuda --dtype fp16     # loopcast ops (--target cuda)

Exports the demo model with ``--tree-verify`` (once, into the loopcast cache), then times plain
greedy, self-speculation without the alternate (k = 4, the default, and k = 3) and with it
(``--alternate-gap`` P, k = 3 and 2), each under the engine's gate (auto) and with the gate off
(none), on the bench prompts (bench/harness.py). Configs are interleaved prompt by prompt and
each config's time is the best of ``--passes`` passes; every run's tokens must equal plain
greedy's. Reports tokens/s and the ratio against self-speculation without the alternate at the
same gate (k = 4), the fork rate (rounds with a branch / rounds), selections, tokens gained,
and skipped forks (no room in the verify width).
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from datetime import date
from pathlib import Path

from loopcast.bench.harness import BENCH_PROMPTS
from loopcast.exporter.demo_artifact import demo_artifact_dir
from loopcast.ort_runtime import load
from loopcast.ort_runtime.decoding.speculate import GenerationStats

from loopcast.demo_checkpoint import demo_checkpoint_dir

# (label, speculative, k, alternate gap)
CONFIGS = [
    ("plain", "none", None, None),
    ("self k=4", "self", 4, None),
    ("self k=3", "self", 3, None),
    ("alt 0.1 k=3", "self", 3, 0.1),
    ("alt 0.3 k=3", "self", 3, 0.3),
    ("alt 0.3 k=2", "self", 2, 0.3),
    ("alt 1.0 k=3", "self", 3, 1.0),
]


def tree_artifact(dtype: str, device: str) -> Path:
    from loopcast.exporter.export import ExportOptions, export_checkpoint

    from loopcast.manifest import TREE_TAIL, Manifest

    cuda = device == "cuda"  # the loopcast ops, as --target cuda
    art = demo_artifact_dir().with_name(
        demo_artifact_dir().name + f"-tree-{dtype}" + ("-cuda" if cuda else "")
    )
    if not (art / "manifest.json").is_file() or TREE_TAIL not in Manifest.read(art).graphs:
        export_checkpoint(
            demo_checkpoint_dir(),
            art,
            ExportOptions(
                dtype=dtype,
                max_length=1024,
                verify_width=5,
                draft_depth=1,
                batch_invariant=cuda,
                tree_verify=True,
            ),
            overwrite=True,
        )
    return art


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--passes", type=int, default=2)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--gates", default="auto,none")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--dtype", choices=("fp32", "fp16", "bf16"), default="fp32")
    args = p.parse_args()
    model = load(tree_artifact(args.dtype, args.device), args.device, threads=args.threads)
    prompts = [model.encode(t) for t in BENCH_PROMPTS]
    plain = [model.generate(ids, args.tokens, stop_ids=()).tokens for ids in prompts]
    runs = [(c, g) for c in CONFIGS for g in (args.gates.split(",") if c[1] != "none" else ["none"])]
    best = {r: float("inf") for r in runs}
    totals: dict = {}
    mismatches = 0
    gens = {r: model.new_generator() for r in runs}  # each config keeps its own gate memory and timers
    for _ in range(args.passes):
        seconds = {r: 0.0 for r in runs}
        counts = {r: GenerationStats() for r in runs}
        for ids, truth in zip(prompts, plain):
            for run in runs:
                (label, mode, k, gap), gate = run
                stats = GenerationStats()
                t0 = time.perf_counter()
                tokens = list(
                    model.stream_ids(
                        ids,
                        args.tokens,
                        stop_ids=(),
                        speculative=mode,
                        num_draft_tokens=k,
                        gate=gate,
                        alternate_gap=gap,
                        generator=gens[run],
                        stats=stats,
                    )
                )
                seconds[run] += time.perf_counter() - t0
                gens[run].rewind(0)
                mismatches += tokens != truth
                total = counts[run]
                for name in (
                    "new_tokens",
                    "rounds",
                    "accepted",
                    "forks",
                    "fork_skips",
                    "alternate_selected",
                    "alternate_tokens",
                    "fork_misses",
                    "alternate_discarded",
                ):
                    setattr(total, name, getattr(total, name) + getattr(stats, name))
        for run in runs:
            if seconds[run] < best[run]:
                best[run], totals[run] = seconds[run], counts[run]
    rows = []
    for run in runs:
        (label, mode, k, gap), gate = run
        s = totals[run]
        base = best[(CONFIGS[1], gate)] if mode != "none" else best[run]
        rows.append(
            {
                "config": label,
                "gate": gate,
                "tokens_per_s": round(s.new_tokens / best[run], 1),
                "vs_self_k4": round(base / best[run], 3),
                "vs_plain": round(best[(CONFIGS[0], "none")] / best[run], 3),
                "rounds": s.rounds,
                "tokens_per_round": round((s.accepted + s.rounds) / s.rounds, 3) if s.rounds else 0,
                "forks": s.forks,
                "fork_rate": round(s.forks / s.rounds, 3) if s.rounds else 0.0,
                "fork_skips": s.fork_skips,
                "selected": s.alternate_selected,
                "tokens_gained": s.alternate_tokens,
                "fork_misses": s.fork_misses,
                "discarded": s.alternate_discarded,
            }
        )
    print(
        "| config | gate | tok/s | vs self k=4 | vs plain | rounds | tok/round | fork rate | forks "
        "| selected | gained | misses | skipped |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['config']} | {r['gate']} | {r['tokens_per_s']} | {r['vs_self_k4']} | {r['vs_plain']} | "
            f"{r['rounds']} | {r['tokens_per_round']} | {r['fork_rate']} | {r['forks']} | {r['selected']} | "
            f"{r['tokens_gained']} | {r['fork_misses']} | {r['fork_skips']} |"
        )
    print(f"tokens equal to plain greedy in every run: {mismatches == 0} ({mismatches} mismatches)")
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "command": "python -m tools.bench.bench_alternate "
                    + " ".join(
                        f"--{k.replace('_', '-')} {v}"
                        for k, v in vars(args).items()
                        if v is not None and k != "json"
                    ),
                    "date": date.today().isoformat(),
                    "machine": platform.processor() or platform.machine(),
                    "device": args.device,
                    "dtype": args.dtype,
                    "prompts": len(prompts),
                    "tokens": args.tokens,
                    "passes": args.passes,
                    "mismatches": mismatches,
                    "rows": rows,
                },
                indent=1,
            )
            + "\n"
        )
    if mismatches:
        raise SystemExit("tokens differ from plain greedy")


if __name__ == "__main__":
    main()
