"""Cached tiny checkpoints and exported artifacts shared by the exporter and runtime tests."""

from __future__ import annotations

import tempfile
from functools import cache
from pathlib import Path

import torch
from loopcast.exporter.checkpoint import load_checkpoint
from loopcast.exporter.export import ExportOptions, export_checkpoint
from loopcast.exporter.random_checkpoint import write_random_checkpoint

from loopcast.config import PRESETS, ModelConfig

# Random weights with std 0.02 give near-uniform logits; 0.15 keeps argmax margins clear.
TINY = {
    "ouro-r3": PRESETS["tiny-ouro"],
    "ouro-r2-gqa": PRESETS["tiny-ouro"].replace(num_loops=2, num_kv_heads=2, vocab_size=89),
    "ouro-r4-1layer": PRESETS["tiny-ouro"].replace(num_loops=4, num_layers=1, max_position_embeddings=64),
    "llama-tied-gqa": PRESETS["tiny-llama"],
    "llama-untied": PRESETS["tiny-llama"].replace(tie_word_embeddings=False, num_kv_heads=4),
}
_ROOT = Path(tempfile.mkdtemp(prefix="loopcast-tests-"))


@cache
def checkpoint(name: str, seed: int = 0) -> Path:
    return write_random_checkpoint(TINY[name], _ROOT / f"ckpt-{name}-{seed}", seed=seed, std=0.15)


@cache
def reference(name: str):
    path = Path(name) if name == "demo" else checkpoint(name)
    return load_checkpoint("demo" if name == "demo" else path, dtype=torch.float32)


def artifact(
    name: str,
    dtype: str = "fp32",
    verify_width: int = 5,
    draft_depth: int | None = None,
    max_length: int | None = None,
    batch_invariant: bool = False,
    ops: str = "auto",
    max_batch: int | None = None,
    tree_verify: bool = False,
) -> Path:
    return _artifact(
        name, dtype, verify_width, draft_depth, max_length, batch_invariant, ops, max_batch, tree_verify
    )


@cache
def _artifact(
    name: str,
    dtype: str,
    verify_width: int,
    draft_depth: int | None,
    max_length: int | None,
    batch_invariant: bool,
    ops: str,
    max_batch: int | None = None,
    tree_verify: bool = False,
) -> Path:
    source = "demo" if name == "demo" else checkpoint(name)
    out = _ROOT / f"art-{name}-{dtype}-{verify_width}-{draft_depth}-{max_length}-{int(batch_invariant)}-{ops}"
    out = out.with_name(out.name + (f"-b{max_batch}" if max_batch else "") + ("-tree" if tree_verify else ""))
    export_checkpoint(
        source,
        out,
        ExportOptions(
            dtype,
            max_length or (512 if name == "demo" else None),
            verify_width,
            draft_depth,
            batch_invariant,
            ops,
            max_batch=max_batch,
            tree_verify=tree_verify,
        ),
    )
    return out


def require_exact_cpu_artifacts() -> None:
    """Skip unless default fp32 artifacts are exact on the CPU, i.e. the custom-op library (its
    row-invariant attention op) can be built here; without it they are stock graphs, on which
    speculation is refused as inexact. CI (LOOPCAST_REQUIRE_C=1) fails instead of skipping."""
    import os
    import shutil

    import pytest
    from loopcast.custom_ops.build import find_ort_include

    if find_ort_include() is None or shutil.which("c++") is None:
        if os.environ.get("LOOPCAST_REQUIRE_C") == "1":
            pytest.fail("ORT C++ headers or a C++ compiler missing")
        pytest.skip(
            "exact CPU artifacts need the custom-op library: ORT C++ headers or a C++ compiler "
            "missing (tools/c_generate/fetch_deps.sh)"
        )


def config_of(name: str) -> ModelConfig:
    return reference(name).config
