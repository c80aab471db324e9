"""Plain decoding of a recurrent-depth (Huginn) artifact: ms per token at r core steps.

    python -m tools.bench.bench_huginn [--preset huginn-3.5b] [--dtype bf16] [--device cuda]
        [--loops 32] [--tokens 64] [--prompt 32] [--max-length 1024] [--work DIR] [--json OUT]

Writes a random-weight checkpoint of the preset in ``--dtype`` (huginn-3.5b: 7 GiB in fp16/bf16)
and exports it into ``--work`` (kept between runs: a second run reuses both), opens it on the
device, prefills a ``--prompt``-token prompt and times ``--tokens`` greedy steps at each
``--loops`` value (after 4 warm-up steps); a step is prelude, r core_step calls and the coda
(ort_runtime/binding/recurrent_generator.py). Prints one line per r; ``--json`` writes them.

``--modes none prompt-lookup self`` adds, per r, one whole generation of ``--tokens`` tokens
per mode through the public API (``load(art).generate(..., loops=r, speculative=mode)``;
self drafts at ``--draft-loops``, default r // 4): tokens/s, acceptance, and whether the
tokens equal plain decoding's (they must: the row says so rather than assuming it).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="huginn-3.5b")
    parser.add_argument("--dtype", default="bf16", choices=["fp32", "fp16", "bf16"])
    parser.add_argument("--device", default="cuda", choices=["cpu", "cuda"])
    parser.add_argument("--loops", type=int, nargs="+", default=[32])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--max-length", type=int, default=1024)
    parser.add_argument("--work", type=Path, default=Path("/tmp/loopcast-bench-huginn"))
    parser.add_argument("--json", type=Path)
    parser.add_argument("--modes", nargs="*", default=[], choices=["none", "prompt-lookup", "self"])
    parser.add_argument("--draft-loops", type=int)
    args = parser.parse_args()

    from loopcast.exporter.checkpoint import DTYPES
    from loopcast.exporter.export import ExportOptions, export_checkpoint
    from loopcast.exporter.random_checkpoint import write_random_checkpoint
    from loopcast.ort_runtime.binding.recurrent_generator import RecurrentGenerator
    from loopcast.ort_runtime.loading.artifact import open_artifact

    from loopcast.presets import PRESETS

    config = PRESETS[args.preset]
    ckpt = args.work / f"{args.preset}-{args.dtype}-ckpt"
    art = args.work / f"{args.preset}-{args.dtype}-{args.max_length}"
    if not (ckpt / "config.json").exists():
        t = time.perf_counter()
        write_random_checkpoint(config, ckpt, seed=0, dtype=DTYPES[args.dtype], max_shard_bytes=2**31)
        print(f"checkpoint {ckpt} in {time.perf_counter() - t:.0f} s", flush=True)
    if not (art / "manifest.json").exists():
        t = time.perf_counter()
        export_checkpoint(ckpt, art, ExportOptions(dtype=args.dtype, max_length=args.max_length))
        print(f"artifact {art} in {time.perf_counter() - t:.0f} s", flush=True)
    loaded = open_artifact(art, args.device)
    prompt = [(7 * i + 3) % config.vocab_size for i in range(args.prompt)]
    rows = []
    for r in args.loops:
        g = RecurrentGenerator(loaded, loops=r, state_seed=0)
        t = time.perf_counter()
        token = int(g.step(prompt).next_ids[-1])
        prefill_ms = 1000 * (time.perf_counter() - t)
        for _ in range(4):  # warm-up
            token = int(g.step([token]).next_ids[-1])
        times = []
        for _ in range(args.tokens):
            t = time.perf_counter()
            token = int(g.step([token]).next_ids[-1])
            times.append(1000 * (time.perf_counter() - t))
        row = {
            "preset": args.preset,
            "dtype": args.dtype,
            "device": args.device,
            "loops": r,
            "prefill_ms": round(prefill_ms, 2),
            "ms_per_token_median": round(statistics.median(times), 3),
            "ms_per_token_mean": round(statistics.fmean(times), 3),
            "layer_applications_per_token": config.num_prelude_layers
            + config.num_layers * r
            + config.num_coda_layers,
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
        rows += _mode_rows(art, args, prompt, r)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")


def _mode_rows(art: Path, args, prompt: list[int], r: int) -> list[dict]:
    """One generation per ``--modes`` entry at r through the API, checked against plain."""
    from loopcast.ort_runtime.api import load

    if not args.modes:
        return []
    model = load(art, args.device)
    options = dict(loops=r, state_seed=0, stop_ids=())
    model.generate(prompt, 4, **options)  # warm-up
    plain = model.generate(prompt, args.tokens, **options).tokens
    rows = []
    for mode in args.modes:
        extra = {"draft_loops": args.draft_loops} if mode == "self" and args.draft_loops else {}
        if mode == "self" and r < 2:
            continue
        result = model.generate(prompt, args.tokens, speculative=mode, **options, **extra)
        stats = result.stats
        row = {
            "preset": args.preset,
            "dtype": args.dtype,
            "device": args.device,
            "loops": r,
            "mode": mode,
            "tokens_per_second": round(stats.tokens_per_second, 1),
            "accepted": stats.accepted,
            "proposed": stats.proposed,
            "core_calls_per_token": stats.core_calls_per_token,
            "equal_to_plain": result.tokens == plain,
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


if __name__ == "__main__":
    main()
