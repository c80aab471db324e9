"""GGUF's 32-value blocks (Q4_0, Q4_1, Q8_0) as MatMulNBits tensors, without a float round trip
(docs/architecture.md, "GGUF input").

    Q4_0  18 bytes: d (fp16), 16 bytes of codes; value j in the low nibble of byte j, value j+16
          in its high nibble;             w = (q - 8) · d        → int4, zero point 8 (the default)
    Q4_1  20 bytes: d, m (fp16), 16 bytes of codes as Q4_0;  w = q · d + m
                                                                 → int4, fp32 zero point -m/d
    Q8_0  34 bytes: d (fp16), 32 int8 codes;   w = q · d        → int8, zero point 128 (the default)

MatMulNBits packs two 4-bit values a byte with the *lower K first* (values 2j, 2j+1 in byte j),
so GGUF's nibbles are reordered; codes and scales are otherwise copied (fp16 → fp32 is exact).
A Q4_1 block becomes ``(q - z) · d`` with ``z = -m/d`` in fp32: within an ulp of ``q·d + m``, not
always bit-equal. Symmetric blocks stored under an asymmetric scheme carry their zero point (8 or
128) explicitly, so one scheme can hold a file's mix (a Q8_0 output under Q4_1 layers).
"""

from __future__ import annotations

from enum import IntEnum

import numpy as np
from loopcast.exporter.quantize import Quantized, pack_zero_points

from loopcast.errors import CheckpointError

BLOCK = 32


class BlockType(IntEnum):
    """The GGML tensor types loopcast reads (values: ggml's type ids)."""

    F32 = 0
    F16 = 1
    Q4_0 = 2
    Q4_1 = 3
    Q8_0 = 8
    BF16 = 30

    @property
    def bits(self) -> int | None:
        return {BlockType.Q4_0: 4, BlockType.Q4_1: 4, BlockType.Q8_0: 8}.get(self)

    @property
    def symmetric(self) -> bool:
        return self is not BlockType.Q4_1

    @property
    def block_bytes(self) -> int:
        return {BlockType.Q4_0: 18, BlockType.Q4_1: 20, BlockType.Q8_0: 34}[self]


def _fp16(raw: np.ndarray, at: int) -> np.ndarray:
    """The fp16 at byte ``at`` of every block, as fp32 [N, nb]."""
    return np.ascontiguousarray(raw[..., at : at + 2]).view(np.float16)[..., 0].astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """GGUF's 16 code bytes of each block → its 32 codes in K order."""
    return np.concatenate([qs & 0xF, qs >> 4], axis=-1)


def codes_of(raw: np.ndarray, kind: BlockType) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """Codes uint8 [N, nb, 32], scales fp32 [N, nb] and, for Q4_1, the mins fp32 [N, nb] of a
    GGUF tensor's raw blocks ``raw`` (uint8 [N, nb, block_bytes])."""
    if raw.shape[-1] != kind.block_bytes:
        raise AssertionError(f"{kind.name} blocks are {kind.block_bytes} bytes, got {raw.shape[-1]}")
    if kind is BlockType.Q8_0:
        q = (raw[..., 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
        return q, _fp16(raw, 0), None
    if kind is BlockType.Q4_0:
        return _nibbles(raw[..., 2:]), _fp16(raw, 0), None
    return _nibbles(raw[..., 4:]), _fp16(raw, 0), _fp16(raw, 2)


def to_matmulnbits(
    raw: np.ndarray, kind: BlockType, *, symmetric: bool, float_zero_points: bool
) -> Quantized:
    """One matrix's GGUF blocks ``raw`` (uint8 [N, nb, block_bytes]) in MatMulNBits' layout, for a
    scheme that is ``symmetric`` (no stored zero points) or not (uint8 or fp32 zero points)."""
    n, nb = raw.shape[:2]
    q, d, m = codes_of(raw, kind)
    bits = kind.bits
    if bits is None:
        raise AssertionError(f"{kind.name} is not a block type")
    if m is not None:
        if symmetric or not float_zero_points:
            raise AssertionError("Q4_1 blocks need an asymmetric scheme with fp32 zero points")
        # w = q·d + m = (q - z)·d with z = -m/d; a block with d = 0 holds m everywhere: (0 + 1)·m
        flat = d == 0
        q = np.where(flat[:, :, None], 0, q).astype(np.uint8)
        zero = np.where(flat, -1.0, -m / np.where(flat, 1, d)).astype(np.float32)
        d = np.where(flat, m, d).astype(np.float32)
    else:
        zero = np.full((n, nb), 1 << (bits - 1), np.float32)
    packed = (q[..., 0::2] | (q[..., 1::2] << 4)).astype(np.uint8) if bits == 4 else q
    zero_points = None
    if not symmetric:
        zero_points = zero.reshape(-1) if float_zero_points else pack_zero_points(zero.astype(np.uint8), bits)
    return Quantized(packed, d.reshape(-1), zero_points, nb * BLOCK, n, bits, BLOCK)


def dequantize_blocks(raw: np.ndarray, kind: BlockType) -> np.ndarray:
    """The fp32 [N, K] values llama.cpp computes from the blocks (``(q-8)·d``, ``q·d + m``,
    ``q·d``), for tensors loopcast keeps in float (the embedding, a float-layer model's head)."""
    q, d, m = codes_of(raw, kind)
    zero = 8 if kind is BlockType.Q4_0 else 128 if kind is BlockType.Q8_0 else 0
    w = (q.astype(np.float32) - zero) * d[:, :, None]
    if m is not None:
        w = q.astype(np.float32) * d[:, :, None] + m[:, :, None]
    return w.reshape(raw.shape[0], -1)


def unpermute_rows(a: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's ``permute`` of Llama q/k rows (convert_hf_to_gguf.py: each head's rows
    reordered from rotate-half pairs (i, i + D/2) to adjacent pairs (2i, 2i+1), for ggml's rope).
    Rows are whole blocks, so a quantized tensor is un-permuted exactly, blocks and all."""
    n = a.shape[0]
    if n % (2 * n_head):
        raise CheckpointError(f"{n} q/k rows do not split into {n_head} heads of even size")
    return np.ascontiguousarray(
        a.reshape(n_head, n // n_head // 2, 2, *a.shape[1:]).swapaxes(1, 2).reshape(a.shape)
    )
