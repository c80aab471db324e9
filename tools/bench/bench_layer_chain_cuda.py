"""Time a decode step's decoder-layer chain on Ouro-1.4B shapes through the custom-op library's C
entry points (ctypes, torch tensors), captured as one CUDA graph: 96 layer applications (24
layers x 4 loops, distinct weights per layer, one KV slot per application at position --past),
each either today's 7 kernels

    ResidualRMSNorm -> QKV -> attention -> o_proj -> ResidualRMSNorm -> gate_up -> down(SwiGLU)

or the 5 of the norm prologue (norm_prologue.cuh): the norm folded into QKV and gate_up

    norm+QKV -> attention -> o_proj -> norm+gate_up -> down(SwiGLU)

for fp16 / bf16 weights (BatchInvariantMatMul) and int4 ones (BatchInvariantMatMulNBits, block
128 with zero points). Checks first that both chains give the same bits (the fused kernels are
the norm kernel plus the projection bit for bit), then prints ms per chain and the fraction of
the copy bandwidth that the chain's bytes (weights + KV read once) would take at that time.
`--omit KIND[,KIND]` times the 7-kernel chain without those kernels (outputs not checked): the
difference is what they cost inside the captured chain, launch and dependency included.
`--variant NAME:VAR=V[,VAR=V]` also times the 7-kernel chain with those launch knobs set (the
library reads them at capture: LOOPCAST_PF_PRE, LOOPCAST_PF_AHEAD, LOOPCAST_ATTN_PF, LOOPCAST_PDL)
and checks that its bits equal the chain's without them.

    python3 -m tools.bench.bench_layer_chain_cuda --lib custom_ops/build/libloopcast_ops.so \
        [--ms 1,4,5] [--past 400] [--variant pf:LOOPCAST_PF_AHEAD=2] [--no-fused] [--out DIR]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os

import torch

from tools.bench.bench_matmul_cuda import copy_bandwidth
from tools.bench.cuda_timing import load_library

H, HEADS, D, INTER, LAYERS, LOOPS = 2048, 16, 128, 5632, 24, 4
QKV = 3 * HEADS * D
CODES = {torch.float16: 1, torch.bfloat16: 2}
BLOCK = 128
OMITTABLE = ("norm1", "qkv", "attention", "o", "norm2", "gate_up", "down")


def _p(t) -> ctypes.c_void_p:
    return ctypes.c_void_p(None if t is None else t.data_ptr())


class Chain:
    """The weights, KV slots and activations of one chain; `step(fused)` enqueues it."""

    def __init__(self, lib, dtype, M: int, past: int, capacity: int, int4: bool) -> None:
        self.lib, self.dtype, self.M, self.int4 = lib, dtype, M, int4
        self.omit: frozenset[str] = frozenset()  # kernels left out (--omit: timing only)
        self.code = CODES[dtype]
        dev = dict(dtype=dtype, device="cuda")
        self.layers = []
        for _ in range(LAYERS):
            lay = {n: 1 + 0.1 * torch.randn(H, **dev) for n in ("n1", "n2", "n3", "n4")}
            for name, (K, N) in {
                "qkv": (H, QKV),
                "o": (H, H),
                "gu": (H, 2 * INTER),
                "down": (INTER, H),
            }.items():
                if int4:
                    nb = K // BLOCK
                    lay[name] = (
                        torch.randint(0, 256, (N, nb, BLOCK // 2), dtype=torch.uint8, device="cuda"),
                        (0.002 + 0.01 * torch.rand(N * nb, device="cuda")).float(),
                        torch.randint(0, 256, (N * ((nb + 1) // 2),), dtype=torch.uint8, device="cuda"),
                    )
                else:
                    lay[name] = torch.randn(K, N, **dev) * 0.02
            self.layers.append(lay)
        self.kv = [
            (torch.randn(1, HEADS, capacity, D, **dev), torch.randn(1, HEADS, capacity, D, **dev))
            for _ in range(LAYERS * LOOPS)
        ]
        self.seqlens = torch.full((1,), past + M - 1, dtype=torch.int32, device="cuda")
        pos = torch.arange(capacity, device="cuda", dtype=torch.float32)[:, None]
        inv = 1.0 / 10000 ** (torch.arange(0, D, 2, device="cuda", dtype=torch.float32) / D)
        self.cos, self.sin = (torch.cos(pos * inv)).to(dtype), (torch.sin(pos * inv)).to(dtype)
        self.capacity = capacity
        z = lambda n: torch.zeros(M, n, **dev)  # noqa: E731
        self.x0 = torch.randn(M, H, **dev)
        self.xs = [z(H), z(H), z(H)]  # the residual stream: a fused sum never overwrites its inputs
        self.h, self.qkv, self.att, self.a = z(H), z(QKV), z(H), z(H)
        self.gu, self.m = z(2 * INTER), z(H)
        self.stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
        self.weight_bytes = (
            sum(
                sum(t.numel() * t.element_size() for t in (v if isinstance(v, tuple) else (v,)))
                for lay in self.layers
                for k, v in lay.items()
                if k in ("qkv", "o", "gu", "down")
            )
            * LOOPS
        )
        self.kv_bytes = LAYERS * LOOPS * 2 * HEADS * (past + M) * D * self.x0.element_size()

    def _ok(self, code: int) -> None:
        if code:
            raise RuntimeError(self.lib.loopcast_cuda_error_string(code).decode())

    def _mm(self, A, W, Y, K: int, N: int, swiglu: bool = False) -> None:
        M = self.M
        if self.int4:
            B, s, z = W
            self._ok(
                self.lib.loopcast_cuda_matmul_nbits(
                    self.code,
                    _p(A),
                    _p(B),
                    _p(s),
                    _p(z),
                    _p(Y),
                    ctypes.c_int64(M),
                    ctypes.c_int64(K),
                    ctypes.c_int64(N),
                    4,
                    BLOCK,
                    int(swiglu),
                    self.stream,
                )
            )
        else:
            entry = self.lib.loopcast_cuda_swiglu_matmul if swiglu else self.lib.loopcast_cuda_matmul
            self._ok(
                entry(
                    self.code,
                    _p(A),
                    _p(W),
                    _p(Y),
                    ctypes.c_int64(M),
                    ctypes.c_int64(K),
                    ctypes.c_int64(N),
                    0,
                    self.stream,
                )
            )

    def _norm_mm(self, A, residual, bw, ow, sum_out, W, Y, K: int, N: int) -> None:
        M, eps = self.M, ctypes.c_float(1e-6)
        norm = [_p(A), _p(residual), _p(bw), _p(None), _p(ow), eps, _p(sum_out)]
        if self.int4:
            B, s, z = W
            self._ok(
                self.lib.loopcast_cuda_norm_matmul_nbits(
                    self.code,
                    *norm,
                    _p(B),
                    _p(s),
                    _p(z),
                    _p(Y),
                    ctypes.c_int64(M),
                    ctypes.c_int64(K),
                    ctypes.c_int64(N),
                    4,
                    BLOCK,
                    self.stream,
                )
            )
        else:
            self._ok(
                self.lib.loopcast_cuda_norm_matmul(
                    self.code,
                    *norm,
                    _p(W),
                    _p(Y),
                    ctypes.c_int64(M),
                    ctypes.c_int64(K),
                    ctypes.c_int64(N),
                    0,
                    self.stream,
                )
            )

    def _norm(self, branch, residual, bw, ow, sum_out, normed) -> None:
        self._ok(
            self.lib.loopcast_cuda_residual_rms_norm(
                self.code,
                _p(branch),
                _p(residual),
                _p(bw),
                _p(None),
                _p(ow),
                _p(sum_out),
                _p(normed),
                ctypes.c_int64(self.M),
                ctypes.c_int64(H),
                ctypes.c_float(1e-6),
                self.stream,
            )
        )

    def _attention(self, slot: int) -> None:
        k, v = self.kv[slot]
        self._ok(
            self.lib.loopcast_cuda_attention(
                self.code,
                _p(self.qkv),
                _p(k),
                _p(v),
                _p(k),
                _p(v),
                _p(self.seqlens),
                _p(self.cos),
                _p(self.sin),
                _p(self.att),
                1,
                self.M,
                HEADS,
                HEADS,
                D,
                self.capacity,
                self.capacity,
                ctypes.c_float(D**-0.5),
                1,
                self.stream,
            )
        )

    def step(self, fused: bool) -> None:
        """x0 -> 96 layer applications (the stack's first norm included); the residual stream
        rotates over three buffers (a fused sum must not overwrite its own inputs)."""
        branch, residual = self.x0, None
        xs = self.xs
        for app in range(LAYERS * LOOPS):
            lay = self.layers[app % LAYERS]
            bw = lay["n4"] if residual is not None else None
            out = xs[(2 * app) % 3]
            run = lambda kind: kind not in self.omit  # noqa: E731
            if fused:
                self._norm_mm(branch, residual, bw, lay["n1"], out, lay["qkv"], self.qkv, H, QKV)
            else:
                if run("norm1"):
                    self._norm(branch, residual, bw, lay["n1"], out, self.h)
                if run("qkv"):
                    self._mm(self.h, lay["qkv"], self.qkv, H, QKV)
            if run("attention"):
                self._attention(app)
            if run("o"):
                self._mm(self.att, lay["o"], self.a, H, H)
            out2 = xs[(2 * app + 1) % 3]
            if fused:
                self._norm_mm(self.a, out, lay["n2"], lay["n3"], out2, lay["gu"], self.gu, H, 2 * INTER)
            else:
                if run("norm2"):
                    self._norm(self.a, out, lay["n2"], lay["n3"], out2, self.h)
                if run("gate_up"):
                    self._mm(self.h, lay["gu"], self.gu, H, 2 * INTER)
            if run("down"):
                self._mm(self.gu, lay["down"], self.m, INTER, H, swiglu=True)
            branch, residual = self.m, out2


def time_chain(chain: Chain, fused: bool, reps: int = 7) -> float:
    """Median ms of a captured graph of one chain."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        chain.stream = ctypes.c_void_p(side.cuda_stream)
        chain.step(fused)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        chain.stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
        chain.step(fused)
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        g.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    del g
    return sorted(times)[len(times) // 2]


def _outputs(chain: Chain, fused: bool, kv0) -> tuple:
    for (k, v), (k0, v0) in zip(chain.kv, kv0):
        k.copy_(k0)
        v.copy_(v0)
    chain.stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
    chain.step(fused)
    torch.cuda.synchronize()
    last = chain.xs[(2 * LAYERS * LOOPS - 1) % 3]
    return (chain.m.clone(), last.clone(), chain.qkv.clone())


def outputs_equal(chain: Chain, env: dict[str, str] | None = None) -> bool:
    """The 7-kernel chain's outputs against the 5-kernel chain's (env None), or against the
    7-kernel chain's under the launch knobs `env`."""
    kv0 = [(k.clone(), v.clone()) for k, v in chain.kv]
    ref = _outputs(chain, False, kv0)
    with knobs(env or {}):
        other = _outputs(chain, env is None, kv0)
    return all(torch.equal(a, b) for a, b in zip(ref, other))


class knobs:
    """Launch knobs (environment variables the library reads at each launch) for a block."""

    def __init__(self, env: dict[str, str]) -> None:
        self.env, self.saved = env, {}

    def __enter__(self) -> None:
        for k, v in self.env.items():
            self.saved[k] = os.environ.get(k)
            os.environ[k] = v

    def __exit__(self, *exc) -> None:
        for k, v in self.saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def parse_variant(text: str) -> tuple[str, dict[str, str]]:
    name, _, assigns = text.partition(":")
    env = dict(a.split("=", 1) for a in assigns.split(",") if a)
    if not name or not env:
        raise SystemExit(f"error: --variant {text!r}: expected NAME:VAR=VALUE[,VAR=VALUE]")
    return name, env


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lib", required=True)
    ap.add_argument("--ms", default="1,4,5")
    ap.add_argument("--past", type=int, default=400)
    ap.add_argument("--capacity", type=int, default=1024)
    ap.add_argument("--dtypes", default="float16,bfloat16")
    ap.add_argument("--no-int4", action="store_true")
    ap.add_argument("--no-fused", action="store_true", help="skip the 5-kernel (norm prologue) chain")
    ap.add_argument("--variant", action="append", default=[], help="NAME:VAR=VALUE[,VAR=VALUE]")
    ap.add_argument(
        "--omit",
        action="append",
        default=[],
        help=f"time the 7-kernel chain without these kernels ({','.join(OMITTABLE)}; repeatable): "
        "the difference is what they cost inside the captured chain",
    )
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    omits = [frozenset(o.split(",")) for o in args.omit]
    for o in omits:
        if not o <= set(OMITTABLE):
            raise SystemExit(f"error: --omit {','.join(sorted(o))}: expected some of {','.join(OMITTABLE)}")
    lib = load_library(args.lib)
    torch.manual_seed(0)
    bw = copy_bandwidth()
    print(f"device: {torch.cuda.get_device_name()}  copy bandwidth {bw:.0f} GB/s", flush=True)
    rows = []
    variants_env = [parse_variant(v) for v in args.variant]
    kinds = [(d, False) for d in args.dtypes.split(",")] + ([] if args.no_int4 else [("float16", True)])
    for dname, int4 in kinds:
        for M in (int(m) for m in args.ms.split(",")):
            chain = Chain(lib, getattr(torch, dname), M, args.past, args.capacity, int4)
            same = None if args.no_fused else outputs_equal(chain)
            t7 = time_chain(chain, False)
            t5 = float("nan") if args.no_fused else time_chain(chain, True)
            t7b = time_chain(chain, False)  # a second pass: the spread
            t5b = float("nan") if args.no_fused else time_chain(chain, True)
            t7, t5 = min(t7, t7b), min(t5, t5b)
            floor = (chain.weight_bytes + chain.kv_bytes) / bw / 1e6
            variants = {}
            for name, env in variants_env:
                equal = outputs_equal(chain, env)
                with knobs(env):
                    tv = min(time_chain(chain, False), time_chain(chain, False))
                    tf = (
                        float("nan")
                        if args.no_fused
                        else min(time_chain(chain, True), time_chain(chain, True))
                    )
                variants[name] = dict(ms=tv, fused_ms=tf, identical=equal)
            omitted = {}
            for o in omits:
                chain.omit = o
                omitted[",".join(sorted(o))] = min(time_chain(chain, False), time_chain(chain, False))
            chain.omit = frozenset()
            row = dict(
                dtype=dname,
                int4=int4,
                M=M,
                past=args.past,
                unfused_ms=t7,
                unfused_second_ms=t7b,
                fused_ms=t5,
                fused_second_ms=t5b,
                floor_ms=floor,
                identical=same,
                variants=variants,
                omitted=omitted,
            )
            rows.append(row)
            label = f"{dname}{' int4' if int4 else ''}"
            print(
                f"{label:14s} M={M:2d}  7 kernels {t7:.3f} ms ({floor / t7 * 100:3.0f}%)  "
                f"5 kernels {t5:.3f} ms ({floor / t5 * 100:3.0f}%)  "
                f"floor {floor:.3f} ms  identical={same}",
                flush=True,
            )
            for name, v in variants.items():
                print(
                    f"{'':14s}       {name:24s} {v['ms']:.3f} ms ({floor / v['ms'] * 100:3.0f}%, "
                    f"x{t7 / v['ms']:.3f} the 7 kernels)  5 kernels {v['fused_ms']:.3f} ms  "
                    f"bits = without: {v['identical']}",
                    flush=True,
                )
            for name, tv in omitted.items():
                per_layer = (t7 - tv) / (LAYERS * LOOPS) * 1e3
                print(f"{'':21s}without {name:24s} {tv:.3f} ms: {per_layer:5.2f} us a layer", flush=True)
            del chain
            torch.cuda.empty_cache()
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "bench_layer_chain_cuda.json"), "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "copy_gbps": bw, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
