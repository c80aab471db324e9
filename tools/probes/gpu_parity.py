"""ORT on CUDA vs the torch reference on the same GPU and dtype: greedy tokens per prompt.

For each dtype and graph variant, every benchmark prompt is decoded greedily by both; where
the tokens differ, the first divergent position and the reference's top-1/top-2 logit margin
there are reported (a small margin means a near-tie that rounding may flip). Also the largest
logit difference on the first step against the fp32 reference. On a looped model the
batch-invariant artifact also decodes under each depth policy of ``--policies`` (static
``loops=k``, the gate at ``q`` under ``full`` or ``last-exited`` KV) against the torch reference
of the same policy (exporter/reference_depth.py).

    python -m tools.probes.gpu_parity --checkpoint demo --out parity.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from loopcast.bench.harness import BENCH_PROMPTS
from loopcast.exporter.checkpoint import load_checkpoint, resolve_checkpoint
from loopcast.exporter.export import ExportOptions, export_checkpoint
from loopcast.exporter.reference_depth import depth_generate
from loopcast.exporter.reference_generate import greedy_generate
from loopcast.ort_runtime import load
from loopcast.ort_runtime.decoding.generation_config import GenerationConfig

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", default="demo")
    p.add_argument("--dtypes", default="fp16,bf16")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--work-dir", type=Path, default=Path("/tmp/parity"))
    p.add_argument("--out", type=Path, required=True)
    p.add_argument(
        "--policies",
        default="loops=3,loops=2,q=0.3:full,q=0.3:last-exited",
        help="depth policies checked on a looped model's batch-invariant artifact (empty: none)",
    )
    args = p.parse_args()
    checkpoint = resolve_checkpoint(args.checkpoint)
    report = {}
    ref32 = load_checkpoint(checkpoint, dtype=torch.float32).cuda().eval()
    draft_depth = 1 if ref32.config.num_loops > 1 else None
    for dtype in args.dtypes.split(","):
        ref = load_checkpoint(checkpoint, dtype=DTYPES[dtype]).cuda().eval()
        for variant in ("stock", "batch-invariant"):
            art = args.work_dir / f"{dtype}-{variant}"
            export_checkpoint(
                checkpoint,
                art,
                ExportOptions(
                    dtype,
                    min(1024, ref32.config.max_position_embeddings),
                    5,
                    draft_depth,
                    variant == "batch-invariant",
                ),
                overwrite=True,
            )
            model = load(art, "cuda")
            rows, worst_first_step = [], 0.0
            for prompt in BENCH_PROMPTS:
                ids = model.encode(prompt)
                ours = model.generate(ids, args.new_tokens, stop_ids=()).tokens
                theirs = greedy_generate(
                    ref, ids, args.new_tokens, max_length=model.loaded.manifest.max_length, keep_logits=True
                )
                j = next((i for i, (a, b) in enumerate(zip(ours, theirs.tokens)) if a != b), None)
                entry = {"prompt": prompt[:40], "identical": j is None}
                if j is not None:
                    top = torch.topk(theirs.step_logits[j], 2).values
                    entry |= {"first_divergence": j, "reference_margin": float(top[0] - top[1])}
                rows.append(entry)
                gen = model.new_generator()
                gen.prefill(ids[:-1]) if len(ids) > 1 else None
                logits = torch.from_numpy(gen.run("decode", gen.n, tokens=[ids[-1]]).logits[0].copy())
                with torch.no_grad():
                    exact = ref32(torch.tensor([ids], device="cuda")).final_logits[0, -1].float().cpu()
                worst_first_step = max(worst_first_step, float((logits - exact).abs().max()))
            same = sum(r["identical"] for r in rows)
            report[f"{dtype}/{variant}"] = {
                "identical_prompts": same,
                "prompts": len(rows),
                "max_abs_logit_diff_vs_fp32_first_step": worst_first_step,
                "rows": rows,
            }
            divergences = [
                (r["first_divergence"], round(r["reference_margin"], 4)) for r in rows if not r["identical"]
            ]
            print(
                f"{dtype}/{variant}: {same}/{len(rows)} prompts identical to the torch {dtype} reference; "
                f"first-step max |logit - fp32| {worst_first_step:.4f}; divergences "
                f"{divergences}",
                flush=True,
            )
            if variant == "batch-invariant" and ref.config.num_loops > 1 and args.policies:
                report[f"{dtype}/{variant}/depth"] = depth_parity(model, ref, args)
            del model
            args.out.write_text(json.dumps(report, indent=1) + "\n")  # after each: a cut run keeps it
        del ref


def policy_config(policy: str, new_tokens: int) -> GenerationConfig:
    """``loops=k`` or ``q=Q:full|last-exited`` as a GenerationConfig."""
    name, _, value = policy.partition("=")
    if name == "loops":
        return GenerationConfig(new_tokens, loops=int(value), stop_ids=())
    q, _, kv_policy = value.partition(":")
    return GenerationConfig(new_tokens, exit_threshold=float(q), kv_policy=kv_policy or "full", stop_ids=())


def depth_parity(model, ref, args) -> dict:
    """Each depth policy's greedy tokens and exit histogram, ours against the torch reference."""
    out = {}
    for policy in args.policies.split(","):
        config = policy_config(policy, args.new_tokens)
        rows = []
        for prompt in BENCH_PROMPTS:
            ids = model.encode(prompt)
            ours = model.generate(ids, config=config)
            theirs = depth_generate(ref, ids, config, max_length=model.loaded.manifest.max_length)
            j = next((i for i, (a, b) in enumerate(zip(ours.tokens, theirs.tokens)) if a != b), None)
            same_exits = ours.stats.exit_histogram == theirs.depth_stats()["exit_histogram"]
            rows.append(
                {"prompt": prompt[:40], "identical": j is None, "first_divergence": j, "exits": same_exits}
            )
        same = sum(r["identical"] for r in rows)
        out[policy] = {"identical_prompts": same, "prompts": len(rows), "rows": rows}
        print(
            f"  {policy}: {same}/{len(rows)} prompts identical to the reference's policy; first "
            f"divergences {[r['first_divergence'] for r in rows if not r['identical']]}; exit "
            f"histograms equal on {sum(r['exits'] for r in rows)}/{len(rows)}",
            flush=True,
        )
    return out


if __name__ == "__main__":
    main()
