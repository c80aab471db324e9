"""Benchmark the CUDA BatchInvariantMatMulNBits kernel (loopcast_cuda_matmul_nbits, through ctypes
with torch tensors) against the fp16 BatchInvariantMatMul on Ouro-1.4B projection shapes, with the
bandwidth floor of each (bytes read / the device's copy bandwidth).

    python3 -m tools.bench.bench_matmul_nbits_cuda --lib custom_ops/build/libloopcast_ops.so \
        [--bits 4] [--block 32] [--asymmetric] [--ms 1,5,16] [--dtype float16] [--out DIR]

fp16 / bf16 activations take the tensor-core kernel; the CUDA-core kernel (LOOPCAST_NBITS_MMA=0)
is timed in the same run as the baseline (column "core us").

Each timing replays a captured CUDA graph of many calls cycling through enough distinct weight
buffers (>= 512 MB, 10x the L2) that every call reads its weights from HBM, back to back as a
decode step's kernels run. Bytes per call: codes (K·N·bits/8) + fp32 scales (+ zero points) for
the quantized kernel, 2·K·N for fp16. Also checks on the real shapes that every row of an M-row
call is the M = 1 row bit for bit. Nothing from loopcast is imported (tools/bench/cuda_timing.py only).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
from functools import partial
from pathlib import Path

import torch

from tools.bench.cuda_timing import graph_time_us, load_library

# (label, K, N, swiglu): qkv [2048 -> 6144], gate_up [2048 -> 5632·2], down [5632 -> 2048]
# (also reading [gate | up]), o_proj [2048 -> 2048]
SHAPES = [
    ("qkv", 2048, 6144, False),
    ("gate_up", 2048, 11264, False),
    ("down+swiglu", 5632, 2048, True),
    ("down", 5632, 2048, False),
    ("o_proj", 2048, 2048, False),
]
CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
POOL_BYTES = 512 << 20


def _stream() -> ctypes.c_void_p:
    return ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)


def _raise(lib, code: int) -> None:
    if code:
        raise RuntimeError(lib.loopcast_cuda_error_string(code).decode())


def nbits_call(lib, A, w: dict, Y, K: int, bits: int, block: int, swiglu: bool) -> None:
    zp = w.get("zero_points")
    _raise(
        lib,
        lib.loopcast_cuda_matmul_nbits(
            CODES[A.dtype],
            ctypes.c_void_p(A.data_ptr()),
            ctypes.c_void_p(w["B"].data_ptr()),
            ctypes.c_void_p(w["scales"].data_ptr()),
            ctypes.c_void_p(zp.data_ptr() if zp is not None else 0),
            ctypes.c_void_p(Y.data_ptr()),
            ctypes.c_int64(A.shape[0]),
            ctypes.c_int64(K),
            ctypes.c_int64(Y.shape[1]),
            bits,
            block,
            1 if swiglu else 0,
            _stream(),
        ),
    )


def dense_call(lib, A, B, Y, K: int, swiglu: bool) -> None:
    """The fp16 BatchInvariantMatMul on B [K, N] (the graphs' weight_T layout)."""
    entry = lib.loopcast_cuda_swiglu_matmul if swiglu else lib.loopcast_cuda_matmul
    _raise(
        lib,
        entry(
            CODES[A.dtype],
            ctypes.c_void_p(A.data_ptr()),
            ctypes.c_void_p(B.data_ptr()),
            ctypes.c_void_p(Y.data_ptr()),
            ctypes.c_int64(A.shape[0]),
            ctypes.c_int64(K),
            ctypes.c_int64(Y.shape[1]),
            ctypes.c_int(0),
            _stream(),
        ),
    )


def _cuda_core_time(calls) -> float:
    """The same calls through the CUDA-core kernel: LOOPCAST_NBITS_MMA=0 while they are captured."""
    before = os.environ.get("LOOPCAST_NBITS_MMA")
    os.environ["LOOPCAST_NBITS_MMA"] = "0"
    try:
        return graph_time_us(calls)
    finally:
        if before is None:
            del os.environ["LOOPCAST_NBITS_MMA"]
        else:
            os.environ["LOOPCAST_NBITS_MMA"] = before


def copy_bandwidth() -> float:
    x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        y.copy_(x)
    end.record()
    end.synchronize()
    return 2 * x.numel() * 10 / (start.elapsed_time(end) * 1e-3) / 1e9


def quantized_set(K: int, N: int, bits: int, block: int, asymmetric: bool) -> tuple[dict, int]:
    """Random codes, scales (and zero points) of one [N, K] weight on the device; its bytes."""
    nb = -(-K // block)
    w = {
        "B": torch.randint(0, 256, (N, nb, block * bits // 8), dtype=torch.uint8, device="cuda"),
        "scales": torch.rand(N * nb, device="cuda") * 0.02 + 0.002,
    }
    if asymmetric:
        w["zero_points"] = torch.randint(
            0, 256, (N * (-(-nb * bits // 8)),), dtype=torch.uint8, device="cuda"
        )
    return w, sum(t.numel() * t.element_size() for t in w.values())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lib", required=True, help="path to libloopcast_ops.so (with CUDA kernels)")
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--block", type=int, default=32)
    ap.add_argument("--asymmetric", action="store_true")
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("--ms", default="1,5,16")
    ap.add_argument("--calls", type=int, default=120)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    lib = load_library(args.lib)
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    bw = copy_bandwidth()
    print(f"device: {torch.cuda.get_device_name()}  copy bandwidth {bw:.0f} GB/s", flush=True)
    zp = "asym" if args.asymmetric else "sym"
    print(f"int{args.bits} block {args.block} {zp} vs {args.dtype} BatchInvariantMatMul; µs per call")
    print(
        f"{'shape':<12} {'M':>3} {'nbits us':>9} {'GB/s':>6} {'floor us':>8} "
        f"{'core us':>8} {'dense us':>9} {'GB/s':>6} {'floor us':>8} {'nbits/dense':>11} {'rows':>6}"
    )
    results = {"device": torch.cuda.get_device_name(), "copy_gbps": bw, "rows": []}
    for label, K, N, sw in SHAPES:
        first, qbytes = quantized_set(K, N, args.bits, args.block, args.asymmetric)
        qsets = [first] + [
            quantized_set(K, N, args.bits, args.block, args.asymmetric)[0]
            for _ in range(max(1, POOL_BYTES // qbytes) - 1)
        ]
        dbytes = 2 * K * N
        dense = [
            torch.randn(K, N, dtype=dtype, device="cuda") * 0.02 for _ in range(max(2, POOL_BYTES // dbytes))
        ]
        A = torch.randn(16, 2 * K if sw else K, dtype=dtype, device="cuda")
        # bit identity on the real shape: each row of the 16- and 5-row calls is the row alone
        Y16, Y5, ones = (torch.empty(m, N, dtype=dtype, device="cuda") for m in (16, 5, 16))
        nbits_call(lib, A, qsets[0], Y16, K, args.bits, args.block, sw)
        nbits_call(lib, A[:5], qsets[0], Y5, K, args.bits, args.block, sw)
        for i in range(16):
            nbits_call(lib, A[i : i + 1], qsets[0], ones[i : i + 1], K, args.bits, args.block, sw)
        torch.cuda.synchronize()
        identical = bool(torch.equal(Y16, ones) and torch.equal(Y5, ones[:5]))
        for M in (int(m) for m in args.ms.split(",")):
            Am, Y = A[:M], torch.empty(M, N, dtype=dtype, device="cuda")
            n_q, n_d = max(args.calls, len(qsets)), max(args.calls, len(dense))
            t_q = graph_time_us(
                [
                    partial(nbits_call, lib, Am, qsets[i % len(qsets)], Y, K, args.bits, args.block, sw)
                    for i in range(n_q)
                ]
            )
            t_c = _cuda_core_time(
                [
                    partial(nbits_call, lib, Am, qsets[i % len(qsets)], Y, K, args.bits, args.block, sw)
                    for i in range(n_q)
                ]
            )
            t_d = graph_time_us(
                [partial(dense_call, lib, Am, dense[i % len(dense)], Y, K, sw) for i in range(n_d)]
            )
            floor_q, floor_d = qbytes / bw / 1e3, dbytes / bw / 1e3
            row = dict(
                shape=label, K=K, N=N, swiglu=sw, M=M, nbits_us=t_q, cuda_core_us=t_c, dense_us=t_d,
                nbits_bytes=qbytes, dense_bytes=dbytes, nbits_floor_us=floor_q, dense_floor_us=floor_d,
                identical=identical,
            )  # fmt: skip
            results["rows"].append(row)
            print(
                f"{label:<12} {M:>3} {t_q:>9.1f} {qbytes / t_q / 1e3:>6.0f} {floor_q:>8.1f} "
                f"{t_c:>8.1f} {t_d:>9.1f} {dbytes / t_d / 1e3:>6.0f} {floor_d:>8.1f} {t_q / t_d:>11.2f} "
                f"{'same' if identical else 'DIFFER':>6}",
                flush=True,
            )
        del qsets, dense
        torch.cuda.empty_cache()
    out = Path(args.out) / f"bench_matmul_nbits_cuda_int{args.bits}_b{args.block}.json"
    out.write_text(json.dumps(results, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
