"""The fused decoder-layer CUDA kernel (loopcast_cuda_decoder_layer) through ctypes, and the same layer
as the chain of the library's separate CUDA kernels (ResidualRMSNorm, BatchInvariantMatMul,
BatchInvariantAttention, SwiGLU down projection), which the kernel tests check one by one against
torch. Shared by tests/custom_ops/test_cuda_decoder_layer.py and tools/bench_decoder_layer_cuda.py;
torch and ctypes only (no onnxruntime, no loopcast import)."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

CODES = {torch.float16: 1, torch.bfloat16: 2}


class LayerArgs(ctypes.Structure):
    """cuda_launch.h LoopcastLayerArgs, field for field."""

    _fields_ = [(name, ctypes.c_void_p) for name in (
        "branch", "residual", "branch_norm", "loop_norm", "input_norm", "qkv_weight", "key_cache", "value_cache",
        "seqlens_k", "cos_cache", "sin_cache", "o_weight", "attn_norm", "post_attn_norm", "gate_up_weight",
        "down_weight", "sum_out", "mid_out", "mlp_out")] + [(name, ctypes.c_int32) for name in (
            "rows", "hidden", "num_heads", "kv_num_heads", "head_dim", "intermediate", "capacity", "rotary_len",
            "do_rotary")] + [("epsilon", ctypes.c_float), ("scale", ctypes.c_float)]


@dataclass(frozen=True)
class Shape:
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    inter: int
    capacity: int

    @property
    def qkv(self) -> int:
        return (self.heads + 2 * self.kv_heads) * self.head_dim


@dataclass
class LayerWeights:
    """One layer's tensors on the GPU, weights [K, N] as the graphs store them."""

    qkv: torch.Tensor
    o: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor
    input_norm: torch.Tensor
    attn_norm: torch.Tensor | None
    post_attn_norm: torch.Tensor
    mlp_norm: torch.Tensor | None  # the sandwich norm of the MLP branch: the next layer's branch_norm


def random_layer(shape: Shape, dtype: torch.dtype, gen: torch.Generator, *, sandwich: bool = True) -> LayerWeights:
    def w(k: int, n: int) -> torch.Tensor:
        return (torch.randn(k, n, generator=gen, device="cuda") / k ** 0.5).to(dtype)

    def g() -> torch.Tensor:
        return (1.0 + 0.1 * torch.randn(shape.hidden, generator=gen, device="cuda")).to(dtype)

    return LayerWeights(w(shape.hidden, shape.qkv), w(shape.heads * shape.head_dim, shape.hidden),
                        w(shape.hidden, 2 * shape.inter), w(shape.inter, shape.hidden), g(),
                        g() if sandwich else None, g(), g() if sandwich else None)


def rotary_tables(length: int, head_dim: int, dtype: torch.dtype, theta: float = 10000.0):
    inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64, device="cuda") / head_dim)
    ang = torch.arange(length, dtype=torch.float64, device="cuda")[:, None] * inv[None, :]
    return torch.cos(ang).to(dtype), torch.sin(ang).to(dtype)


def _p(t: torch.Tensor | None) -> ctypes.c_void_p:
    return ctypes.c_void_p(t.data_ptr() if t is not None else None)


def _stream() -> ctypes.c_void_p:
    return ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)


def check(lib: ctypes.CDLL, code: int, what: str) -> None:
    if code != 0:
        raise RuntimeError(f"{what}: {lib.loopcast_cuda_error_string(code).decode()}")


@dataclass
class LayerIO:
    """Inputs and outputs of one layer application; the caches are updated in place."""

    branch: torch.Tensor
    residual: torch.Tensor | None
    branch_norm: torch.Tensor | None
    loop_norm: torch.Tensor | None
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    seqlens_k: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    sum_out: torch.Tensor
    mid_out: torch.Tensor
    mlp_out: torch.Tensor


def new_io(shape: Shape, rows: int, dtype: torch.dtype, gen: torch.Generator, *, past: int,
           cos: torch.Tensor, sin: torch.Tensor, residual: bool = True, branch_norm: bool = True) -> LayerIO:
    """Random branch/residual rows at positions past..past+rows-1 over a random cache of `past` rows."""
    h, cap = shape.hidden, shape.capacity

    def rnd(*size) -> torch.Tensor:
        return torch.randn(*size, generator=gen, device="cuda").to(dtype)

    kc = torch.zeros(1, shape.kv_heads, cap, shape.head_dim, dtype=dtype, device="cuda")
    vc = torch.zeros_like(kc)
    kc[:, :, :past] = rnd(1, shape.kv_heads, past, shape.head_dim)
    vc[:, :, :past] = rnd(1, shape.kv_heads, past, shape.head_dim)
    g = (1.0 + 0.1 * torch.randn(h, generator=gen, device="cuda")).to(dtype)
    return LayerIO(rnd(rows, h), rnd(rows, h) if residual else None, g if branch_norm else None, None, kc, vc,
                   torch.tensor([past + rows - 1], dtype=torch.int32, device="cuda"), cos, sin,
                   torch.empty(rows, h, dtype=dtype, device="cuda"), torch.empty(rows, h, dtype=dtype, device="cuda"),
                   torch.empty(rows, h, dtype=dtype, device="cuda"))


def fused_layer_call(lib: ctypes.CDLL, shape: Shape, w: LayerWeights, io: LayerIO, *, eps: float = 1e-6):
    """A closure enqueueing the fused kernel on the current stream (capturable)."""
    rows = io.branch.shape[0]
    args = LayerArgs(_p(io.branch), _p(io.residual), _p(io.branch_norm), _p(io.loop_norm), _p(w.input_norm),
                     _p(w.qkv), _p(io.key_cache), _p(io.value_cache), _p(io.seqlens_k), _p(io.cos), _p(io.sin),
                     _p(w.o), _p(w.attn_norm), _p(w.post_attn_norm), _p(w.gate_up), _p(w.down), _p(io.sum_out),
                     _p(io.mid_out), _p(io.mlp_out), rows, shape.hidden, shape.heads, shape.kv_heads, shape.head_dim,
                     shape.inter, shape.capacity, io.cos.shape[0], 1, eps, shape.head_dim ** -0.5)
    code = CODES[io.branch.dtype]

    def call() -> None:
        check(lib, lib.loopcast_cuda_decoder_layer(code, ctypes.byref(args), _stream()), "decoder layer")
    return call


def chain_layer_call(lib: ctypes.CDLL, shape: Shape, w: LayerWeights, io: LayerIO, *, eps: float = 1e-6):
    """The same layer as seven launches of the separate kernels (a closure, capturable)."""
    rows, h, dt = io.branch.shape[0], shape.hidden, io.branch.dtype
    code = CODES[dt]
    buf = {name: torch.empty(rows, n, dtype=dt, device="cuda") for name, n in (
        ("h", h), ("qkv", shape.qkv), ("attn", shape.heads * shape.head_dim), ("a", h), ("h3", h),
        ("gu", 2 * shape.inter))}
    i64, f32 = ctypes.c_int64, ctypes.c_float

    def norm(branch, residual, bw, lw, ow, s, normed):
        check(lib, lib.loopcast_cuda_residual_rms_norm(code, _p(branch), _p(residual), _p(bw), _p(lw), _p(ow), _p(s),
                                                       _p(normed), i64(rows), i64(h), f32(eps), _stream()), "norm")

    def matmul(x, wt, y, k, n, swiglu=False):
        entry = lib.loopcast_cuda_swiglu_matmul if swiglu else lib.loopcast_cuda_matmul
        check(lib, entry(code, _p(x), _p(wt), _p(y), i64(rows), i64(k), i64(n), 0, _stream()), "matmul")

    def call() -> None:
        norm(io.branch, io.residual, io.branch_norm, io.loop_norm, w.input_norm, io.sum_out, buf["h"])
        matmul(buf["h"], w.qkv, buf["qkv"], h, shape.qkv)
        check(lib, lib.loopcast_cuda_attention(
            code, _p(buf["qkv"]), _p(io.key_cache), _p(io.value_cache), _p(io.key_cache), _p(io.value_cache),
            _p(io.seqlens_k), _p(io.cos), _p(io.sin), _p(buf["attn"]), 1, rows, shape.heads, shape.kv_heads,
            shape.head_dim, shape.capacity, io.cos.shape[0], f32(shape.head_dim ** -0.5), 1, _stream()), "attention")
        matmul(buf["attn"], w.o, buf["a"], shape.heads * shape.head_dim, h)
        norm(buf["a"], io.sum_out, w.attn_norm, None, w.post_attn_norm, io.mid_out, buf["h3"])
        matmul(buf["h3"], w.gate_up, buf["gu"], h, 2 * shape.inter)
        matmul(buf["gu"], w.down, io.mlp_out, shape.inter, h, swiglu=True)
    return call


def clone_io(io: LayerIO) -> LayerIO:
    """Independent caches and outputs, the same inputs."""
    return LayerIO(io.branch, io.residual, io.branch_norm, io.loop_norm, io.key_cache.clone(), io.value_cache.clone(),
                   io.seqlens_k.clone(), io.cos, io.sin, torch.empty_like(io.sum_out), torch.empty_like(io.mid_out),
                   torch.empty_like(io.mlp_out))
