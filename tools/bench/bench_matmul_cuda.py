"""Benchmark the CUDA BatchInvariantMatMul kernel (loopcast_cuda_matmul, called through ctypes with
torch tensors) against torch.matmul (cuBLAS) on Ouro-1.4B projection shapes.

Each timing replays a captured CUDA graph of many calls that cycle through enough distinct weight
buffers (>= 8x the 50 MB L2) that every call reads its weight from HBM. Also checks, on the real
shapes, that rows are bit-identical whatever M (M = 32 and M = 5 against M = 1 row by row).

    python3 -m tools.bench.bench_matmul_cuda --lib new=custom_ops/build/libloopcast_ops.so \
        [--lib old=...] [--out DIR]
        [--ms 1,5,16] [--variant nostage:LOOPCAST_SWIGLU_STAGE=0]

The calls of one graph run back to back, as a decode step's kernels do, so a library that
launches with programmatic dependent launch (PDL) overlaps each call's ramp-up with the previous
call's tail. ``--variant TAG:VAR=VALUE`` also times every library with a launch switch changed
(column ``NAME-TAG``): ``nopdl:LOOPCAST_PDL=0`` is the kernel on its own, ``nostage:LOOPCAST_SWIGLU_STAGE=0``
the SwiGLU down projection computing SwiGLU per chunk instead of staging it once per warp.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os

import torch
from loopcast.bench.profile import kernel_env

from tools.bench.cuda_timing import graph_time_us, load_library

# (K, N, swiglu): the last is the down projection as the graphs run it, SwiGLU applied to A = [gate | up].
SHAPES = [
    (2048, 6144, False),
    (2048, 2048, False),
    (2048, 11264, False),
    (5632, 2048, False),
    (5632, 2048, True),
]
MS = [1, 2, 5, 8, 16, 32]
CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
POOL_BYTES = 512 << 20


def call(lib, A, B, Y, trans_b: int, swiglu: bool = False) -> None:
    """Y = A·B, or SwiGLU(A)·B with A = [gate | up] of width 2K."""
    M, K = A.shape[0], A.shape[1] // (2 if swiglu else 1)
    N = Y.shape[1]
    stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
    entry = lib.loopcast_cuda_swiglu_matmul if swiglu else lib.loopcast_cuda_matmul
    code = entry(
        CODES[A.dtype],
        ctypes.c_void_p(A.data_ptr()),
        ctypes.c_void_p(B.data_ptr()),
        ctypes.c_void_p(Y.data_ptr()),
        ctypes.c_int64(M),
        ctypes.c_int64(K),
        ctypes.c_int64(N),
        ctypes.c_int(trans_b),
        stream,
    )
    if code:
        raise RuntimeError(lib.loopcast_cuda_error_string(code).decode())


def parse_variant(text: str) -> tuple[str, str, str]:
    tag, _, assignment = text.partition(":")
    var, _, value = assignment.partition("=")
    if not tag or not var or not value:
        raise argparse.ArgumentTypeError(f"wants TAG:VAR=VALUE, got {text!r}")
    return tag, var, value


def copy_bandwidth() -> float:
    x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        y.copy_(x)
    end.record()
    end.synchronize()
    return 2 * x.numel() * 10 / (start.elapsed_time(end) * 1e-3) / 1e9


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lib", action="append", required=True, help="name=path")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--calls", type=int, default=120)
    ap.add_argument("--dtypes", default="float16,bfloat16")
    ap.add_argument("--ms", default=",".join(map(str, MS)), help="row counts to time (comma-separated)")
    ap.add_argument(
        "--variant",
        action="append",
        default=[],
        type=parse_variant,
        help="TAG:VAR=VALUE: also time each library with that launch switch (repeatable)",
    )
    args = ap.parse_args()
    libs = {kv.split("=", 1)[0]: load_library(kv.split("=", 1)[1]) for kv in args.lib}
    # (column, library, switch set during capture)
    columns = [(name, lib, (None, None)) for name, lib in libs.items()]
    for tag, var, value in args.variant:
        columns += [(f"{name}-{tag}", lib, (var, value)) for name, lib in libs.items()]
    torch.manual_seed(0)
    bw = copy_bandwidth()
    print(f"device: {torch.cuda.get_device_name()}  copy bandwidth {bw:.0f} GB/s", flush=True)
    results = {"device": torch.cuda.get_device_name(), "copy_gbps": bw, "rows": [], "invariance": []}
    for dname in args.dtypes.split(","):
        dtype = getattr(torch, dname)
        pool = torch.randn(POOL_BYTES // 2, dtype=dtype, device="cuda") * 0.02
        for K, N, sw in SHAPES:
            for tb in (0, 1):
                wn = K * N
                nbuf = max(2, pool.numel() // wn)
                Ws = [pool[i * wn : (i + 1) * wn].view((N, K) if tb else (K, N)) for i in range(nbuf)]
                A = torch.randn(32, 2 * K if sw else K, dtype=dtype, device="cuda")
                # bit identity on the real shape, for every library (M = 32 and M = 5 take other
                # kernel variants than M = 1)
                for name, lib in libs.items():
                    Y32 = torch.empty(32, N, dtype=dtype, device="cuda")
                    call(lib, A, Ws[0], Y32, tb, sw)
                    Y5 = torch.empty(5, N, dtype=dtype, device="cuda")
                    call(lib, A[:5], Ws[0], Y5, tb, sw)
                    ones = torch.empty(32, N, dtype=dtype, device="cuda")
                    for i in range(32):
                        call(lib, A[i : i + 1], Ws[0], ones[i : i + 1], tb, sw)
                    a = torch.nn.functional.silu(A[:, :K].float()) * A[:, K:].float() if sw else A.float()
                    ref = a @ (Ws[0].float().t() if tb else Ws[0].float())
                    err = ((Y32.float() - ref).abs().max() / ref.abs().max()).item()
                    ok = bool(torch.equal(Y32, ones) and torch.equal(Y5, ones[:5]))
                    results["invariance"].append(
                        dict(
                            lib=name, dtype=dname, K=K, N=N, trans_b=tb, swiglu=sw, identical=ok, rel_err=err
                        )
                    )
                    if not ok or err > 2e-2:
                        print(
                            f"!! {name} {dname} [{K},{N}] tb={tb} swiglu={sw}: "
                            f"identical={ok} rel_err={err:.2e}",
                            flush=True,
                        )
                for M in (int(m) for m in args.ms.split(",")):
                    Am = A[:M]
                    Y = torch.empty(M, N, dtype=dtype, device="cuda")
                    ncalls = max(args.calls, nbuf)
                    row = dict(
                        dtype=dname, K=K, N=N, trans_b=tb, swiglu=sw, M=M, bytes=wn * pool.element_size()
                    )
                    for name, lib, switch in columns:
                        fns = [
                            (lambda W=Ws[i % nbuf], lib=lib: call(lib, Am, W, Y, tb, sw))
                            for i in range(ncalls)
                        ]
                        try:
                            with kernel_env(*switch) if switch[0] else contextlib.nullcontext():
                                row[name] = graph_time_us(fns)
                        except RuntimeError as e:  # keep going: report the failure in the table
                            print(f"!! {name}: {e}", flush=True)
                            row[name] = float("nan")
                    Ac = Am[:, :K]  # cuBLAS: the product alone (no SwiGLU)
                    if tb:
                        fns = [(lambda W=Ws[i % nbuf]: torch.matmul(Ac, W.t(), out=Y)) for i in range(ncalls)]
                    else:
                        fns = [(lambda W=Ws[i % nbuf]: torch.matmul(Ac, W, out=Y)) for i in range(ncalls)]
                    row["cublas"] = graph_time_us(fns)
                    results["rows"].append(row)
                    cells = "  ".join(
                        f"{k} {row[k]:6.1f}us {row['bytes'] / row[k] / 1e3 / bw * 100:3.0f}%"
                        for k in [*(c[0] for c in columns), "cublas"]
                    )
                    print(
                        f"{dname:8s} [{K:5d},{N:5d}]{' swiglu' if sw else '       '} "
                        f"tb={tb} M={M:2d}  {cells}",
                        flush=True,
                    )
        del pool
        torch.cuda.empty_cache()
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "bench_matmul_cuda.json"), "w") as f:
        json.dump(results, f, indent=1)
    bad = [r for r in results["invariance"] if not r["identical"]]
    print(
        f"invariance: {len(results['invariance']) - len(bad)}/{len(results['invariance'])} identical",
        flush=True,
    )


if __name__ == "__main__":
    main()
