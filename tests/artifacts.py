"""Cached tiny checkpoints and exported artifacts shared by the exporter and runtime tests.

They are written once per test session under ``scratch_root()``, a directory in pytest's
session temp dir that tests/conftest.py's isolation fixture names (``$LOOPCAST_TEST_SCRATCH``).
"""

from __future__ import annotations

import os
from functools import cache
from pathlib import Path

import torch
from loopcast.exporter.checkpoint import load_checkpoint
from loopcast.exporter.export import ExportOptions, export_checkpoint
from loopcast.exporter.random_checkpoint import write_random_checkpoint

from loopcast.config import ModelConfig
from tests.tiny_models import ARTIFACT_CHECKPOINT_STD, ARTIFACT_MODELS, TINY_MODELS

# The shapes a test "over every tiny artifact" runs on (any name of TINY_MODELS exports).
TINY = {name: TINY_MODELS[name] for name in ARTIFACT_MODELS}
SCRATCH_ENV = "LOOPCAST_TEST_SCRATCH"


def scratch_root() -> Path:
    """The session's directory for cached test files (set by tests/conftest.py)."""
    try:
        return Path(os.environ[SCRATCH_ENV])
    except KeyError:
        raise RuntimeError(
            f"${SCRATCH_ENV} unset: tests/conftest.py's isolation fixture did not run"
        ) from None


def checkpoint(name: str, seed: int = 0) -> Path:
    return _checkpoint(name, seed)  # one cache key however the seed is spelled


@cache
def _checkpoint(name: str, seed: int) -> Path:
    return write_random_checkpoint(
        TINY_MODELS[name], scratch_root() / f"ckpt-{name}-{seed}", seed=seed, std=ARTIFACT_CHECKPOINT_STD
    )


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
    pad_heads_to: int | None = None,
) -> Path:
    return _artifact(
        name,
        dtype,
        verify_width,
        draft_depth,
        max_length,
        batch_invariant,
        ops,
        max_batch,
        tree_verify,
        pad_heads_to,
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
    pad_heads_to: int | None = None,
) -> Path:
    source = "demo" if name == "demo" else checkpoint(name)
    out = (
        scratch_root()
        / f"art-{name}-{dtype}-{verify_width}-{draft_depth}-{max_length}-{int(batch_invariant)}-{ops}"
    )
    out = out.with_name(out.name + (f"-b{max_batch}" if max_batch else "") + ("-tree" if tree_verify else ""))
    out = out.with_name(out.name + (f"-pad{pad_heads_to}" if pad_heads_to else ""))
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
            pad_heads_to=pad_heads_to,
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


# -- quantized artifacts (loopcast/quant.py) --------------------------------------------------------


@cache
def quantized_artifact(
    name: str,
    scheme,
    ops: str = "auto",
    max_batch: int | None = None,
    tree_verify: bool = False,
    dtype: str = "fp32",
) -> Path:
    """``name``'s checkpoint (or ``demo``) exported under the QuantScheme ``scheme`` (activations
    in ``dtype``: fp16/bf16 need ``ops="loopcast"``)."""
    out = scratch_root() / (
        f"qart-{name}-{dtype}-{ops}-" + "-".join(f"{v}" for v in scheme.to_dict().values())
    )
    out = out.with_name(out.name + (f"-b{max_batch}" if max_batch else "") + ("-tree" if tree_verify else ""))
    source = "demo" if name == "demo" else checkpoint(name)
    options = ExportOptions(
        dtype,
        max_length=512 if name == "demo" else None,
        ops=ops,
        max_batch=max_batch,
        tree_verify=tree_verify,
        quantization=scheme,
    )
    export_checkpoint(source, out, options)
    return out


@cache
def dequantized_reference(name: str, scheme):
    """The torch reference of ``name`` on the weights ``scheme`` stands for: every quantized matrix
    replaced by its dequantized RTN round trip (per output row, blocked along K, so quantizing
    q|k|v fused or one by one is the same); a quantized tied head becomes an untied head holding
    the dequantized embedding, the Gather keeping the float one unless the embedding is quantized
    too (then its rows are their own round trip)."""
    import json

    from loopcast.exporter.quantize import dequantize, quantize
    from safetensors.numpy import load_file, save_file

    from loopcast.quant import WeightFormat

    src = checkpoint(name)
    out = scratch_root() / ("deq-" + name + "-" + "-".join(f"{v}" for v in scheme.to_dict().values()))
    out.mkdir(exist_ok=True)
    tensors = {}
    for f in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(f))
    config = json.loads((src / "config.json").read_text())

    def roundtrip(w, fmt: WeightFormat):
        qt = quantize(w, fmt.bits, scheme.block_size, scheme.symmetric)
        return dequantize(qt).astype(w.dtype)

    projections = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    for key in list(tensors):
        if key.endswith(".weight") and key.split(".")[-2] in projections:
            tensors[key] = roundtrip(tensors[key], scheme.layers)
    if scheme.head is not WeightFormat.FLOAT:
        if config.get("tie_word_embeddings"):
            config["tie_word_embeddings"] = False
            tensors["lm_head.weight"] = roundtrip(tensors["model.embed_tokens.weight"], scheme.head)
        else:
            tensors["lm_head.weight"] = roundtrip(tensors["lm_head.weight"], scheme.head)
    if scheme.embedding is not WeightFormat.FLOAT:  # after the tied head took the float rows
        tensors["model.embed_tokens.weight"] = roundtrip(
            tensors["model.embed_tokens.weight"], scheme.embedding
        )
    save_file(tensors, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(config))
    return load_checkpoint(out, dtype=torch.float32)


@cache
def _huginn_checkpoint(out: Path) -> Path:
    """Written once per path: every op set's export of one max length reads the same weights."""
    from loopcast.presets import PRESETS

    return write_random_checkpoint(PRESETS["tiny-huginn"], out, seed=4, std=0.1)


@cache
def huginn(
    max_length: int = 48, ops: str = "auto", pad_heads_to: int | None = None, max_batch: int | None = None
) -> tuple[Path, Path]:
    """The tiny-huginn checkpoint (std 0.1: the random recurrence is contractive, as the trained
    one is; tests/exporter/test_huginn_reference.py) and its fp32 export with ``ops`` (default:
    loopcast attention where the op library is built; ``pad_heads_to``: heads stored padded;
    ``max_batch``: with the batched kinds), shared by the recurrent-depth runtime tests."""

    root = scratch_root() / f"huginn-{max_length}"
    ckpt = _huginn_checkpoint(root / "ckpt")
    art = root / (
        ("art" if ops == "auto" else f"art-{ops}")
        + (f"-pad{pad_heads_to}" if pad_heads_to else "")
        + (f"-batch{max_batch}" if max_batch else "")
    )
    options = ExportOptions(max_length=max_length, ops=ops, pad_heads_to=pad_heads_to, max_batch=max_batch)
    export_checkpoint(ckpt, art, options)
    return ckpt, art
