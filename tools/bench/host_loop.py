#!/usr/bin/env python3
"""End-to-end plain greedy decoding per token, and how much of it is host work.

    python -m tools.bench.host_loop ART [--device cuda] [--prompt-len 1000] [--new-tokens 256] [--runs 3]

A random prompt of ``--prompt-len`` ids is generated ``--runs`` times (after one warm-up run);
per run: ms per token after the prompt (the generation's time less its prefill, over the tokens
after the first), the mean decode step as the generator timed it (the session call: captured
replay and sync on CUDA), and the host share = 1 - step / per-token. Medians are printed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("artifact")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--prompt-len", type=int, default=1000)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    import numpy as np
    from loopcast.ort_runtime import load

    model = load(args.artifact, args.device)
    prompt = np.random.default_rng(0).integers(3, model.config.vocab_size, args.prompt_len).tolist()
    model.generate(prompt, 16, stop_ids=())
    rows = []
    for _ in range(args.runs):
        stats = model.generate(prompt, args.new_tokens, stop_ids=()).stats
        after = stats.seconds - stats.step_seconds.get("prefill", 0.0)
        per_token = after / max(stats.new_tokens - 1, 1)
        step = stats.step_seconds["decode"] / stats.steps["decode"]
        rows.append(
            {
                "ms_per_token": 1e3 * per_token,
                "decode_step_ms": 1e3 * step,
                "host_share": 1 - step / per_token,
            }
        )
    out = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    print(
        f"{args.artifact} on {args.device}: prompt {args.prompt_len}, {args.new_tokens} new tokens, "
        f"median of {args.runs}: {out['ms_per_token']:.3f} ms per token end to end, decode step "
        f"{out['decode_step_ms']:.3f} ms, host {100 * out['host_share']:.1f}%"
    )
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "runs": rows, "median": out}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
