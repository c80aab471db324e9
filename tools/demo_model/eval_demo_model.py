"""Measure the demo model card's numbers on the held-out split.

Per loop depth: held-out cross-entropy (nats/token) and bits/byte; top-1 agreement of depth d
with depth R; exit-probability means; and greedy continuations of five fixed code prompts and
of ``--heldout-prompts`` held-out ones (tools/demo_model/demo_prompts.py), each with the cycle it ends in
(``degenerate``: its second half is one cycle of <= 32 tokens repeated); and, on the bench's
edit workload (``loopcast.bench.harness.EDIT_PROMPTS``), how many tokens prompt lookup would commit
per verify round of 5 drafts (``edit_prompt_lookup``: what the copy fine-tune is for).
Writes one JSON file (``--out``) that docs/demo-model.md quotes.

    python -m tools.demo_model.eval_demo_model --checkpoint loopcast/demo_model --data .corpus --out eval.json
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from loopcast.exporter.checkpoint import load_checkpoint
from loopcast.exporter.reference import exit_probabilities
from loopcast.exporter.reference_generate import greedy_generate
from loopcast.exporter.torch_backend import load_tokenizer
from loopcast.ort_runtime.decoding.proposers import PromptLookupProposer

from tools.demo_model.demo_prompts import code_prompts, packed_documents

CODE_PROMPTS = [
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "import os\nimport sys\n\n\ndef main():\n",
    "class Stack:\n    def __init__(self):\n",
    "    def __repr__(self):\n        return ",
    "for i in range(10):\n",
]


def tail_cycle(tokens: list[int], max_period: int = 32) -> tuple[int, int]:
    """(period, covered) of the shortest cycle the continuation ends in: the smallest p <=
    max_period whose periodic suffix (tokens[i] == tokens[i - p]) covers the most tokens among
    the periods that repeat at least three times; (0, 0) when none does."""
    best = (0, 0)
    for p in range(1, min(max_period, len(tokens) // 3) + 1):
        run = 0
        while run < len(tokens) - p and tokens[-1 - run] == tokens[-1 - run - p]:
            run += 1
        covered = run + p  # the suffix tokens[-(run + p):] is p-periodic
        if covered >= 3 * p and covered > best[1]:
            best = (p, covered)
    return best


def degenerate(tokens: list[int], max_period: int = 32) -> bool:
    """The demo-model card's bar: a continuation is degenerate when its second half is one
    cycle of at most ``max_period`` tokens repeated."""
    period, covered = tail_cycle(tokens, max_period)
    return period > 0 and covered >= len(tokens) / 2


def prompt_lookup_rounds(prompt: list[int], tokens: list[int], drafts: int = 5) -> int:
    """Verify rounds that prompt lookup with ``drafts`` drafts per round needs to commit
    ``tokens`` after ``prompt`` under greedy acceptance (each round commits its accepted
    drafts plus the verifier's own token)."""
    proposer, done, rounds = PromptLookupProposer(), 0, 0
    while done < len(tokens):
        proposal = proposer.propose(prompt + tokens[:done], drafts).tokens
        accepted = 0
        while (
            accepted < len(proposal)
            and done + accepted < len(tokens)
            and proposal[accepted] == tokens[done + accepted]
        ):
            accepted += 1
        done, rounds = done + accepted + 1, rounds + 1
    return rounds


def edit_prompt_lookup(model, tokenizer, new_tokens: int = 64) -> dict:
    """Greedy continuations of the bench's edit prompts and prompt lookup's tokens per round on them."""
    from loopcast.bench.harness import EDIT_PROMPTS  # the workload `loopcast bench` reports as "edit"

    rows, total_tokens, total_rounds = [], 0, 0
    for prompt in EDIT_PROMPTS:
        ids = tokenizer.encode(prompt).ids
        res = greedy_generate(model, ids, new_tokens, stop_ids=(0,), max_length=1024)
        rounds = prompt_lookup_rounds(ids, res.tokens)
        rows.append(
            {
                "prompt": prompt.split("\n", 1)[0],
                "tokens": len(res.tokens),
                "rounds": rounds,
                "completion": tokenizer.decode(res.tokens),
            }
        )
        total_tokens, total_rounds = total_tokens + len(res.tokens), total_rounds + rounds
    return {"drafts_per_round": 5, "tokens_per_round": total_tokens / total_rounds, "prompts": rows}


@torch.no_grad()
def heldout_metrics(model, heldout: np.ndarray, seq: int, max_windows: int | None, device) -> dict:
    R = model.config.num_loops
    n_windows = (len(heldout) - 1) // seq
    if max_windows:
        n_windows = min(n_windows, max_windows)
    nats = torch.zeros(R, dtype=torch.float64)
    agree = torch.zeros(R, dtype=torch.float64)
    p_exit = torch.zeros(R, dtype=torch.float64)
    count = 0
    for w0 in range(0, n_windows, 8):
        rows = [heldout[i * seq : i * seq + seq + 1] for i in range(w0, min(n_windows, w0 + 8))]
        ids = torch.from_numpy(np.stack(rows).astype(np.int64)).to(device)
        out = model(ids[:, :-1], all_depths=True)
        final = out.logits[-1].argmax(-1)
        for r, lg in enumerate(out.logits):
            nats[r] += F.cross_entropy(lg.float().transpose(1, 2), ids[:, 1:], reduction="sum").double().cpu()
            agree[r] += (lg.argmax(-1) == final).sum().double().cpu()
        p_exit += exit_probabilities(out.gate_logits).sum(dim=(0, 1)).double().cpu()
        count += ids[:, 1:].numel()
    return {
        "tokens_scored": count,
        "ce_nats": (nats / count).tolist(),
        "agreement_with_R": (agree / count).tolist(),
        "p_exit_mean": (p_exit / count).tolist(),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", default="loopcast/demo_model")
    p.add_argument("--data", type=Path, default=Path(".corpus"))
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--max-windows", type=int, default=None, help="limit for a quick CPU run")
    p.add_argument("--new-tokens", type=int, default=96)
    p.add_argument(
        "--heldout-prompts",
        type=int,
        default=8,
        help="also continue this many held-out code prompts (tools/bench/bench_cpu.py's code workload)",
    )
    args = p.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = load_checkpoint(args.checkpoint, dtype=torch.float32).to(device)
    meta = json.loads((args.data / "corpus_meta.json").read_text())["splits"]["heldout"]
    heldout = np.load(args.data / "heldout.npy")
    t0 = time.time()
    metrics = heldout_metrics(model, heldout, args.seq, args.max_windows, device)
    tokens_per_byte = meta["n_tokens"] / meta["n_bytes"]
    metrics["bits_per_byte"] = [c / math.log(2) * tokens_per_byte for c in metrics["ce_nats"]]
    metrics["tokens_per_byte"] = tokens_per_byte
    tokenizer = load_tokenizer(Path(args.checkpoint))
    samples = []
    prompts = list(CODE_PROMPTS)
    if args.heldout_prompts:
        prompts += code_prompts(packed_documents(heldout, tokenizer), args.heldout_prompts)
    for prompt in prompts:
        ids = tokenizer.encode(prompt).ids
        res = greedy_generate(model, ids, args.new_tokens, stop_ids=(0,), max_length=1024)
        body = res.tokens[:-1] if res.tokens and res.tokens[-1] == 0 else res.tokens  # a loop, then EOT
        period, covered = tail_cycle(body)
        samples.append(
            {
                "prompt": prompt,
                "completion": tokenizer.decode(res.tokens),
                "tokens": res.tokens,
                "distinct_tokens": len(set(res.tokens)),
                "tail_cycle_period": period,
                "tail_cycle_tokens": covered,
                "degenerate": degenerate(body),
            }
        )
    metrics["samples"] = samples
    metrics["edit_prompt_lookup"] = edit_prompt_lookup(model, tokenizer, 64)
    metrics["degenerate_continuations"] = sum(s["degenerate"] for s in samples)  # of len(samples)
    metrics["device"] = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    metrics["seconds"] = round(time.time() - t0, 1)
    args.out.write_text(json.dumps(metrics, indent=1))
    print(
        json.dumps({k: v for k, v in metrics.items() if k not in ("samples", "edit_prompt_lookup")}, indent=1)
    )
    print(
        "edit workload, prompt lookup tokens per round of 5 drafts:",
        round(metrics["edit_prompt_lookup"]["tokens_per_round"], 2),
    )
    for s in samples:
        print(
            "----",
            repr(s["prompt"]),
            "->",
            repr(s["completion"][:200]),
            f"(cycle {s['tail_cycle_period']} over {s['tail_cycle_tokens']} tokens"
            f"{', degenerate' if s['degenerate'] else ''})",
        )


if __name__ == "__main__":
    main()
