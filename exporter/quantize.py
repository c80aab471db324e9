"""RTN block quantization in numpy, in ONNX Runtime's MatMulNBits layout (loopcast/quant.py).

A weight ``W`` [N, K] (the checkpoint's orientation: one row per output column of ``x @ Wᵀ``)
is cut along K into blocks of ``block_size`` (K padded with zeros to a whole block); per block:

    symmetric:   int4: scale = w_max / -8, w_max the block's value of largest magnitude, sign
                 kept: it takes code 0 exactly, so the block uses all 16 codes (as ONNX Runtime's
                 quantizer and GGUF Q4_0 do; absmax / 7 leaves one unused), and values of the
                 other sign past 7·|scale| clip to code 15. On SmolLM2-135M that is 0.02 bits/byte
                 better held out than absmax / 7 (docs/quantization.md); a per-block least-squares
                 scale, which clips the largest weights, was 0.04 worse.
                 int8: scale = max|w| / 127 (GGUF Q8_0's grid; one code of 256 matters little)
                 zero point = 2^(b-1) (not stored: the op's default)
    asymmetric:  scale = (max(w,0) - min(w,0)) / (2^b - 1),   zero point = round(-min(w,0) / scale)
    q = clip(round(w / scale) + zero point, 0, 2^b - 1);      dequantized w' = (q - zero point) · scale

MatMulNBits inputs (com.microsoft; docs/architecture.md "Quantized weights"):

    B            uint8 [N, n_blocks, block_size·b/8]   4 bits: two values a byte, the lower K first
    scales       fp32  [N · n_blocks]
    zero_points  uint8 [N · ceil(n_blocks·b/8)]         4 bits: two blocks a byte, the lower first
                 or fp32 [N · n_blocks]                  (GGUF Q4_1: exporter/gguf_blocks.py)
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Quantized:
    """One quantized [N, K] matrix in MatMulNBits' layout."""

    packed: np.ndarray  # uint8 [N, n_blocks, blob]
    scales: np.ndarray  # fp32 [N * n_blocks]
    zero_points: np.ndarray | None  # uint8 packed, None when symmetric
    k: int
    n: int
    bits: int
    block_size: int


def n_blocks(k: int, block_size: int) -> int:
    return -(-k // block_size)


def shapes(
    n: int, k: int, bits: int, block_size: int, symmetric: bool, float_zero_points: bool = False
) -> dict[str, tuple[int, ...]]:
    """The shapes of the stored tensors ("packed", "scales", "zero_points" when asymmetric)."""
    nb = n_blocks(k, block_size)
    out = {"packed": (n, nb, block_size * bits // 8), "scales": (n * nb,)}
    if not symmetric:
        out["zero_points"] = (n * nb,) if float_zero_points else (n * (-(-nb * bits // 8)),)
    return out


def _codes(w_NK: np.ndarray, bits: int, block_size: int, symmetric: bool):
    """Integer codes [N, nb, bs] (uint8), scales [N, nb] fp32, zero points [N, nb] uint8."""
    n, k = w_NK.shape
    nb = n_blocks(k, block_size)
    w = np.zeros((n, nb * block_size), np.float32)
    w[:, :k] = w_NK
    w = w.reshape(n, nb, block_size)
    top = (1 << bits) - 1
    if symmetric:
        zp = np.full((n, nb), 1 << (bits - 1), np.float32)
        if bits == 4:
            at = np.abs(w).argmax(axis=2)[:, :, None]
            scale = np.take_along_axis(w, at, axis=2)[:, :, 0] / -8.0
        else:
            scale = np.abs(w).max(axis=2) / ((1 << (bits - 1)) - 1)
    else:
        lo, hi = np.minimum(w.min(axis=2), 0), np.maximum(w.max(axis=2), 0)
        scale = (hi - lo) / top
        safe = np.where(scale == 0, 1, scale)
        zp = np.clip(np.rint(-lo / safe), 0, top)
    scale = np.where(scale == 0, 1, scale).astype(np.float32)  # an all-zero block: q = zero point
    q = np.clip(np.rint(w / scale[:, :, None]) + zp[:, :, None], 0, top).astype(np.uint8)
    return q, scale, zp.astype(np.uint8)


def _pack4(q: np.ndarray) -> np.ndarray:
    """Pairs of 4-bit values along the last axis into bytes, the first in the low nibble."""
    if q.shape[-1] % 2:
        q = np.concatenate([q, np.zeros((*q.shape[:-1], 1), np.uint8)], axis=-1)
    return (q[..., 0::2] | (q[..., 1::2] << 4)).astype(np.uint8)


def pack_zero_points(zp_NB: np.ndarray, bits: int) -> np.ndarray:
    """uint8 zero points [N, n_blocks] in MatMulNBits' layout (4 bits: two blocks a byte, each
    row padded to a whole byte)."""
    return (_pack4(zp_NB) if bits == 4 else zp_NB).reshape(-1)


def quantize(w_NK: np.ndarray, bits: int, block_size: int, symmetric: bool) -> Quantized:
    """RTN-quantize ``w_NK`` (any float dtype, computed in fp32)."""
    n, k = w_NK.shape
    q, scale, zp = _codes(np.asarray(w_NK, np.float32), bits, block_size, symmetric)
    packed = _pack4(q) if bits == 4 else q
    zero_points = None if symmetric else pack_zero_points(zp, bits)
    return Quantized(packed, scale.reshape(-1), zero_points, k, n, bits, block_size)


def dequantize(qt: Quantized) -> np.ndarray:
    """The fp32 [N, K] matrix the quantized one stands for (the reference of the graphs)."""
    nb = n_blocks(qt.k, qt.block_size)
    if qt.bits == 4:
        q = np.stack([qt.packed & 0xF, qt.packed >> 4], axis=-1).reshape(qt.n, nb, qt.block_size)
    else:
        q = qt.packed
    if qt.zero_points is None:
        zp = np.full((qt.n, nb), 1 << (qt.bits - 1), np.float32)
    elif qt.zero_points.dtype == np.float32:  # fp32 zero points (a GGUF Q4_1 block's -m/d)
        zp = qt.zero_points.reshape(qt.n, nb)
    elif qt.bits == 4:
        per_row = -(-nb // 2)
        z = qt.zero_points.reshape(qt.n, per_row)
        zp = np.stack([z & 0xF, z >> 4], axis=-1).reshape(qt.n, 2 * per_row)[:, :nb].astype(np.float32)
    else:
        zp = qt.zero_points.reshape(qt.n, nb).astype(np.float32)
    scale = qt.scales.reshape(qt.n, nb)
    w = (q.astype(np.float32) - zp[:, :, None]) * scale[:, :, None]
    return w.reshape(qt.n, nb * qt.block_size)[:, : qt.k]
