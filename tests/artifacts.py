"""Cached tiny checkpoints and exported artifacts shared by the exporter and runtime tests."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
import tempfile

import torch

from loopcast.config import PRESETS, ModelConfig
from loopcast.exporter.checkpoint import load_checkpoint
from loopcast.exporter.export import ExportOptions, export_checkpoint
from loopcast.exporter.random_checkpoint import write_random_checkpoint

# Random weights with std 0.02 give near-uniform logits; 0.15 keeps argmax margins clear.
TINY = {
    "ouro-r3": PRESETS["tiny-ouro"],
    "ouro-r2-gqa": PRESETS["tiny-ouro"].replace(num_loops=2, num_kv_heads=2, vocab_size=89),
    "ouro-r4-1layer": PRESETS["tiny-ouro"].replace(num_loops=4, num_layers=1, max_position_embeddings=64),
    "llama-tied-gqa": PRESETS["tiny-llama"],
    "llama-untied": PRESETS["tiny-llama"].replace(tie_word_embeddings=False, num_kv_heads=4),
}
_ROOT = Path(tempfile.mkdtemp(prefix="loopcast-tests-"))


@lru_cache(maxsize=None)
def checkpoint(name: str, seed: int = 0) -> Path:
    return write_random_checkpoint(TINY[name], _ROOT / f"ckpt-{name}-{seed}", seed=seed, std=0.15)


@lru_cache(maxsize=None)
def reference(name: str):
    path = Path(name) if name == "demo" else checkpoint(name)
    return load_checkpoint("demo" if name == "demo" else path, dtype=torch.float32)


def artifact(name: str, dtype: str = "fp32", verify_width: int = 5, draft_depth: int | None = None,
             max_length: int | None = None, batch_invariant: bool = False) -> Path:
    return _artifact(name, dtype, verify_width, draft_depth, max_length, batch_invariant)


@lru_cache(maxsize=None)
def _artifact(name: str, dtype: str, verify_width: int, draft_depth: int | None, max_length: int | None,
              batch_invariant: bool) -> Path:
    source = "demo" if name == "demo" else checkpoint(name)
    out = _ROOT / f"art-{name}-{dtype}-{verify_width}-{draft_depth}-{max_length}-{int(batch_invariant)}"
    export_checkpoint(source, out, ExportOptions(dtype, max_length or (512 if name == "demo" else None),
                                                 verify_width, draft_depth, batch_invariant))
    return out


def config_of(name: str) -> ModelConfig:
    return reference(name).config
