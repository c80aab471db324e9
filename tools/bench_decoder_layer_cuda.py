"""Benchmark the fused decoder-layer kernel (loopcast_cuda_decoder_layer) against the chain of the
library's separate kernels (seven launches per layer, what the loopcast-op graphs run today), on a
whole looped stack: Ouro-1.4B shapes, 24 distinct layers applied 4 times = 96 layer applications,
each with its own KV cache, captured in one CUDA graph per variant.

    python3 tools/bench_decoder_layer_cuda.py --lib custom_ops/build/libloopcast_ops.so [--out DIR]

Prints, per dtype and row count, ms per stack for both, their ratio, the bandwidth floor of the
stack (weights + KV read once at the measured copy bandwidth), and how far the fused stack's output
is from the chain's after 96 layers (they sum in different orders, so not bit-identical).
The lm_head (M x [2048 -> 49152]) is timed too, so stack + head estimates a decode step.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench_matmul_cuda import call as matmul_call  # noqa: E402
from bench_matmul_cuda import copy_bandwidth  # noqa: E402
from cuda_timing import graph_time_us, load_library  # noqa: E402
from loopcast.bench import kernel_env  # noqa: E402
from tests.custom_ops.layer_cuda import (Shape, chain_layer_call, fused_layer_call, new_io,  # noqa: E402
                                         random_layer, rotary_tables)

OURO = dict(hidden=2048, heads=16, kv_heads=16, head_dim=128, inter=5632, layers=24, loops=4, vocab=49152)
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
# Intervals between the kernel's timeline marks (decoder_layer_cuda.cu, stamp()).
PHASES = ["pdl_wait", "norms", "qkv", "barrier1", "attention", "barrier2", "combine+barrier3", "o_proj",
          "barrier4", "norms+gate_up", "barrier5", "swiglu+down", "barrier6+mlp_out"]


def timeline(lib) -> dict:
    """Median and max over the 128 blocks of each phase of the last launch, in µs."""
    marks = (ctypes.c_ulonglong * (128 * 16))()
    code = lib.loopcast_cuda_decoder_layer_timeline(marks)
    if code:
        raise RuntimeError(lib.loopcast_cuda_error_string(code).decode())
    t = torch.tensor(list(marks), dtype=torch.float64).view(128, 16)[:, :len(PHASES) + 1]
    d = (t[:, 1:] - t[:, :-1]) / 1e3
    out = {name: {"median_us": d[:, i].median().item(), "max_us": d[:, i].max().item()}
           for i, name in enumerate(PHASES)}
    out["block_total_us"] = {"median_us": ((t[:, -1] - t[:, 0]) / 1e3).median().item(),
                             "max_us": ((t[:, -1] - t[:, 0]) / 1e3).max().item()}
    out["kernel_span_us"] = ((t[:, -1].max() - t[:, 0].min()) / 1e3).item()
    return out


def stack(lib, shape: Shape, layers, rows: int, dtype, past: int, loops: int, gen):
    """IO for every layer application, chained: branch = previous MLP output, residual = previous x1."""
    cos, sin = rotary_tables(shape.capacity, shape.head_dim, dtype)
    ios = []
    for loop in range(loops):
        for i, w in enumerate(layers):
            io = new_io(shape, rows, dtype, gen, past=past, cos=cos, sin=sin, residual=bool(ios),
                        branch_norm=bool(ios))
            if ios:
                prev = ios[-1]
                io.branch, io.residual, io.branch_norm = prev.mlp_out, prev.mid_out, layers[i - 1].mlp_norm
            ios.append(io)
    order = [w for _ in range(loops) for w in layers]
    fused = [fused_layer_call(lib, shape, w, io) for w, io in zip(order, ios)]
    chain = [chain_layer_call(lib, shape, w, io) for w, io in zip(order, ios)]
    return ios, fused, chain


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lib", required=True)
    ap.add_argument("--dtype", action="append", choices=sorted(DTYPES))
    ap.add_argument("--rows", default="1,5")
    ap.add_argument("--past", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=OURO["layers"])
    ap.add_argument("--inflight", default="2,1,4",
                    help="weight tiles the producer keeps in flight (LOOPCAST_LAYER_INFLIGHT); the first is the "
                         "headline, the others are timed too")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    lib = load_library(args.lib)
    bw = copy_bandwidth()
    shape = Shape(OURO["hidden"], OURO["heads"], OURO["kv_heads"], OURO["head_dim"], OURO["inter"], args.past + 16)
    report = {"device": torch.cuda.get_device_name(0), "copy_GBps": bw, "past": args.past, "layers": args.layers,
              "loops": OURO["loops"], "rows": {}}
    print(f"{report['device']}: copy bandwidth {bw:.0f} GB/s; {args.layers} layers x {OURO['loops']} loops, "
          f"past {args.past}")
    for name in args.dtype or ["fp16", "bf16"]:
        dtype = DTYPES[name]
        gen = torch.Generator(device="cuda").manual_seed(0)
        layers = [random_layer(shape, dtype, gen) for _ in range(args.layers)]
        head = (torch.randn(shape.hidden, OURO["vocab"], generator=gen, device="cuda") / 45).to(dtype)
        per_layer = sum(t.numel() * t.element_size() for t in (layers[0].qkv, layers[0].o, layers[0].gate_up,
                                                               layers[0].down))
        for rows in [int(r) for r in args.rows.split(",")]:
            ios, fused, chain = stack(lib, shape, layers, rows, dtype, args.past, OURO["loops"], gen)
            kv = 2 * shape.kv_heads * (args.past + rows) * shape.head_dim * dtype.itemsize
            floor_ms = len(fused) * (per_layer + kv) / bw / 1e6
            inflight = [int(v) for v in args.inflight.split(",")]
            t_inflight = {}
            for v in inflight:
                with kernel_env("LOOPCAST_LAYER_INFLIGHT", str(v)):
                    t_inflight[v] = graph_time_us(fused) * len(fused) / 1e3
                    if v == inflight[0]:
                        phases = timeline(lib)  # the stack's last layer, in the last replay
                        out_fused = ios[-1].mlp_out.float().clone()
            t_fused = t_inflight[inflight[0]]
            t_chain = graph_time_us(chain) * len(chain) / 1e3
            out_chain = ios[-1].mlp_out.float().clone()
            with kernel_env("LOOPCAST_PDL", "0"):
                t_fused_nopdl = graph_time_us(fused) * len(fused) / 1e3
            x = torch.randn(rows, shape.hidden, generator=gen, device="cuda").to(dtype)
            logits = torch.empty(rows, OURO["vocab"], dtype=dtype, device="cuda")
            t_head = graph_time_us([lambda: matmul_call(lib, x, head, logits, 0)] * 8) / 1e3
            rel = ((out_fused - out_chain).abs().max() / out_chain.abs().max()).item()
            row = {"fused_ms": t_fused, "fused_ms_by_inflight": t_inflight,  "chain_ms": t_chain, "fused_nopdl_ms": t_fused_nopdl,
                   "chain_over_fused": t_chain / t_fused, "floor_ms": floor_ms, "head_ms": t_head,
                   "step_estimate_ms": t_fused + t_head, "fused_bandwidth_pct": 100 * floor_ms / t_fused,
                   "stack_out_rel_diff": rel, "last_layer_timeline": phases}
            report["rows"][f"{name}/M={rows}"] = row
            print(f"{name} M={rows}: fused {t_fused:.3f} ms (no PDL {t_fused_nopdl:.3f}), chain {t_chain:.3f} ms, "
                  f"chain/fused {t_chain / t_fused:.2f}x; floor {floor_ms:.3f} ms ({row['fused_bandwidth_pct']:.0f}% "
                  f"of bandwidth); head {t_head:.3f} ms -> step ~{t_fused + t_head:.3f} ms; "
                  f"fused vs chain after {len(fused)} layers: max rel diff {rel:.2e}", flush=True)
            print("  fused by tiles in flight: " + ", ".join(f"{k}: {v:.3f} ms" for k, v in t_inflight.items()))
            print("  last layer, µs (median / max over blocks): " + ", ".join(
                f"{k} {v['median_us']:.1f}/{v['max_us']:.1f}" for k, v in phases.items() if isinstance(v, dict))
                + f"; kernel span {phases['kernel_span_us']:.1f}", flush=True)
            del ios, fused, chain
            torch.cuda.empty_cache()
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "bench_decoder_layer_cuda.json").write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
