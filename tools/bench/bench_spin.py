"""Spinning against sleeping intra-op threads (ort_runtime/loading/thread_pool.py), one sequence.

    python -m tools.bench.bench_spin ARTIFACT [--modes none,prompt-lookup,self,pipeline]
        [--rounds 2] [--repeats 3] [--new-tokens 128]

Each round runs a child process with LOOPCAST_SPIN=1 and one with LOOPCAST_SPIN=0, in turn;
each child generates the edit prompt (tools/bench/bench_vs_genai.py) ``--repeats`` times per
mode (greedy; speculative modes with ``gate="always"``, so that every mode runs its own
graphs) and reports the median seconds per generation. Prints each mode's seconds per setting
and the ratio sleeping / spinning (above 1: spinning is faster); tokens are checked equal.
The batching engine's side is the load generator's (tools/bench/loadgen.py, with LOOPCAST_SPIN).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

_CHILD = "--child"


def child(path: str, modes: list[str], repeats: int, new_tokens: int) -> None:
    from loopcast.ort_runtime import load

    from tools.bench.bench_vs_genai import PROMPTS

    model = load(path)
    if model.tokenizer is not None:
        ids = model.encode(PROMPTS["edit"])
    else:  # a random checkpoint without a tokenizer: a repeating id pattern
        ids = [(7 * i) % 50 + 1 for i in range(24)] * 2
    seconds: dict[str, list[float]] = {}
    tokens: dict[str, list[int]] = {}
    for _ in range(repeats):
        for mode in modes:
            gate = "auto" if mode == "none" else "always"
            t0 = time.perf_counter()
            tokens[mode] = list(model.stream_ids(ids, new_tokens, speculative=mode, gate=gate))
            seconds.setdefault(mode, []).append(time.perf_counter() - t0)
    print(json.dumps({"seconds": {m: statistics.median(s) for m, s in seconds.items()}, "tokens": tokens}))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("artifact")
    p.add_argument("--modes", default="none,prompt-lookup,self,pipeline")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument(_CHILD, action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    modes = args.modes.split(",")
    if args.child:
        child(args.artifact, modes, args.repeats, args.new_tokens)
        return 0
    runs: dict[str, list[dict]] = {"1": [], "0": []}
    for _ in range(args.rounds):
        for spin in ("1", "0"):
            cmd = [
                sys.executable,
                "-m",
                "tools.bench.bench_spin",
                args.artifact,
                "--modes",
                args.modes,
                "--repeats",
                str(args.repeats),
                "--new-tokens",
                str(args.new_tokens),
                _CHILD,
            ]
            out = subprocess.run(
                cmd, env={**os.environ, "LOOPCAST_SPIN": spin}, capture_output=True, text=True, check=True
            )
            runs[spin].append(json.loads(out.stdout.strip().splitlines()[-1]))
    same = all(r["tokens"] == runs["1"][0]["tokens"] for rs in runs.values() for r in rs)
    print(f"{args.artifact}: median s per {args.new_tokens}-token generation, per round (spin / sleep)")
    for mode in modes:
        spin = [r["seconds"][mode] for r in runs["1"]]
        sleep = [r["seconds"][mode] for r in runs["0"]]
        ratios = ", ".join(f"{b / a:.2f}x" for a, b in zip(spin, sleep))
        print(
            f"  {mode:<14} spin {' '.join(f'{s:.3f}' for s in spin)}  sleep "
            f"{' '.join(f'{s:.3f}' for s in sleep)}  sleep/spin {ratios}"
        )
    print(f"tokens equal across settings and rounds: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
