"""ORT on CUDA vs the torch reference on the same GPU and dtype: greedy tokens per prompt.

For each dtype and graph variant, every benchmark prompt is decoded greedily by both; where
the tokens differ, the first divergent position and the reference's top-1/top-2 logit margin
there are reported (a small margin means a near-tie that rounding may flip). Also the largest
logit difference on the first step against the fp32 reference.

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
from loopcast.exporter.reference_generate import greedy_generate
from loopcast.ort_runtime import load

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", default="demo")
    p.add_argument("--dtypes", default="fp16,bf16")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--work-dir", type=Path, default=Path("/tmp/parity"))
    p.add_argument("--out", type=Path, required=True)
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
            del model
            args.out.write_text(json.dumps(report, indent=1) + "\n")  # after each: a cut run keeps it
        del ref


if __name__ == "__main__":
    main()
