"""Attention heads stored padded to a size the CUDA attention kernels take (docs/checkpoints.md,
"Head padding").

The loopcast attention ops' CUDA kernels take head sizes 16, 32, 64 and 128; Huginn-0125's heads
are 96. Such a model is exported with every q, k and v head of d dims stored as D > d dims, the
padding in the weights only (the graphs run no extra op). The ops rotate halves (element i pairs
with i + D/2), so each rotary half of a head is followed by its share of zeros:

    model head  [x_0 .. x_{d/2-1} | x_{d/2} .. x_{d-1}]
    stored head [x_0 .. x_{d/2-1}, 0 × p | x_{d/2} .. x_{d-1}, 0 × p]       p = (D - d) / 2

so the stored pairs (i, i + D/2) are the model's pairs (i, i + d/2), rotated by the model's
angles (the rotary tables' first d/2 columns; the padded columns hold cos 1, sin 0 and only
ever rotate zeros). The padded dims of q and k are zero, so q·k is the model's; those of v are
zero, so the attention output of a padded dim is zero, and o_proj's rows of the padded dims are
zero too. The scale stays 1/√d: the graphs pass it to the attention ops explicitly
(graphs/blocks.py), never the ops' default 1/√D. Biases of q, k and v get the same layout.
Sums run over more (zero) terms, so logits match an unpadded export's to rounding, not bit for
bit; rows stay row-invariant (each row is still its one-row call).

What makes this exact is that nothing but the rotary and q·k reads a head's dims: a q/k norm
over the head would count the zeros (no supported architecture has one: loopcast/config.py
refuses unknown fields). Quantized matrices are quantized after the padding (exporter/weights.py):
the q/k/v rows' blocks are the unpadded ones, o_proj's run over each stored head.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class HeadPadding:
    """Heads of ``head_dim`` dims stored as ``stored`` dims (equal: no padding)."""

    head_dim: int
    stored: int

    def __post_init__(self) -> None:
        if self.head_dim % 2 or self.stored % 2 or self.stored < self.head_dim:
            raise ValueError(f"cannot pad heads of {self.head_dim} to {self.stored}")

    @property
    def padded(self) -> bool:
        return self.stored != self.head_dim

    def positions(self) -> np.ndarray:
        """Where each of a head's ``head_dim`` dims lives in its stored head."""
        half, pad = self.head_dim // 2, (self.stored - self.head_dim) // 2
        return np.concatenate([np.arange(half), np.arange(half, self.head_dim) + pad])

    def heads(self, x: np.ndarray, heads: int, axis: int = 0) -> np.ndarray:
        """``x`` with ``axis`` holding ``heads`` heads of ``head_dim`` (head-major) widened to
        ``heads`` heads of ``stored``, zeros at the padded dims."""
        if not self.padded:
            return x
        x = np.asarray(x)
        if x.shape[axis] != heads * self.head_dim:
            raise ValueError(f"axis {axis} of {x.shape} is not {heads} heads of {self.head_dim}")
        shape = list(x.shape)
        shape[axis] = heads * self.stored
        out = np.zeros(shape, x.dtype)
        at = (np.arange(heads)[:, None] * self.stored + self.positions()[None, :]).reshape(-1)
        index: list = [slice(None)] * x.ndim
        index[axis] = at
        out[tuple(index)] = x
        return out

    def rotary(self, table_SD2: np.ndarray, fill: float) -> np.ndarray:
        """A rotary table [S, head_dim/2] widened to [S, stored/2] with ``fill`` (cos 1, sin 0)."""
        if not self.padded:
            return table_SD2
        table_SD2 = np.asarray(table_SD2)
        out = np.full((table_SD2.shape[0], self.stored // 2), fill, table_SD2.dtype)
        out[:, : self.head_dim // 2] = table_SD2
        return out
