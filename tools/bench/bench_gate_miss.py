"""Gates on a workload where drafts keep missing: speculation must cost ~nothing.

    python -m tools.bench.bench_gate_miss [--tokens 128] [--prompts 4]

Drafts are made wrong on purpose through the proposer interface (prompt lookup: an oracle
that proposes the true continuation with every token shifted; self: every self-draft token
shifted), so every round is a full rejection. Each gate is timed against plain greedy decode
in the same process, interleaved prompt by prompt, best of two passes; tokens must match.
"""

from __future__ import annotations

import argparse
import json
import time

from loopcast.exporter.demo_artifact import demo_artifact_dir
from loopcast.ort_runtime import load
from loopcast.ort_runtime.decoding.proposers import SelfDraftProposer

PROMPTS = [
    "def parse(text):\n    ",
    "class Node:\n    def __init__(self, value):\n",
    "import os\n\n\ndef walk(path):\n",
    "    for key, value in sorted(items):\n",
]


class WrongOracle:
    name = "wrong-oracle"

    def __init__(self, sequence: list[int], vocab: int) -> None:
        self.sequence, self.vocab = sequence, vocab

    def propose(self, context, k):
        return [(t + 1) % self.vocab for t in self.sequence[len(context) : len(context) + k]]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--prompts", type=int, default=4)
    args = p.parse_args()
    model = load(demo_artifact_dir())
    vocab = model.config.vocab_size
    prompts = [model.encode(t) for t in PROMPTS[: args.prompts]]
    plain_tokens = [model.generate(ids, args.tokens, stop_ids=()).tokens for ids in prompts]
    configs = [
        ("plain", "none", "none"),
        ("prompt-lookup", "cost", "wrong"),
        ("prompt-lookup", "hit-density", "wrong"),
        ("prompt-lookup", "none", "wrong"),
        ("self", "cost", "wrong"),
        ("self", "hit-density", "wrong"),
        ("self", "none", "wrong"),
    ]
    best = {c: float("inf") for c in configs}
    rounds = {c: 0 for c in configs}
    for _ in range(2):
        seconds = {c: 0.0 for c in configs}
        for ids, truth in zip(prompts, plain_tokens):
            for config in configs:
                mode, gate, _ = config
                kwargs = {}
                if mode == "prompt-lookup":
                    kwargs["proposer"] = WrongOracle(ids + truth, vocab)
                elif mode == "self":
                    kwargs["proposer"] = SelfDraftProposer(lambda i, t: (t + 1) % vocab)
                t0 = time.perf_counter()
                result = model.generate(
                    ids,
                    args.tokens,
                    stop_ids=(),
                    speculative=mode if mode != "plain" else "none",
                    gate=gate,
                    **kwargs,
                )
                seconds[config] += time.perf_counter() - t0
                assert result.tokens == truth, f"{config} diverged from plain greedy"
                rounds[config] = result.stats.rounds
        for config in configs:
            best[config] = min(best[config], seconds[config])
    total = args.tokens * len(prompts)
    plain_rate = total / best[configs[0]]
    rows = []
    print("| mode | gate | tokens/s | × plain | rounds (last prompt) |")
    print("|---|---|---:|---:|---:|")
    for config in configs:
        rate = total / best[config]
        rows.append(
            {
                "mode": config[0],
                "gate": config[1],
                "tokens_per_second": rate,
                "ratio": rate / plain_rate,
                "rounds_last_prompt": rounds[config],
            }
        )
        print(f"| {config[0]} | {config[1]} | {rate:.1f} | {rate / plain_rate:.2f} | {rounds[config]} |")
    print(json.dumps({"tokens": args.tokens, "prompts": len(prompts), "rows": rows}))


if __name__ == "__main__":
    main()
