"""Train the demo looped model (Ouro architecture, R=4) on the packed stdlib corpus.

Objective (Ouro): at every loop exit r the next-token cross-entropy CE_r is weighted by the
exit distribution p_r that the early-exit gate produces, plus a regulariser that keeps the
distribution from collapsing onto the loops that learn fastest:

    L = mean_tokens( Σ_r p_r·CE_r + β·KL(p ‖ π) )

With a uniform prior π this is Ouro's entropy regulariser (−β·H(p) up to a constant). The
Ouro paper also studies non-uniform priors: ``--exit-prior geometric`` (π_r ∝ 2^r) or explicit
weights such as ``1,1,2,8`` lean on the last loops. The default is the uniform prior (Ouro's
objective); docs/demo-model.md records what each prior gave.

Optional, for a fine-tune: ``--unlikelihood ALPHA`` adds Welleck et al.'s sequence-level
unlikelihood term every ``--ul-every`` steps (tools/demo_model/demo_unlikelihood.py): greedy continuations
of train-split prefixes by the model itself, with every token of an n-gram the continuation
already produced made less likely. It is what stops the greedy loops (docs/demo-model.md).
``--copy-frac F`` replaces that fraction of each batch's rows by edit pairs (a block of code,
then its lightly edited copy: tools/demo_model/demo_copy.py), which teaches the copying prompt lookup
lives on (docs/demo-model.md, "a copy fine-tune").

Resumable: the state (model, optimiser, step, data RNG) is saved under --run-dir every
--save-every steps and when --time-budget-s runs out; running the same command again resumes.
The best held-out checkpoint (by depth-R loss), or with ``--export final`` the last one, is
exported in Hugging Face format (fp16).

    python -m tools.demo_model.train_demo_model --data .corpus --run-dir runs/demo --out loopcast/demo_model
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from loopcast.exporter.checkpoint import load_checkpoint, save_checkpoint
from loopcast.exporter.reference import LoopedLM, exit_probabilities, init_weights

from loopcast.config import ModelConfig
from tools.demo_model.demo_copy import copy_rows
from tools.demo_model.demo_unlikelihood import (
    greedy_continue,
    repeated_ngram_mask,
    statement_heads,
    unlikelihood_loss,
)
from tools.demo_model.eval_demo_model import degenerate
from tools.demo_model.pack_demo_corpus import load_tokenizer

DEMO_CONFIG = ModelConfig(
    model_type="ouro",
    vocab_size=4096,
    hidden_size=384,
    intermediate_size=1024,
    num_layers=4,
    num_heads=6,
    num_kv_heads=6,
    head_dim=64,
    num_loops=4,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    max_position_embeddings=1024,
    tie_word_embeddings=False,
    bos_token_id=None,
    eos_token_id=0,
)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", type=Path, default=Path(".corpus"), help="dir with train.npy / heldout.npy")
    p.add_argument("--run-dir", type=Path, default=Path("runs/demo"), help="resumable state + logs")
    p.add_argument("--out", type=Path, default=None, help="export the best checkpoint here (HF, fp16)")
    p.add_argument("--tokenizer-dir", type=Path, default=Path("loopcast/demo_model"))
    p.add_argument("--layers", type=int, default=DEMO_CONFIG.num_layers, help="core layers per loop")
    p.add_argument("--hidden", type=int, default=DEMO_CONFIG.hidden_size)
    p.add_argument("--intermediate", type=int, default=DEMO_CONFIG.intermediate_size)
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=200)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--beta", type=float, default=0.5, help="regulariser weight")
    p.add_argument(
        "--exit-prior",
        default="uniform",
        help="prior of the exit-distribution regulariser: uniform (Ouro's entropy term), "
        "geometric (∝ 2^r) or R comma-separated weights, e.g. 1,1,2,4",
    )
    p.add_argument(
        "--init-from",
        type=Path,
        default=None,
        help="start from this HF checkpoint's weights (fine-tuning); ignored when resuming",
    )
    p.add_argument(
        "--dropout",
        type=float,
        default=0.0,
        help="residual dropout on every branch (attention, MLP) while training only",
    )
    p.add_argument(
        "--unlikelihood",
        type=float,
        default=0.0,
        metavar="ALPHA",
        help="weight of the sequence-level unlikelihood term (tools/demo_model/demo_unlikelihood.py)",
    )
    p.add_argument("--ul-every", type=int, default=2, help="add the unlikelihood term every K steps")
    p.add_argument("--ul-batch", type=int, default=32, help="prefixes continued per unlikelihood step")
    p.add_argument("--ul-prefix", type=int, default=48, help="prefix tokens (from the train split)")
    p.add_argument("--ul-new", type=int, default=96, help="greedy tokens generated per prefix")
    p.add_argument(
        "--ul-heads",
        type=float,
        default=0.0,
        metavar="F",
        help="cut this fraction of the unlikelihood prefixes at def/class lines",
    )
    p.add_argument("--ul-ngram", type=int, default=4, help="n of the repeated n-grams penalised")
    p.add_argument(
        "--ul-depth-weights",
        choices=("prior", "uniform"),
        default="prior",
        help="weights of the per-depth unlikelihood terms: the exit prior, or equal",
    )
    p.add_argument(
        "--copy-frac",
        type=float,
        default=0.0,
        metavar="F",
        help="replace this fraction of each batch's rows by edit pairs (tools/demo_model/demo_copy.py)",
    )
    p.add_argument(
        "--export",
        choices=("best", "final"),
        default="best",
        help="export the best held-out (depth-R loss) weights or the final ones",
    )
    p.add_argument("--min-lr-frac", type=float, default=0.1, help="cosine floor as a fraction of --lr")
    p.add_argument("--eval-every", type=int, default=250)
    p.add_argument("--eval-windows", type=int, default=64)
    p.add_argument("--save-every", type=int, default=500)
    p.add_argument("--time-budget-s", type=float, default=480.0, help="stop (resumably) after this")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--compile", action="store_true", help="torch.compile the model (GPU)")
    p.add_argument("--smoke", action="store_true", help="tiny CPU run: few steps, small batch")
    return p.parse_args()


def exit_prior(kind: str, num_loops: int, device) -> torch.Tensor:
    if kind == "uniform":
        weights = torch.ones(num_loops)
    elif kind == "geometric":
        weights = 2.0 ** torch.arange(num_loops)
    else:
        weights = torch.tensor([float(w) for w in kind.split(",")])
        if len(weights) != num_loops or bool((weights <= 0).any()):
            raise SystemExit(f"--exit-prior needs {num_loops} positive weights, got {kind!r}")
    return (weights / weights.sum()).to(device)


def ouro_loss(model: LoopedLM, ids: torch.Tensor, beta: float, prior: torch.Tensor):
    """Return (objective, per-depth CE [R], mean exit distribution [R])."""
    out = model(ids[:, :-1], all_depths=True)
    target = ids[:, 1:]
    ce = torch.stack(
        [F.cross_entropy(lg.float().transpose(1, 2), target, reduction="none") for lg in out.logits], dim=-1
    )  # [B, S, R]
    probs = exit_probabilities(out.gate_logits)  # [B, S, R]
    kl = (probs * (torch.log(probs.clamp_min(1e-9)) - torch.log(prior))).sum(-1)
    objective = (probs * ce).sum(-1).mean() + beta * kl.mean()
    return objective, ce.mean(dim=(0, 1)).detach(), probs.mean(dim=(0, 1)).detach()


@torch.no_grad()
def evaluate(model: LoopedLM, heldout: np.ndarray, seq: int, windows: int, device) -> list[float]:
    """Mean next-token CE (nats) per depth over fixed, evenly spaced held-out windows."""
    model.eval()
    starts = np.linspace(0, len(heldout) - seq - 2, windows).astype(np.int64)
    totals = torch.zeros(model.config.num_loops, device=device)
    for chunk in np.array_split(starts, max(1, windows // 16)):
        ids = torch.from_numpy(np.stack([heldout[s : s + seq + 1] for s in chunk]).astype(np.int64)).to(
            device
        )
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            out = model(ids[:, :-1], all_depths=True)
        for r, lg in enumerate(out.logits):
            totals[r] += F.cross_entropy(lg.float().transpose(1, 2), ids[:, 1:], reduction="sum")
    model.train()
    return (totals / (len(starts) * seq)).tolist()


def add_residual_dropout(model: LoopedLM, rate: float) -> None:
    """Dropout on each branch just before it joins the residual stream (the outputs of the
    sandwich norms), active in train() mode only: a regulariser of the trainer, not part of the
    architecture, so the exported checkpoint is unchanged in form."""
    if rate <= 0.0:
        return
    for layer in model.model.layers:
        if not layer.sandwich:
            raise SystemExit("--dropout hooks the sandwich norms; this config has none")
        for norm in (layer.input_layernorm_2, layer.post_attention_layernorm_2):
            norm.register_forward_hook(lambda mod, inp, out: F.dropout(out, rate, mod.training))


def unlikelihood_step(model, forward, train: np.ndarray, heads: np.ndarray, rng, args, weights, device):
    """Greedy continuations of fresh train-split prefixes and their unlikelihood loss, plus
    (repeated-token fraction, degenerate fraction) of those continuations for the log. The
    first ``--ul-heads`` of the prefixes start at a def/class line (``heads``)."""
    starts = rng.integers(0, len(train) - args.ul_prefix, size=args.ul_batch)
    n_heads = round(args.ul_heads * args.ul_batch)
    if n_heads:
        starts[:n_heads] = rng.choice(heads, size=n_heads)
    prefix = torch.from_numpy(np.stack([train[s : s + args.ul_prefix] for s in starts]).astype(np.int64))
    seq = greedy_continue(model, prefix.to(device), args.ul_new)
    cont = seq[:, args.ul_prefix :].cpu().numpy()
    mask = repeated_ngram_mask(cont, args.ul_ngram)
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
        ul, per_depth = unlikelihood_loss(
            forward, seq, args.ul_prefix, torch.from_numpy(mask).to(device), weights
        )
    stats = f"rep {mask.mean():.3f} degenerate {np.mean([degenerate(row.tolist()) for row in cont]):.2f}"
    return ul, per_depth, stats


def lr_at(step: int, args) -> float:
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    progress = (step - args.warmup) / max(1, args.steps - args.warmup)
    floor = args.min_lr_frac
    return args.lr * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def main() -> None:
    args = parse_args()
    if args.smoke:
        args.steps, args.batch, args.seq, args.eval_every, args.eval_windows = 20, 4, 128, 10, 8
        args.save_every, args.warmup = 10, 5
        args.ul_batch, args.ul_prefix, args.ul_new = 2, 8, 16
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(args.seed)
    train = np.load(args.data / "train.npy", mmap_mode="r")
    heldout = np.load(args.data / "heldout.npy", mmap_mode="r")
    args.run_dir.mkdir(parents=True, exist_ok=True)
    state_path = args.run_dir / "state.pt"
    log_path = args.run_dir / "log.jsonl"

    if not 0.0 <= args.copy_frac <= 1.0:
        raise SystemExit(f"--copy-frac must be in [0, 1], got {args.copy_frac}")
    if not 0.0 <= args.ul_heads <= 1.0:
        raise SystemExit(f"--ul-heads must be in [0, 1], got {args.ul_heads}")
    tokenizer = (
        load_tokenizer(args.tokenizer_dir / "tokenizer.json") if args.copy_frac or args.ul_heads else None
    )
    config = model_config(args)
    model = LoopedLM(config)
    init_weights(model, seed=args.seed)
    if args.init_from is not None and not state_path.is_file():
        # Fine-tuning: the starting weights come from a finished run's exported checkpoint.
        model.load_state_dict(load_checkpoint(args.init_from, dtype=torch.float32).state_dict())
        print(f"initialised from {args.init_from}", flush=True)
    add_residual_dropout(model, args.dropout)
    model.to(device)
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.95),
        fused=device.type == "cuda",
    )
    step, best, rng = 0, float("inf"), np.random.default_rng(args.seed)
    if state_path.is_file():
        state = torch.load(state_path, map_location=device, weights_only=False)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        step, best = state["step"], state["best"]
        rng.bit_generator.state = state["rng"]
        print(f"resumed at step {step} (best held-out depth-R loss {best:.4f})", flush=True)
    forward = torch.compile(model) if args.compile else model
    prior = exit_prior(args.exit_prior, config.num_loops, device)

    def save_state() -> None:
        tmp = state_path.with_suffix(".tmp")
        torch.save(
            {
                "model": model.state_dict(),
                "opt": opt.state_dict(),
                "step": step,
                "best": best,
                "rng": rng.bit_generator.state,
                "args": vars(args) | {"data": str(args.data)},
            },
            tmp,
        )
        tmp.replace(state_path)

    heads = (
        statement_heads(train[: len(train) - args.ul_prefix], tokenizer)
        if args.ul_heads
        else np.zeros(0, np.int64)
    )
    if args.ul_heads and not len(heads):
        raise SystemExit("--ul-heads: the train split has no def/class line to cut a prefix at")
    params = sum(p.numel() for p in model.parameters())
    print(f"params {params:,}  device {device}  train tokens {len(train):,}", flush=True)
    ul_weights = prior if args.ul_depth_weights == "prior" else torch.full_like(prior, 1 / len(prior))
    ul_note = ""
    t0 = time.time()
    model.train()
    while step < args.steps:
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args)
        starts = rng.integers(0, len(train) - args.seq - 1, size=args.batch)
        rows = np.stack([train[s : s + args.seq + 1] for s in starts]).astype(np.int64)
        n_copy = round(args.copy_frac * args.batch)
        if n_copy:  # the batch's first rows become edit pairs: the copying a code edit needs
            rows[:n_copy] = copy_rows(train, tokenizer, rng, n_copy, args.seq + 1)
        ids = torch.from_numpy(rows).to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            objective, ce, probs = ouro_loss(forward, ids, args.beta, prior)
        if args.unlikelihood > 0 and step % args.ul_every == 0:
            ul, ul_depth, ul_stats = unlikelihood_step(
                model, forward, train, heads, rng, args, ul_weights, device
            )
            objective = objective + args.unlikelihood * ul
            ul_note = f" ul/depth {[round(u, 3) for u in ul_depth.tolist()]} {ul_stats}"
        opt.zero_grad(set_to_none=True)
        objective.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        if step % 50 == 0 or step == 1:
            print(
                f"step {step} obj {objective.item():.4f} ce/depth {[round(c, 3) for c in ce.tolist()]} "
                f"p_exit {[round(p, 3) for p in probs.tolist()]}{ul_note} {time.time() - t0:.0f}s",
                flush=True,
            )
        if step % args.eval_every == 0 or step == args.steps:
            losses = evaluate(model, heldout, args.seq, args.eval_windows, device)
            record = {
                "step": step,
                "elapsed_s": round(time.time() - t0, 1),
                "train_ce": ce.tolist(),
                "heldout_ce": losses,
                "p_exit": probs.tolist(),
                "lr": lr_at(step, args),
            }
            with log_path.open("a") as f:
                f.write(json.dumps(record) + "\n")
            print(f"eval step {step} heldout ce/depth {[round(x, 4) for x in losses]}", flush=True)
            if losses[-1] < best:
                best = losses[-1]
                torch.save(model.state_dict(), args.run_dir / "best.pt")
        if step % args.save_every == 0:
            save_state()
        if time.time() - t0 > args.time_budget_s:
            print(f"time budget reached at step {step}; rerun the same command to resume", flush=True)
            break
    save_state()
    if args.export == "final":
        torch.save(model.state_dict(), args.run_dir / "final.pt")
    if args.out is not None and (args.run_dir / f"{args.export}.pt").is_file():
        export_weights(args)


def model_config(args) -> ModelConfig:
    heads = args.hidden // DEMO_CONFIG.head_dim
    return DEMO_CONFIG.replace(
        num_layers=args.layers,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_heads=heads,
        num_kv_heads=heads,
    )


def export_weights(args) -> None:
    """Write the best held-out (or the final) weights as an HF checkpoint (fp16) with the tokenizer files."""
    model = LoopedLM(model_config(args))
    model.load_state_dict(torch.load(args.run_dir / f"{args.export}.pt", map_location="cpu"))
    staging = args.run_dir / "export"
    if staging.exists():
        shutil.rmtree(staging)
    save_checkpoint(model, staging, dtype=torch.float16)
    args.out.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "model.safetensors"):
        shutil.copy(staging / name, args.out / name)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        src = args.tokenizer_dir / name
        if src.is_file() and src.resolve() != (args.out / name).resolve():
            shutil.copy(src, args.out / name)
    print(f"exported the {args.export} checkpoint to {args.out}", flush=True)


if __name__ == "__main__":
    main()
