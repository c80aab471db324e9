"""Read and write Hugging Face checkpoint directories (config.json + safetensors).

Single-file (``model.safetensors``) and sharded (``model.safetensors.index.json``) layouts,
upstream tensor names, fp32/fp16/bf16. Every tensor is checked by name, shape and dtype from
the safetensors headers before anything is built, so a bad checkpoint fails with the tensor
named. Reading and validating need no torch (export uses them); building the torch reference
(``load_checkpoint``) and writing checkpoints import torch when called (the ``[torch]`` extra).
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from loopcast.exporter.hub_cache import looks_like_hub_id, resolve_hub_id

from loopcast.config import ModelConfig, load_config
from loopcast.errors import CheckpointError
from loopcast.safetensors_file import (
    FLOAT_DTYPES,
    NAME_OF_CODE,
    SafetensorsFormatError,
    TensorEntry,
    read_header,
)

if TYPE_CHECKING:  # torch is needed only by the reference-model helpers below (the [torch] extra)
    import torch
    from loopcast.exporter.reference import LoopedLM
    from loopcast.exporter.reference_huginn import RecurrentLM

DTYPE_NAMES = {
    "fp32": "float32",
    "fp16": "float16",
    "bf16": "bfloat16",
    "float32": "float32",
    "float16": "float16",
    "bfloat16": "bfloat16",
}
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# Upstream checkpoints may carry derived buffers we recompute.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def __getattr__(name: str) -> Any:
    # ``DTYPES`` (option name → torch dtype) for torch-side callers, built only when asked for.
    if name == "DTYPES":
        from loopcast.torch_extra import require_torch

        torch = require_torch("torch dtypes")
        return {k: getattr(torch, v) for k, v in DTYPE_NAMES.items()}
    raise AttributeError(name)


def resolve_checkpoint(path_or_name: str | os.PathLike) -> Path:
    """``demo`` names the shipped demo model; an existing directory is used as is; an
    ``org/name`` id is looked up in the local Hugging Face cache (offline)."""
    if str(path_or_name) == "demo":
        from loopcast.demo_checkpoint import demo_checkpoint_dir

        return demo_checkpoint_dir()
    path = Path(path_or_name)
    if path.is_dir():
        return path
    if looks_like_hub_id(str(path_or_name)):
        return resolve_hub_id(str(path_or_name))
    raise CheckpointError(f"{path}: checkpoint directory not found")


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a checkpoint of this config must hold, with its shape (upstream names).

    Written out from the architecture so that reading a checkpoint needs no torch; a test
    checks it against the reference model's ``state_dict()``.
    """
    if config.recurrent_depth:
        return _recurrent_shapes(config)
    h, d, inter = config.hidden_size, config.head_dim, config.intermediate_size
    q, kv = config.num_heads * d, config.num_kv_heads * d
    layer: dict[str, tuple[int, ...]] = {
        "self_attn.q_proj.weight": (q, h),
        "self_attn.k_proj.weight": (kv, h),
        "self_attn.v_proj.weight": (kv, h),
        "self_attn.o_proj.weight": (h, q),
        "mlp.gate_proj.weight": (inter, h),
        "mlp.up_proj.weight": (inter, h),
        "mlp.down_proj.weight": (h, inter),
        "input_layernorm.weight": (h,),
        "post_attention_layernorm.weight": (h,),
    }
    if config.qkv_bias:
        layer |= {
            "self_attn.q_proj.bias": (q,),
            "self_attn.k_proj.bias": (kv,),
            "self_attn.v_proj.bias": (kv,),
        }
    if config.o_bias:
        layer["self_attn.o_proj.bias"] = (h,)
    if config.mlp_bias:
        layer |= {"mlp.gate_proj.bias": (inter,), "mlp.up_proj.bias": (inter,), "mlp.down_proj.bias": (h,)}
    if config.sandwich_norm:
        layer |= {"input_layernorm_2.weight": (h,), "post_attention_layernorm_2.weight": (h,)}
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (config.vocab_size, h),
        "model.norm.weight": (h,),
    }
    for stack, count in (
        ("layers", config.num_layers),
        ("prelude_layers", config.num_prelude_layers),
        ("coda_layers", config.num_coda_layers),
    ):
        for i in range(count):
            shapes |= {f"model.{stack}.{i}.{name}": shape for name, shape in layer.items()}
    if config.has_exit_gate:
        shapes |= {"model.early_exit_gate.weight": (1, h), "model.early_exit_gate.bias": (1,)}
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, h)
    return dict(sorted(shapes.items()))


def _recurrent_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Huginn/Raven's tensors (its modeling code's ``transformer.`` names)."""
    h, d, inter = config.hidden_size, config.head_dim, config.intermediate_size
    block: dict[str, tuple[int, ...]] = {
        "attn.Wqkv.weight": ((config.num_heads + 2 * config.num_kv_heads) * d, h),
        "attn.proj.weight": (h, config.num_heads * d),
        "mlp.fc.weight": (2 * inter, h),
        "mlp.proj.weight": (h, inter),
        **{f"norm_{i}.weight": (h,) for i in range(1, 5)},
    }
    if config.qkv_bias:
        block["attn.qk_bias"] = (2, 1, config.num_heads, d)
    shapes: dict[str, tuple[int, ...]] = {
        "transformer.wte.weight": (config.vocab_size, h),
        "transformer.adapter.weight": (h, 2 * h),
        "transformer.ln_f.weight": (h,),
    }
    for stack, count in (
        ("prelude", config.num_prelude_layers),
        ("core_block", config.num_layers),
        ("coda", config.num_coda_layers),
    ):
        for i in range(count):
            shapes |= {f"transformer.{stack}.{i}.{name}": shape for name, shape in block.items()}
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, h)
    return dict(sorted(shapes.items()))


def ignored_tensor(config: ModelConfig, name: str) -> bool:
    """Tensors a checkpoint may carry that loopcast recomputes or shares: rotary tables
    (``rotary_emb.inv_freq``; Huginn's ``freqs_cis`` buffer) and, for a tied Huginn head, the
    saved copy of the embedding (``lm_head.weight``)."""
    if name.endswith(IGNORED_SUFFIXES):
        return True
    return config.recurrent_depth and (
        name == "freqs_cis" or (name == "lm_head.weight" and config.tie_word_embeddings)
    )


def _header(path: Path) -> dict[str, TensorEntry]:
    try:
        return read_header(path)
    except (OSError, SafetensorsFormatError) as exc:
        raise CheckpointError(f"{path}: not a readable safetensors file ({exc})") from None


def _weight_files(checkpoint_dir: Path) -> dict[str, Path]:
    """Map each tensor name to the safetensors file that holds it."""
    index = checkpoint_dir / INDEX_FILE
    single = checkpoint_dir / SINGLE_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise CheckpointError(f"{index}: malformed index ({exc})") from None
        files = {name: checkpoint_dir / fname for name, fname in weight_map.items()}
        for fname in sorted(set(files.values())):
            if not fname.is_file():
                raise CheckpointError(f"{fname}: shard named in {INDEX_FILE} is missing")
        return files
    if single.is_file():
        return {name: single for name in _header(single)}
    raise CheckpointError(f"{checkpoint_dir}: no weights ({SINGLE_FILE} or {INDEX_FILE}) found")


def validate_checkpoint(checkpoint_dir: Path, config: ModelConfig) -> dict[str, Path]:
    """Check every tensor's presence, name, shape and dtype (headers only); return name → file."""
    files = _weight_files(checkpoint_dir)
    files = {n: f for n, f in files.items() if not ignored_tensor(config, n)}
    shapes = expected_shapes(config)
    missing = sorted(set(shapes) - set(files))
    if missing:
        raise CheckpointError(
            f"{checkpoint_dir}: tensor {missing[0]} is missing"
            + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
        )
    unexpected = sorted(set(files) - set(shapes))
    if unexpected:
        raise CheckpointError(
            f"{checkpoint_dir}: unexpected tensor {unexpected[0]} for a {config.model_type} config"
        )
    for fname, names in _by_file(files).items():
        header = _header(fname)
        for name in names:
            if name not in header:
                raise CheckpointError(
                    f"{fname.name}: tensor {name} (named in {INDEX_FILE}) is not in the file"
                )
            entry = header[name]
            if entry.shape != shapes[name]:
                raise CheckpointError(
                    f"{fname.name}: tensor {name} has shape {list(entry.shape)}, "
                    f"expected {list(shapes[name])}"
                )
            if entry.dtype not in FLOAT_DTYPES:
                raise CheckpointError(
                    f"{fname.name}: tensor {name} has dtype {entry.dtype}, expected a floating-point dtype"
                )
    return files


def _by_file(files: dict[str, Path]) -> dict[Path, list[str]]:
    by_file: dict[Path, list[str]] = {}
    for name, fname in sorted(files.items()):
        by_file.setdefault(fname, []).append(name)
    return dict(sorted(by_file.items()))


def checkpoint_dtype(checkpoint_dir: Path) -> str:
    """The dtype the weights are stored in (of the first tensor): float32, float16 or bfloat16."""
    files = _weight_files(checkpoint_dir)
    name, fname = sorted(files.items())[0]
    code = _header(fname)[name].dtype
    return NAME_OF_CODE.get(code, code)


def iter_checkpoint_tensors(
    checkpoint_dir: Path, config: ModelConfig, dtype: torch.dtype | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` (torch) one at a time after validating names, shapes and dtypes."""
    from safetensors import safe_open

    files = validate_checkpoint(checkpoint_dir, config)
    for fname, names in _by_file(files).items():
        with safe_open(fname, framework="pt") as f:
            for name in names:
                tensor = f.get_tensor(name)
                yield name, tensor if dtype is None else tensor.to(dtype)


def load_checkpoint(
    path_or_name: str | os.PathLike, dtype: torch.dtype | None = None
) -> LoopedLM | RecurrentLM:
    """Build the reference model from a checkpoint directory (or ``demo``).

    ``dtype`` defaults to the stored dtype. The model is created on the meta device and
    filled tensor by tensor, so only one copy of the weights is ever held. A Huginn checkpoint
    gives ``exporter/reference_huginn.RecurrentLM`` (see ``load_recurrent_checkpoint``).
    """
    from loopcast.torch_extra import require_torch

    torch = require_torch("the torch reference model")
    from loopcast.exporter.reference import LoopedLM
    from loopcast.exporter.reference_huginn import RecurrentLM

    checkpoint_dir = resolve_checkpoint(path_or_name)
    config = load_config(checkpoint_dir)
    with torch.device("meta"):
        model = RecurrentLM(config) if config.recurrent_depth else LoopedLM(config)
    state = dict(iter_checkpoint_tensors(checkpoint_dir, config, dtype))
    model.load_state_dict(state, assign=True)
    return model.eval()


def save_checkpoint(
    model: LoopedLM,
    out_dir: str | os.PathLike,
    dtype: torch.dtype | None = None,
    max_shard_bytes: int | None = None,
) -> Path:
    """Write ``model`` as a Hugging Face directory (sharded above ``max_shard_bytes``)."""
    tensors = {n: t.detach().contiguous() for n, t in model.state_dict().items()}
    return write_checkpoint(model.config, lambda: iter(tensors.items()), out_dir, dtype, max_shard_bytes)


def write_checkpoint(
    config: ModelConfig,
    tensors: Callable[[], Iterator[tuple[str, torch.Tensor]]],
    out_dir: str | os.PathLike,
    dtype: torch.dtype | None = None,
    max_shard_bytes: int | None = None,
) -> Path:
    """Stream ``(name, tensor)`` pairs into safetensors shards; at most one shard is held.

    The directory is written next to its destination and renamed into place, so a failed
    write leaves nothing that looks like a checkpoint.
    """

    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise CheckpointError(f"{out}: output path exists and is not an empty directory")
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        weight_map, shards, shard, shard_bytes = {}, [], {}, 0
        stored_dtype = dtype
        for name, tensor in tensors():
            tensor = (tensor if dtype is None else tensor.to(dtype)).contiguous()
            stored_dtype = stored_dtype or tensor.dtype
            nbytes = tensor.numel() * tensor.element_size()
            if max_shard_bytes and shard and shard_bytes + nbytes > max_shard_bytes:
                shards.append(_flush_shard(staging, len(shards), shard, weight_map, out))
                shard, shard_bytes = {}, 0
            shard[name] = tensor
            shard_bytes += nbytes
        if not max_shard_bytes:
            _save(shard, staging / SINGLE_FILE, out)
        else:
            shards.append(_flush_shard(staging, len(shards), shard, weight_map, out))
            total = len(shards)
            for i, tmp in enumerate(shards):
                tmp.rename(staging / f"model-{i + 1:05d}-of-{total:05d}.safetensors")
            weight_map = {
                n: f"model-{int(i) + 1:05d}-of-{total:05d}.safetensors" for n, i in weight_map.items()
            }
            (staging / INDEX_FILE).write_text(
                json.dumps({"metadata": {}, "weight_map": weight_map}, indent=1)
            )
        hf = config.replace(torch_dtype=str(stored_dtype).removeprefix("torch.")).to_hf_dict()
        (staging / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
        if out.exists():
            out.rmdir()
        staging.rename(out)
    except BaseException:
        _remove_tree(staging)
        raise
    return out


def _save(tensors: dict[str, torch.Tensor], path: Path, out: Path) -> None:
    """safetensors' writer reports a full disk or a file-size limit as its own error type: the
    user's destination, not a bug, so it is a CheckpointError naming the destination."""
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    try:
        save_file(tensors, path, metadata={"format": "pt"})
    except SafetensorError as exc:
        raise CheckpointError(f"{out}: cannot write the checkpoint ({str(exc)[:200]})") from None


def _flush_shard(
    staging: Path, index: int, shard: dict[str, torch.Tensor], weight_map: dict, out: Path
) -> Path:
    path = staging / f"shard-{index}.tmp"
    _save(shard, path, out)
    for name in shard:
        weight_map[name] = str(index)
    return path


def _remove_tree(path: Path) -> None:
    if not path.exists():
        return
    for child in sorted(path.rglob("*"), reverse=True):
        child.rmdir() if child.is_dir() else child.unlink()
    path.rmdir()
