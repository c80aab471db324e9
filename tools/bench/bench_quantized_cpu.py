"""Plain greedy decode of quantized artifacts against the float one, in one run, on the CPU; and
whether speculation on the quantized ones returns plain greedy's tokens (docs/quantization.md).

    loopcast random-checkpoint CKPT --preset ouro-1.4b
    loopcast export CKPT -o fp32 --max-length 256 --exit-depths none
    loopcast export CKPT -o int4 --quantize int4 --max-length 256 --exit-depths none
    python -m tools.bench.bench_quantized_cpu fp32=fp32 int4=int4 [int4-h8=int4h8] \\
        [--new-tokens 4] [--passes 3] [--check self,pipeline --check-tokens 12]

The first artifact is the baseline. Every artifact is loaded first (so a pass times decoding,
not loading); then each pass runs every artifact once on the same random prompt, the order
rotated pass by pass. Decode tokens/s is the decode steps' own time (prefill excluded); each
artifact's ratio is taken against the baseline in the same pass, and the median over passes is
reported beside the median tokens/s. ``--check``: on every artifact but the baseline, each mode
(``self``, ``pipeline``, ``prompt-lookup``) under ``gate="always"`` must return plain greedy's
tokens; a mismatch makes the exit status 1.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
from loopcast.ort_runtime import load


def decode_rate(stats) -> float:
    """Decode steps per second of decode time (prefill and the first token's step excluded)."""
    return stats.steps.get("decode", 0) / max(stats.step_seconds.get("decode", 0.0), 1e-9)


def parse_artifacts(items: list[str]) -> dict[str, Path]:
    out = {}
    for item in items:
        label, sep, path = item.partition("=")
        if not sep or not label or not path:
            raise SystemExit(f"error: artifact {item!r}: expected LABEL=PATH")
        out[label] = Path(path)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("artifacts", nargs="+", help="LABEL=PATH, the baseline first")
    p.add_argument("--prompt-tokens", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=4)
    p.add_argument("--passes", type=int, default=3)
    p.add_argument("--threads", type=int, default=None, help="ORT intra-op threads (default: one per core)")
    p.add_argument("--check", default="", help="speculative modes to check on the quantized artifacts")
    p.add_argument("--check-tokens", type=int, default=12)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    artifacts = parse_artifacts(args.artifacts)
    labels = list(artifacts)
    models = {}
    for label, path in artifacts.items():
        t0 = time.perf_counter()
        models[label] = load(path, threads=args.threads)
        print(f"loaded {label} ({path}) in {time.perf_counter() - t0:.1f}s", flush=True)
    vocab = models[labels[0]].config.vocab_size
    prompt = np.random.default_rng(0).integers(0, vocab, args.prompt_tokens).tolist()
    rates: dict[str, list[float]] = {label: [] for label in labels}
    ratios: dict[str, list[float]] = {label: [] for label in labels}
    tokens: dict[str, list[int]] = {}
    for i in range(args.passes):
        order = labels[i % len(labels) :] + labels[: i % len(labels)]
        this = {}
        for label in order:
            got = models[label].generate(prompt, args.new_tokens, stop_ids=())
            this[label] = decode_rate(got.stats)
            tokens[label] = got.tokens
            print(f"pass {i} {label:10s} decode {this[label]:.3f} tok/s", flush=True)
        for label in labels:
            rates[label].append(this[label])
            ratios[label].append(this[label] / this[labels[0]])
    report = {
        "load": os.getloadavg(),
        "prompt_tokens": args.prompt_tokens,
        "new_tokens": args.new_tokens,
        "passes": args.passes,
        "rows": {},
        "checks": {},
    }
    print(f"\n| artifact | decode tok/s (median of {args.passes}) | x {labels[0]} (same pass, median) |")
    print("|---|---:|---:|")
    for label in labels:
        rate, ratio = statistics.median(rates[label]), statistics.median(ratios[label])
        report["rows"][label] = {"decode_tok_s": rates[label], "ratio": ratios[label]}
        print(f"| {label} | {rate:.3f} | {ratio:.2f} |")
    bad = 0
    for label in labels[1:]:
        plain = models[label].generate(prompt, args.check_tokens, stop_ids=()).tokens
        for mode in filter(None, args.check.split(",")):
            model = models[label]
            got = model.generate(prompt, args.check_tokens, stop_ids=(), speculative=mode, gate="always")
            same = got.tokens == plain
            bad += not same
            report["checks"][f"{label} {mode}"] = {
                "identical": same,
                "exact_greedy": got.stats.exact_greedy,
                "accepted": got.stats.accepted,
                "proposed": got.stats.proposed,
            }
            print(
                f"{label} {mode}: tokens {'==' if same else '!='} plain greedy ({len(plain)} tokens; "
                f"accepted {got.stats.accepted}/{got.stats.proposed}, exact_greedy {got.stats.exact_greedy})",
                flush=True,
            )
    print(f"load average {os.getloadavg()}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
