"""The artifact's single weights file, in the graphs' layout (fused, transposed for MatMul).

It is a valid safetensors file (readable by the `safetensors` library and mmap-able by numpy)
whose tensors every ONNX graph references as external data by byte offset, so the weights are
stored once however many graph kinds an artifact has. It is written tensor by tensor from
the checkpoint, which bounds the export's peak memory to about one copy of the weights.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from loopcast.config import ModelConfig
from loopcast.exporter.reference import rotary_cos_sin

_SAFETENSORS_DTYPE = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}
_ALIGN = 64  # keeps every tensor's data aligned for vectorised loads after mmap


@dataclass(frozen=True)
class StoredTensor:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int          # absolute byte offset in the file
    length: int


def layer_prefixes(config: ModelConfig) -> list[tuple[str, str]]:
    """(artifact prefix, checkpoint prefix) of every decoder layer."""
    out = [(f"layers.{i}", f"model.layers.{i}") for i in range(config.num_layers)]
    out += [(f"prelude_layers.{i}", f"model.prelude_layers.{i}") for i in range(config.num_prelude_layers)]
    out += [(f"coda_layers.{i}", f"model.coda_layers.{i}") for i in range(config.num_coda_layers)]
    return out


def artifact_tensors(config: ModelConfig, max_length: int,
                     read: Callable[[str], torch.Tensor]) -> list[tuple[str, tuple[int, ...], Callable[[], torch.Tensor]]]:
    """Names, shapes and producers of every tensor the graphs use, in file order."""
    h, d = config.hidden_size, config.head_dim
    qkv = (config.num_heads + 2 * config.num_kv_heads) * d
    specs: list[tuple[str, tuple[int, ...], Callable[[], torch.Tensor]]] = [
        ("embed_tokens.weight", (config.vocab_size, h), lambda: read("model.embed_tokens.weight")),
    ]
    norms = ["input_layernorm", "post_attention_layernorm"]
    if config.sandwich_norm:
        norms += ["input_layernorm_2", "post_attention_layernorm_2"]
    for ours, theirs in layer_prefixes(config):
        for norm in norms:
            specs.append((f"{ours}.{norm}.weight", (h,), lambda t=theirs, n=norm: read(f"{t}.{n}.weight")))
        specs += [
            # [H, Q+K+V]: one MatMul produces the packed QKV that GroupQueryAttention takes.
            (f"{ours}.qkv_proj.weight_T", (h, qkv), lambda t=theirs: torch.cat(
                [read(f"{t}.self_attn.{p}_proj.weight") for p in "qkv"], dim=0).T),
            (f"{ours}.o_proj.weight_T", (config.num_heads * d, h),
             lambda t=theirs: read(f"{t}.self_attn.o_proj.weight").T),
            (f"{ours}.gate_up_proj.weight_T", (h, 2 * config.intermediate_size), lambda t=theirs: torch.cat(
                [read(f"{t}.mlp.gate_proj.weight"), read(f"{t}.mlp.up_proj.weight")], dim=0).T),
            (f"{ours}.down_proj.weight_T", (config.intermediate_size, h),
             lambda t=theirs: read(f"{t}.mlp.down_proj.weight").T),
        ]
    specs.append(("norm.weight", (h,), lambda: read("model.norm.weight")))
    if not config.tie_word_embeddings:
        specs.append(("lm_head.weight_T", (h, config.vocab_size), lambda: read("lm_head.weight").T))
    positions = torch.arange(max_length)
    specs += [
        ("rotary.cos_SD2", (max_length, d // 2), lambda: rotary_cos_sin(config, positions, torch.float32)[0][:, : d // 2]),
        ("rotary.sin_SD2", (max_length, d // 2), lambda: rotary_cos_sin(config, positions, torch.float32)[1][:, : d // 2]),
    ]
    return specs


def write_weights(path: Path, config: ModelConfig, max_length: int, dtype: torch.dtype,
                  read: Callable[[str], torch.Tensor], progress: Callable[[int], None] | None = None
                  ) -> dict[str, StoredTensor]:
    """Stream the artifact tensors into a safetensors file; return where each one lives."""
    specs = artifact_tensors(config, max_length, read)
    itemsize = torch.tensor([], dtype=dtype).element_size()
    header: dict[str, dict] = {}
    cursor = 0
    for name, shape, _ in specs:
        cursor = -(-cursor // _ALIGN) * _ALIGN
        nbytes = math.prod(shape) * itemsize
        header[name] = {"dtype": _SAFETENSORS_DTYPE[dtype], "shape": list(shape),
                        "data_offsets": [cursor, cursor + nbytes]}
        cursor += nbytes
    header["__metadata__"] = {"format": "loopcast-artifact"}
    header_bytes = json.dumps(header, separators=(",", ":")).encode()
    header_bytes += b" " * (-(8 + len(header_bytes)) % _ALIGN)  # data section starts aligned
    base = 8 + len(header_bytes)
    stored: dict[str, StoredTensor] = {}
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(header_bytes)))
        f.write(header_bytes)
        for name, shape, produce in specs:
            start, stop = header[name]["data_offsets"]
            tensor = produce().to(dtype).contiguous()
            if tuple(tensor.shape) != shape:
                raise AssertionError(f"{name}: produced {tuple(tensor.shape)}, expected {shape}")
            f.seek(base + start)
            f.write(tensor.view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
            stored[name] = StoredTensor(name, dtype, shape, base + start, stop - start)
            if progress:
                progress(1)
    return stored


def checkpoint_reader(files: dict[str, Path]) -> tuple[Callable[[str], torch.Tensor], Callable[[], None]]:
    """A ``read(name)`` over open safetensors shards (mmap'd) and a ``close()``."""
    handles: dict[Path, object] = {}

    def read(name: str) -> torch.Tensor:
        path = files[name]
        if path not in handles:
            handles[path] = safe_open(path, framework="pt").__enter__()
        return handles[path].get_tensor(name)

    def close() -> None:
        for handle in handles.values():
            handle.__exit__(None, None, None)
        handles.clear()

    return read, close



def read_stored(path: Path) -> dict[str, StoredTensor]:
    """Where each tensor of an artifact's weights file lives (from its safetensors header)."""
    inverse = {v: k for k, v in _SAFETENSORS_DTYPE.items()}
    with open(path, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(size))
    base = 8 + size
    return {name: StoredTensor(name, inverse[h["dtype"]], tuple(h["shape"]), base + h["data_offsets"][0],
                               h["data_offsets"][1] - h["data_offsets"][0])
            for name, h in header.items() if name != "__metadata__"}
