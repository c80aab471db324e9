"""Where a recurrent-depth pipeline cycle's GPU time goes, kernel by kernel, beside a plain step.

    python -m tools.bench.profile_recurrent --preset huginn-3.5b --dtype fp16 --loops 32 \
        --past 1024 --work /root/prof [--artifact DIR]

Writes a random checkpoint of the preset and exports it with ``--ops loopcast`` (or profiles
``--artifact``), fills ``past`` positions at r, then runs ``recurrent_cycle(r)`` (every row a
lane, as ``loopcast bench`` times it) and one plain step (prelude, r core_step calls, coda)
``--iters`` times each under the PyTorch profiler (CUPTI sees ONNX Runtime's kernels), eagerly
and without programmatic dependent launch, so each kernel is one record of its own time. Prints,
per call, the GPU time by kernel family and the top kernels, and the bytes the weights and the KV
read at the H200's copy bandwidth for scale; ``--json`` writes the same. Needs CUDA and torch.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

COPY_GBPS = 4000.0  # an H200's device-to-device copy bandwidth, roughly (docs/perf.md)


def _profile(run, iters: int) -> dict:
    import torch
    from loopcast.bench.profile import kernel_family
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        run()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            run()
        torch.cuda.synchronize()
    families: dict[str, float] = {}
    kernels: dict[str, list] = {}
    for event in prof.events():
        if event.device_type != torch.autograd.DeviceType.CUDA:
            continue
        family = kernel_family(event.name)
        families[family] = families.get(family, 0.0) + event.device_time
        entry = kernels.setdefault(event.name[:100], [0.0, 0])
        entry[0] += event.device_time
        entry[1] += 1
    total = sum(families.values()) / iters / 1e3
    return {
        "gpu_ms": total,
        "families_ms": {k: v / iters / 1e3 for k, v in sorted(families.items(), key=lambda kv: -kv[1])},
        "top_kernels": [
            {"name": name, "ms": t / iters / 1e3, "launches": n // iters}
            for name, (t, n) in sorted(kernels.items(), key=lambda kv: -kv[1][0])[:15]
        ],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="huginn-3.5b")
    parser.add_argument("--artifact", type=Path, default=None)
    parser.add_argument("--dtype", default="fp16", choices=["fp16", "bf16"])
    parser.add_argument("--loops", type=int, default=32)
    parser.add_argument("--past", type=int, default=1024)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--work", type=Path, default=Path("prof-work"))
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()

    import onnxruntime as ort

    ort.preload_dlls()
    from loopcast.bench.profile import pdl_off
    from loopcast.exporter.export import ExportOptions, export_checkpoint
    from loopcast.exporter.random_checkpoint import write_random_checkpoint
    from loopcast.ort_runtime.binding.recurrent_generator import RecurrentGenerator
    from loopcast.ort_runtime.loading.artifact import open_artifact

    from loopcast.presets import PRESETS

    art = args.artifact
    if art is None:
        preset = PRESETS[args.preset]
        ckpt, art = args.work / "ckpt", args.work / f"art-{args.dtype}"
        t0 = time.perf_counter()
        if not (ckpt / "config.json").exists():
            import torch

            dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[args.dtype]
            write_random_checkpoint(preset, ckpt, dtype=dtype)
        max_length = args.past + 1 + preset.num_loops
        export_checkpoint(ckpt, art, ExportOptions(args.dtype, max_length, ops="loopcast"), overwrite=True)
        print(f"checkpoint and export: {time.perf_counter() - t0:.1f} s", flush=True)
    loaded = open_artifact(art, "cuda", cuda_graphs=False)
    cfg, r = loaded.config, args.loops
    gen = RecurrentGenerator(loaded, loops=r)
    gen.step([3 + i % (cfg.vocab_size - 3) for i in range(args.past)])
    positions = [args.past - k if k < r else -1 for k in range(gen.cycle.rows)]
    zero = np.zeros(cfg.hidden_size, np.float32)

    def cycle() -> None:
        gen.cycle.run(5, r - 1, positions, zero)

    def plain() -> None:
        gen.rewind(args.past)
        gen.step([5])

    itemsize = 2
    layer = sum(int(np.prod(s)) for s in _layer_shapes(cfg).values()) * itemsize  # one layer's projections
    step = (
        cfg.num_layers * layer + 2 * cfg.hidden_size**2 * itemsize
    )  # a core step: its layers and the adapter
    head = cfg.vocab_size * cfg.hidden_size * itemsize
    kv_step = 2 * cfg.num_kv_heads * args.past * loaded.manifest.kv_head_size * itemsize  # one layer
    weights = {
        "recurrent_cycle": (cfg.num_prelude_layers + cfg.num_coda_layers) * layer + step + head,
        "plain step": (cfg.num_prelude_layers + cfg.num_coda_layers) * layer + r * step + head,
    }
    kv = (cfg.num_prelude_layers + r * cfg.num_layers + cfg.num_coda_layers) * kv_step
    report = {"artifact": str(art), "loops": r, "past": args.past, "dtype": args.dtype}
    with pdl_off():
        for name, run in (("recurrent_cycle", cycle), ("plain step", plain)):
            got = _profile(run, args.iters)
            moved = weights[name] + kv
            got["bytes_GB"] = moved / 1e9
            got["floor_ms"] = moved / (COPY_GBPS * 1e6)
            report[name] = got
            print(
                f"\n{name} (r = {r}, past {args.past}): {got['gpu_ms']:.3f} ms of GPU time; reads "
                f"{moved / 1e9:.2f} GB (weights {weights[name] / 1e9:.2f}, KV {kv / 1e9:.2f}): "
                f"{got['floor_ms']:.3f} ms at {COPY_GBPS / 1e3:.1f} TB/s"
            )
            for family, ms in got["families_ms"].items():
                print(f"  {family:<24} {ms:8.3f} ms")
            for k in got["top_kernels"]:
                print(f"    {k['ms']:8.3f} ms  x{k['launches']:<4} {k['name']}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))


def _layer_shapes(cfg) -> dict[str, tuple[int, int]]:
    H, D = cfg.hidden_size, cfg.head_dim
    q, kv = cfg.num_heads * D, cfg.num_kv_heads * D
    return {
        "qkv": (H, q + 2 * kv),
        "o": (q, H),
        "gate_up": (H, 2 * cfg.intermediate_size),
        "down": (cfg.intermediate_size, H),
    }


if __name__ == "__main__":
    main()
