#!/usr/bin/env python3
"""Seeded sampling is reproducible: the same seed, mode, artifact and device give the same tokens.

    python -m tools.probes.sampling_repro ART [--device cpu|cuda] [--runs 3] [--out repro.json]

For every speculative mode the artifact offers (none, prompt-lookup, self, pipeline), a few prompts are
sampled ``--runs`` times with each of two seeds (temperature 0.8, top-p 0.95); each run is on a
fresh pooled generator. Prints one line per (mode, seed) with whether every run gave the same
tokens, and exits 1 if any did not. (Different modes draw different random numbers, so their
tokens differ from each other; their *distribution* is plain sampling's, which
tests/ort_runtime/test_sampled_decoding.py checks statistically.)
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys

PROMPTS = ["def fibonacci(n):\n", "class Stack:\n    def __init__(self):\n", "import os\nimport sys\n"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("artifact")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    from loopcast.ort_runtime import load
    from loopcast.ort_runtime.decoding.sampling import SamplingParams

    model = load(args.artifact, args.device)
    modes = (
        ["none", "prompt-lookup"]
        + (["self"] if model.loaded.has("draft") else [])
        + (["pipeline"] if model.loaded.has("cycle") else [])
    )
    rows, ok = [], True
    for mode in modes:
        for seed in (0, 1234):
            params = SamplingParams(temperature=0.8, top_p=0.95, seed=seed)
            digests = []
            for _ in range(args.runs):
                tokens = [
                    model.generate(p, args.tokens, sampling=params, speculative=mode).tokens for p in PROMPTS
                ]
                digests.append(hashlib.sha256(json.dumps(tokens).encode()).hexdigest()[:16])
            same = len(set(digests)) == 1
            ok &= same
            rows.append(
                {"mode": mode, "seed": seed, "runs": args.runs, "identical": same, "digests": digests}
            )
            print(
                f"{args.device} {mode:<14} seed {seed:<5} {args.runs} runs x {len(PROMPTS)} prompts: "
                f"{'identical' if same else 'DIFFER'} ({digests[0]})"
            )
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"artifact": str(args.artifact), "device": args.device, "rows": rows}, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
