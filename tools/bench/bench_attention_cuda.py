"""Benchmark the CUDA BatchInvariantAttention kernel (loopcast_cuda_attention, called through ctypes
with torch tensors) on Ouro-1.4B attention shapes (Hq = Hkv = 16, D = 128), against torch's
scaled_dot_product_attention on the same q / cache shapes.

Each timing replays a captured CUDA graph of many calls that cycle through enough distinct KV
caches (>= 5x the 50 MB L2 in all) that every call reads its cache from HBM. Our op includes the
rotary + KV-cache write; SDPA is attention only (no rotary, no cache write, no causal mask among
the S new rows: the same positions read). Also checks, on every shape, that the S-row call gives
the bits of S one-row calls, and that graph replays give the eager bits.

    python3 -m tools.bench.bench_attention_cuda --lib new=custom_ops/build/libloopcast_ops.so \
        [--lib old=...] [--out DIR]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import math
import os

import torch
import torch.nn.functional as F

from tools.bench.cuda_timing import graph_time_us, load_library

CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
POOL_BYTES = 320 << 20


def call(lib, q, pk, pv, seq, cos, sin, out, Hq: int, Hkv: int, D: int) -> None:
    B, S, _ = q.shape
    p = lambda t: ctypes.c_void_p(t.data_ptr())  # noqa: E731
    stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
    code = lib.loopcast_cuda_attention(
        CODES[q.dtype],
        p(q),
        p(pk),
        p(pv),
        p(pk),
        p(pv),
        p(seq),
        p(cos),
        p(sin),
        p(out),
        B,
        S,
        Hq,
        Hkv,
        D,
        pk.shape[2],
        cos.shape[0],
        ctypes.c_float(1.0 / math.sqrt(D)),
        1,
        stream,
    )
    if code:
        raise RuntimeError(lib.loopcast_cuda_error_string(code).decode())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lib", action="append", required=True, help="name=path")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--calls", type=int, default=96)
    ap.add_argument("--dtypes", default="float16,bfloat16")
    ap.add_argument("--pasts", default="256,1024,4096")
    ap.add_argument("--widths", default="1,5,8,32")
    ap.add_argument("--heads", default="16,16,128", help="Hq,Hkv,D")
    args = ap.parse_args()
    libs = {kv.split("=", 1)[0]: load_library(kv.split("=", 1)[1]) for kv in args.lib}
    Hq, Hkv, D = (int(x) for x in args.heads.split(","))
    torch.manual_seed(0)
    dev = torch.cuda.get_device_name()
    print(f"device: {dev}  Hq={Hq} Hkv={Hkv} D={D}", flush=True)
    results = {"device": dev, "Hq": Hq, "Hkv": Hkv, "D": D, "rows": [], "invariance": []}
    os.makedirs(args.out, exist_ok=True)
    for dname in args.dtypes.split(","):
        dtype = getattr(torch, dname)
        for past in (int(x) for x in args.pasts.split(",")):
            cap = past + 64
            pair = 2 * Hkv * cap * D * 2
            nbuf = max(4, POOL_BYTES // pair)
            Ks = [torch.randn(1, Hkv, cap, D, dtype=dtype, device="cuda") for _ in range(nbuf)]
            Vs = [torch.randn(1, Hkv, cap, D, dtype=dtype, device="cuda") for _ in range(nbuf)]
            half = D // 2
            ang = torch.arange(cap, device="cuda", dtype=torch.float64)[:, None] / 10000 ** (
                torch.arange(0, D, 2, device="cuda", dtype=torch.float64) / D
            )
            cos, sin = ang.cos().to(dtype).contiguous(), ang.sin().to(dtype).contiguous()
            assert cos.shape[1] == half
            for S in (int(x) for x in args.widths.split(",")):
                qkv = torch.randn(1, S, (Hq + 2 * Hkv) * D, dtype=dtype, device="cuda")
                seq = torch.tensor([past + S - 1], dtype=torch.int32, device="cuda")
                out = torch.empty(1, S, Hq * D, dtype=dtype, device="cuda")
                row = dict(
                    dtype=dname, past=past, S=S, cap=cap, nbuf=nbuf, kv_bytes=2 * Hkv * (past + S) * D * 2
                )
                for name, lib in libs.items():
                    # invariance on the real shape: S rows in one call == S one-row calls
                    k0, v0 = Ks[0].clone(), Vs[0].clone()
                    call(lib, qkv, k0, v0, seq, cos, sin, out, Hq, Hkv, D)
                    full = out.clone()
                    k1, v1 = Ks[0].clone(), Vs[0].clone()
                    ones = torch.empty_like(out)
                    for i in range(S):
                        o1 = torch.empty(1, 1, Hq * D, dtype=dtype, device="cuda")
                        s1 = torch.tensor([past + i], dtype=torch.int32, device="cuda")
                        call(lib, qkv[:, i : i + 1].contiguous(), k1, v1, s1, cos, sin, o1, Hq, Hkv, D)
                        ones[:, i : i + 1] = o1
                    torch.cuda.synchronize()
                    ident = bool(torch.equal(full, ones) and torch.equal(k0, k1) and torch.equal(v0, v1))
                    # graph timing over the buffer pool; then the graph's bits vs the eager call
                    ncalls = max(args.calls, min(nbuf, 4 * args.calls))
                    fns = [
                        (
                            lambda K=Ks[i % nbuf], V=Vs[i % nbuf], lib=lib: call(
                                lib, qkv, K, V, seq, cos, sin, out, Hq, Hkv, D
                            )
                        )
                        for i in range(ncalls)
                    ]
                    try:
                        row[name] = graph_time_us(fns, reps=5)
                        torch.cuda.synchronize()
                        last = (ncalls - 1) % nbuf
                        graph_out = out.clone()
                        call(lib, qkv, Ks[last], Vs[last], seq, cos, sin, out, Hq, Hkv, D)
                        torch.cuda.synchronize()
                        replay_ok = bool(torch.equal(graph_out, out))
                    except RuntimeError as e:
                        print(f"!! {name}: {e}", flush=True)
                        row[name], replay_ok = float("nan"), False
                    results["invariance"].append(
                        dict(
                            lib=name,
                            dtype=dname,
                            past=past,
                            S=S,
                            identical=ident,
                            graph_replay_identical=replay_ok,
                        )
                    )
                    if not ident or not replay_ok:
                        print(
                            f"!! {name} {dname} past={past} S={S}: identical={ident} replay={replay_ok}",
                            flush=True,
                        )
                # torch SDPA on the same shapes (q [1,Hq,S,D] over past+S cached positions)
                q4 = torch.randn(1, Hq, S, D, dtype=dtype, device="cuda")
                o4 = torch.empty_like(q4)
                L = past + S
                ncalls = max(args.calls, min(nbuf, 4 * args.calls))

                def sdpa(K, V):
                    o4.copy_(
                        F.scaled_dot_product_attention(q4, K[:, :, :L], V[:, :, :L], enable_gqa=Hq != Hkv)
                    )

                row["sdpa"] = graph_time_us(
                    [(lambda K=Ks[i % nbuf], V=Vs[i % nbuf]: sdpa(K, V)) for i in range(ncalls)], reps=5
                )
                results["rows"].append(row)
                cells = "  ".join(f"{k} {row[k]:7.1f}us" for k in [*libs, "sdpa"])
                gbps = row["kv_bytes"] / row[next(iter(libs))] / 1e3
                print(f"{dname:8s} past={past:5d} S={S:2d}  {cells}   ({gbps:5.0f} GB/s KV)", flush=True)
                with open(os.path.join(args.out, "bench_attention_cuda.json"), "w") as f:
                    json.dump(results, f, indent=1)
            del Ks, Vs
            torch.cuda.empty_cache()
    name = next(iter(libs))
    for dname in args.dtypes.split(","):
        for past in (int(x) for x in args.pasts.split(",")):
            rs = {r["S"]: r[name] for r in results["rows"] if r["dtype"] == dname and r["past"] == past}
            if 1 in rs and 5 in rs:
                print(f"{name} {dname} past={past}: S=5 / S=1 = {rs[5] / rs[1]:.2f}", flush=True)
    bad = [r for r in results["invariance"] if not (r["identical"] and r["graph_replay_identical"])]
    print(
        f"invariance: {len(results['invariance']) - len(bad)}/{len(results['invariance'])} identical",
        flush=True,
    )


if __name__ == "__main__":
    main()
