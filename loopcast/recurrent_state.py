"""The initial state of a recurrent-depth model's core steps (Huginn; docs/checkpoints.md).

The release starts every new row's recurrence from a random state: ``N(0, σ²)`` truncated to
``[-3σ, 3σ]`` with ``σ = init_values.std · √H`` (its ``initialize_state``), drawn from torch's
global generator, or from zero (``init_scale=0``). loopcast draws the same distribution, but
deterministically and per position, so a row's state depends only on (seed, position): a
prompt prefilled in one call and the same tokens decoded one by one, or a position rewound and
recomputed by speculation, start from the same bits. The draws are numpy's (Philox keyed by
``(seed, position)``), not bit for bit torch's. The torch reference and the runtime both call
this function, so their recurrences start from the same state.
"""

from __future__ import annotations

import numpy as np

TRUNCATION = 3.0  # in standard deviations, as the release's trunc_normal_(a=-3σ, b=3σ)


def initial_state(hidden: int, std: float, positions: np.ndarray, seed: int | None) -> np.ndarray:
    """``[len(positions), hidden]`` float32: the truncated-normal state of each position under
    ``seed``, or zeros when ``seed`` is None (the deterministic start)."""
    positions = np.asarray(positions, dtype=np.int64).reshape(-1)
    out = np.zeros((positions.size, hidden), dtype=np.float32)
    if seed is None or std == 0.0:
        return out
    if seed < 0:
        raise ValueError(f"the state seed must be >= 0, got {seed}")
    for row, position in enumerate(positions):
        if position < 0:
            raise ValueError(f"positions must be >= 0, got {position}")
        rng = np.random.Generator(np.random.Philox(key=[int(seed), int(position)]))
        z = rng.standard_normal(hidden)
        # Redraw what falls outside the truncation: the exact truncated normal, no clipping mass.
        outside = np.abs(z) > TRUNCATION
        while outside.any():
            z[outside] = rng.standard_normal(int(outside.sum()))
            outside = np.abs(z) > TRUNCATION
        out[row] = (z * std).astype(np.float32)
    return out
