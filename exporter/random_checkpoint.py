"""Random-weight checkpoints for any config (tiny ones for tests, Ouro-1.4B shapes for benches).

Tensors are generated one at a time and streamed into shards, so writing a 1.4B-parameter
checkpoint never holds more than one shard in memory.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import torch
from loopcast.exporter.checkpoint import expected_shapes, write_checkpoint

from loopcast.config import ModelConfig
from loopcast.errors import ConfigError


def random_tensors(
    config: ModelConfig, seed: int, std: float = 0.02, dtype: torch.dtype = torch.float32
) -> Iterator[tuple[str, torch.Tensor]]:
    """Deterministic per-tensor init: normal(0, std) matrices and projection biases (so that a
    bias the export dropped would show), unit norms, zero exit-gate bias."""
    for index, (name, shape) in enumerate(sorted(expected_shapes(config).items())):
        if "norm" in name or name.endswith("ln_f.weight"):
            tensor = torch.ones(shape)
        elif name.endswith("early_exit_gate.bias"):
            tensor = torch.zeros(shape)
        else:
            generator = torch.Generator().manual_seed(seed * SEED_STRIDE + index)
            tensor = torch.randn(shape, generator=generator) * std
        yield name, tensor.to(dtype)


# Tensor i's generator is seeded with seed * SEED_STRIDE + i, which torch takes as a 64-bit value.
SEED_STRIDE = 100_003
MAX_SEED = 2**47 - 1  # MAX_SEED * SEED_STRIDE + any tensor count stays below 2**64


def check_seed(seed: object) -> int:
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= MAX_SEED:
        raise ConfigError(f"seed must be an integer in [0, {MAX_SEED}], got {seed!r:.40}")
    return seed


def write_random_checkpoint(
    config: ModelConfig,
    out_dir: str | os.PathLike,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    std: float = 0.02,
    max_shard_bytes: int | None = None,
) -> Path:
    check_seed(seed)
    return write_checkpoint(
        config, lambda: random_tensors(config, seed, std, dtype), out_dir, dtype, max_shard_bytes
    )
