"""The artifact's single weights file, in the graphs' layout (fused, transposed for MatMul).

It is a valid safetensors file (readable by the `safetensors` library and mmap-able by numpy)
whose tensors every ONNX graph references as external data by byte offset, so the weights are
stored once however many graph kinds an artifact has. It is written tensor by tensor from
the memory-mapped checkpoint with numpy (no torch), which bounds the export's working memory
to about two converted tensors besides the page cache.
"""

from __future__ import annotations

import collections
import json
import math
import os
import struct
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import ml_dtypes
import numpy as np
from loopcast.exporter.head_padding import HeadPadding
from loopcast.exporter.quantize import Quantized

from loopcast.config import ModelConfig
from loopcast.quant import EMBEDDING, QuantLinear, QuantScheme, quantized_linears
from loopcast.safetensors_file import MappedFile

# Artifact dtype name → (numpy dtype, safetensors code). Conversions round to nearest even,
# as torch's ``.to()`` does, so an export is bit-identical to one made through torch.
NUMPY_DTYPES = {
    "fp32": (np.dtype(np.float32), "F32"),
    "fp16": (np.dtype(np.float16), "F16"),
    "bf16": (np.dtype(ml_dtypes.bfloat16), "BF16"),
    "uint8": (np.dtype(np.uint8), "U8"),  # quantized weights and zero points (exporter/quantize.py)
}
_DTYPE_OF_CODE = {code: name for name, (_, code) in NUMPY_DTYPES.items()}
_ALIGN = 64  # keeps every tensor's data aligned for vectorised loads after mmap

Read = Callable[[str], np.ndarray]
# The MatMulNBits tensors of one quantized matrix made from blocks the source already holds (a
# GGUF's Q4_0/Q4_1/Q8_0: exporter/gguf_source.py), given the upstream matrices fused into it;
# without one, the float reads are RTN-quantized (exporter/quantize.py).
Native = Callable[[list[str], QuantLinear], Quantized]
# (name, shape, producer, stored dtype name or None for the artifact's dtype)
Spec = tuple[str, tuple[int, ...], Callable[[], np.ndarray], str | None]


@dataclass(frozen=True)
class StoredTensor:
    name: str
    dtype: str  # fp32, fp16, bf16 or uint8 (quantized)
    shape: tuple[int, ...]
    offset: int  # absolute byte offset in the file
    length: int


def layer_prefixes(config: ModelConfig) -> list[tuple[str, str]]:
    """(artifact prefix, checkpoint prefix) of every decoder layer."""
    out = [(f"layers.{i}", f"model.layers.{i}") for i in range(config.num_layers)]
    out += [(f"prelude_layers.{i}", f"model.prelude_layers.{i}") for i in range(config.num_prelude_layers)]
    out += [(f"coda_layers.{i}", f"model.coda_layers.{i}") for i in range(config.num_coda_layers)]
    return out


_T_ROWS = 16  # source rows per transposed chunk (see _cat_t)


def _cat_t(read: Read, names: list[str], dtype: np.dtype | None = None) -> Callable[[], np.ndarray]:
    """[N_i, K] weights stacked on N and transposed to [K, sum N_i] for ``x @ W``, in ``dtype``.

    Each weight is transposed straight into its columns of one buffer (no concatenation first),
    16 source rows at a time, converting as it goes: numpy's whole-matrix ``.T`` copy strides
    across all of memory for every output row, and chunks that stay in cache are 1.2-5x faster
    (measured: fp16 [5632, 2048] 215 -> 1077 MB/s, fp32 [2048, 2048] 673 -> 2423 MB/s). Casting
    on assignment rounds as ``astype`` does, so the bytes are the same.
    """

    def produce() -> np.ndarray:
        parts = [read(n) for n in names]
        out = np.empty((parts[0].shape[1], sum(p.shape[0] for p in parts)), dtype=dtype or parts[0].dtype)
        column = 0
        for part in parts:
            for row in range(0, part.shape[0], _T_ROWS):
                stop = min(row + _T_ROWS, part.shape[0])
                out[:, column + row : column + stop] = part[row:stop].T
            column += part.shape[0]
        return out

    return produce


def artifact_tensors(
    config: ModelConfig,
    max_length: int,
    read: Read,
    dtype: np.dtype | None = None,
    quant: QuantScheme | None = None,
    native: Native | None = None,
    head_size: int | None = None,
) -> list[Spec]:
    """Names, shapes, producers and stored dtypes of every tensor the graphs use, in file order
    (transposed ones already in ``dtype`` when given; the writer converts the rest). Under
    ``quant`` each quantized matrix becomes its MatMulNBits tensors (_quantized). ``head_size``:
    the stored attention head size when it pads the model's heads (exporter/head_padding.py)."""
    pad = HeadPadding(config.head_dim, head_size or config.head_dim)
    if pad.padded and native is not None:
        raise ValueError("padded attention heads with a source's quantized blocks: their blocks would move")
    specs = _float_tensors(config, max_length, read, dtype, pad)
    linears = quantized_linears(config, quant, head_size)
    # padded heads: the attention matrices ([K, N] float tensors) are quantized in their stored
    # (padded) layout, from full precision (head_padding.py); the others are not padded
    padded_float = (
        {
            name: produce
            for name, _, produce, _ in _float_tensors(config, max_length, read, None, pad)
            if name.endswith(("qkv_proj.weight_T", "o_proj.weight_T"))
        }
        if pad.padded and linears
        else {}
    )
    if config.tie_word_embeddings and "lm_head.weight_T" in linears:
        # a tied head under a quantized scheme: a quantized copy of the embedding ([V, H] is
        # already MatMulNBits' [N, K]); the Gather keeps reading the float embedding
        specs.append(("lm_head.weight_T", (config.hidden_size, config.vocab_size), lambda: None, None))
    out: list[Spec] = []
    for name, shape, produce, code in specs:
        if name in linears:  # the embedding too, under --quantize-embedding
            out += _quantized(linears[name], config, read, name, native, padded_float.get(name))
        else:
            out.append((name, shape, produce, code))
    return out


def _sources(config: ModelConfig, name: str) -> list[str]:
    """The checkpoint matrices ([N_i, K]) stacked on N into the graphs' matrix ``name``."""
    if name == "lm_head.weight_T":
        return ["model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"]
    if name == EMBEDDING:
        return ["model.embed_tokens.weight"]
    ours, proj = name.removesuffix(".weight_T").rsplit(".", 1)
    theirs = dict(layer_prefixes(config))[ours]
    parts = {
        "qkv_proj": [f"{theirs}.self_attn.{p}_proj.weight" for p in "qkv"],
        "o_proj": [f"{theirs}.self_attn.o_proj.weight"],
        "gate_up_proj": [f"{theirs}.mlp.gate_proj.weight", f"{theirs}.mlp.up_proj.weight"],
        "down_proj": [f"{theirs}.mlp.down_proj.weight"],
    }
    return parts[proj]


def _quantized(
    linear: QuantLinear,
    config: ModelConfig,
    read: Read,
    name: str,
    native: Native | None,
    padded: Callable[[], np.ndarray] | None = None,
) -> list[Spec]:
    """The MatMulNBits tensors of one matrix, quantized after fusion (or ``native``'s blocks;
    ``padded``: the float [K, N] matrix with its heads padded). Each is produced on its own (the
    RTN pass runs once per stored tensor: cheap beside the copy, and no quantized matrix outlives
    its write), so memory stays at one fused fp32 matrix per worker."""
    from loopcast.exporter.quantize import quantize, shapes

    if config.recurrent_depth:  # the release's fused matrices, q/k halves reordered
        from loopcast.exporter.recurrent_weights import recurrent_matrix

        if native is not None:
            raise ValueError("a recurrent-depth checkpoint has no native quantized blocks")
        sources: list[str] = []
    else:
        sources = _sources(config, name)

    def matrix_NK() -> np.ndarray:
        if padded is not None:
            return np.ascontiguousarray(np.asarray(padded(), np.float32).T)
        if config.recurrent_depth:
            return np.asarray(recurrent_matrix(config, name, read), np.float32)
        return np.concatenate([np.asarray(read(s), np.float32) for s in sources], axis=0)

    def role(key: str) -> Callable[[], np.ndarray]:
        def produce() -> np.ndarray:
            if native is not None:
                qt = native(sources, linear)
            else:
                qt = quantize(matrix_NK(), linear.bits, linear.block_size, linear.symmetric)
            tensor = {"packed": qt.packed, "scales": qt.scales, "zero_points": qt.zero_points}[key]
            if linear.gathered:  # GatherBlockQuantized's shapes of the same bytes (loopcast/quant.py)
                tensor = np.ascontiguousarray(tensor.reshape(linear.n, -1)[:, : dims[key][1]])
            return tensor

        return produce

    fzp = linear.float_zero_points
    dims = shapes(linear.n, linear.k, linear.bits, linear.block_size, linear.symmetric, fzp)
    if linear.gathered:
        dims = gathered_shapes(linear)
    dtypes = {"packed": "uint8", "scales": "fp32", "zero_points": "fp32" if fzp else "uint8"}
    return [(stored, dims[key], role(key), dtypes[key]) for key, stored in linear.stored.items()]


def gathered_shapes(linear: QuantLinear) -> dict[str, tuple[int, ...]]:
    """The stored shapes of the quantized embedding: GatherBlockQuantized's [V, H·b/8] codes
    (rows without the padding of a partial last block), [V, blocks] scales and [V, bytes] zero
    points."""
    from loopcast.exporter.quantize import n_blocks

    nb = n_blocks(linear.k, linear.block_size)
    out = {"packed": (linear.n, linear.k * linear.bits // 8), "scales": (linear.n, nb)}
    if not linear.symmetric:
        out["zero_points"] = (linear.n, -(-nb * linear.bits // 8))
    return out


def _float_tensors(
    config: ModelConfig, max_length: int, read: Read, dtype: np.dtype | None, pad: HeadPadding
) -> list[Spec]:
    """The float artifact's tensors (artifact_tensors without quantization), every attention head
    stored as ``pad.stored`` dims."""
    if config.recurrent_depth:
        from loopcast.exporter.recurrent_weights import recurrent_tensors

        specs = recurrent_tensors(
            config, max_length, read, lambda names, source: _cat_t(source, names, dtype), pad
        )
        return [(name, shape, produce, None) for name, shape, produce in specs]
    h, d, inter = config.hidden_size, pad.stored, config.intermediate_size  # d: the stored head size
    qkv = (config.num_heads + 2 * config.num_kv_heads) * d

    def heads_read(name: str) -> np.ndarray:
        """A q/k/v_proj weight or bias ([heads·head_dim, ...]) with its heads padded."""
        heads = config.num_heads if name.split(".")[-2] == "q_proj" else config.num_kv_heads
        return pad.heads(read(name), heads)

    def o_read(name: str) -> np.ndarray:  # o_proj [H, heads·head_dim]: the input columns
        return pad.heads(read(name), config.num_heads, axis=1)

    specs: list = [
        ("embed_tokens.weight", (config.vocab_size, h), lambda: read("model.embed_tokens.weight")),
    ]
    norms = ["input_layernorm", "post_attention_layernorm"]
    if config.sandwich_norm:
        norms += ["input_layernorm_2", "post_attention_layernorm_2"]
    for ours, theirs in layer_prefixes(config):
        attn, mlp = f"{theirs}.self_attn", f"{theirs}.mlp"
        for norm in norms:
            specs.append((f"{ours}.{norm}.weight", (h,), lambda t=theirs, n=norm: read(f"{t}.{n}.weight")))
        # [H, Q+K+V]: one MatMul produces the packed QKV that GroupQueryAttention takes.
        specs.append(
            (
                f"{ours}.qkv_proj.weight_T",
                (h, qkv),
                _cat_t(heads_read, [f"{attn}.{p}_proj.weight" for p in "qkv"], dtype),
            )
        )
        if config.qkv_bias:
            specs.append(
                (
                    f"{ours}.qkv_proj.bias",
                    (qkv,),
                    lambda a=attn: np.concatenate([heads_read(f"{a}.{p}_proj.bias") for p in "qkv"]),
                )
            )
        specs.append(
            (
                f"{ours}.o_proj.weight_T",
                (config.num_heads * d, h),
                _cat_t(o_read, [f"{attn}.o_proj.weight"], dtype),
            )
        )
        if config.o_bias:
            specs.append((f"{ours}.o_proj.bias", (h,), lambda a=attn: read(f"{a}.o_proj.bias")))
        specs.append(
            (
                f"{ours}.gate_up_proj.weight_T",
                (h, 2 * inter),
                _cat_t(read, [f"{mlp}.gate_proj.weight", f"{mlp}.up_proj.weight"], dtype),
            )
        )
        if config.mlp_bias:
            specs.append(
                (
                    f"{ours}.gate_up_proj.bias",
                    (2 * inter,),
                    lambda m=mlp: np.concatenate([read(f"{m}.gate_proj.bias"), read(f"{m}.up_proj.bias")]),
                )
            )
        specs.append(
            (f"{ours}.down_proj.weight_T", (inter, h), _cat_t(read, [f"{mlp}.down_proj.weight"], dtype))
        )
        if config.mlp_bias:
            specs.append((f"{ours}.down_proj.bias", (h,), lambda m=mlp: read(f"{m}.down_proj.bias")))
    specs.append(("norm.weight", (h,), lambda: read("model.norm.weight")))
    if config.has_exit_gate:  # the exits graph's gate: Linear(H, 1) with bias, float
        specs.append(
            ("early_exit_gate.weight_T", (h, 1), _cat_t(read, ["model.early_exit_gate.weight"], dtype))
        )
        specs.append(("early_exit_gate.bias", (1,), lambda: read("model.early_exit_gate.bias")))
    if not config.tie_word_embeddings:
        specs.append(("lm_head.weight_T", (h, config.vocab_size), _cat_t(read, ["lm_head.weight"], dtype)))
    specs += rotary_tables(config, max_length, pad)
    return [(name, shape, produce, None) for name, shape, produce in specs]


def rotary_tables(config: ModelConfig, max_length: int, pad: HeadPadding) -> list[tuple]:
    """The rotary cos/sin tables with the config's rope scaling, computed here once
    (loopcast.rope), [max_length, stored/2]: padded columns hold cos 1, sin 0."""
    positions = np.arange(max_length)
    shape = (max_length, pad.stored // 2)
    return [
        ("rotary.cos_SD2", shape, lambda: pad.rotary(config.rope_cos_sin(positions)[0], 1.0)),
        ("rotary.sin_SD2", shape, lambda: pad.rotary(config.rope_cos_sin(positions)[1], 0.0)),
    ]


def _layout(specs, dtype: str) -> tuple[dict[str, dict], bytes]:
    """The safetensors header (aligned offsets) for ``specs`` stored as ``dtype``."""
    header: dict[str, dict] = {}
    cursor = 0
    for name, shape, _, stored in specs:
        np_dtype, code = NUMPY_DTYPES[stored or dtype]
        cursor = -(-cursor // _ALIGN) * _ALIGN
        nbytes = math.prod(shape) * np_dtype.itemsize
        header[name] = {"dtype": code, "shape": list(shape), "data_offsets": [cursor, cursor + nbytes]}
        cursor += nbytes
    header["__metadata__"] = {"format": "loopcast-artifact"}
    header_bytes = json.dumps(header, separators=(",", ":")).encode()
    header_bytes += b" " * (-(8 + len(header_bytes)) % _ALIGN)  # data section starts aligned
    return header, header_bytes


def weight_layout(
    config: ModelConfig,
    max_length: int,
    dtype: str,
    read: Read,
    quant: QuantScheme | None = None,
    head_size: int | None = None,
) -> dict[str, StoredTensor]:
    """Where ``write_weights`` will put every tensor, known before a byte is written (so the
    graphs, which only need these offsets, can be built while the weights are copied)."""
    specs = artifact_tensors(config, max_length, read, quant=quant, head_size=head_size)
    header, header_bytes = _layout(specs, dtype)
    return _stored(header, 8 + len(header_bytes))


def _stored(header: dict[str, dict], base: int) -> dict[str, StoredTensor]:
    return {
        name: StoredTensor(
            name,
            _DTYPE_OF_CODE[h["dtype"]],
            tuple(h["shape"]),
            base + h["data_offsets"][0],
            h["data_offsets"][1] - h["data_offsets"][0],
        )
        for name, h in header.items()
        if name != "__metadata__"
    }


def weights_nbytes(
    config: ModelConfig,
    max_length: int,
    dtype: str,
    read: Read,
    quant: QuantScheme | None = None,
    head_size: int | None = None,
) -> int:
    """Bytes of tensor data ``write_weights`` will write (for a progress bar in bytes)."""
    header, _ = _layout(artifact_tensors(config, max_length, read, quant=quant, head_size=head_size), dtype)
    return max(h["data_offsets"][1] for n, h in header.items() if n != "__metadata__")


def write_weights(
    path: Path,
    config: ModelConfig,
    max_length: int,
    dtype: str,
    read: Read,
    progress: Callable[[int], None] | None = None,
    sha256=None,
    quant: QuantScheme | None = None,
    native: Native | None = None,
    head_size: int | None = None,
) -> dict[str, StoredTensor]:
    """Stream the artifact tensors into a safetensors file; return where each one lives.

    Each tensor is read from the memory-mapped checkpoint, fused/transposed and converted on
    its own, so peak memory is about two (fused) tensors; ``progress`` gets bytes written.
    A tensor that needs no conversion (same dtype, not fused or transposed) is written straight
    from the mapped checkpoint, without a copy in between. ``sha256`` (a ``hashlib`` object), if
    given, is fed every byte of the file as it is written, on a thread of its own, so the
    manifest's file record needs no second pass over the file.
    """
    np_dtype, _ = NUMPY_DTYPES[dtype]
    specs = artifact_tensors(config, max_length, read, np_dtype, quant, native, head_size)
    header, header_bytes = _layout(specs, dtype)
    base = 8 + len(header_bytes)

    def convert(spec) -> np.ndarray:
        name, shape, produce, stored = spec
        tensor = produce()
        if tuple(tensor.shape) != shape:
            raise AssertionError(f"{name}: produced {tuple(tensor.shape)}, expected {shape}")
        return np.ascontiguousarray(tensor, dtype=NUMPY_DTYPES[stored][0] if stored else np_dtype)

    def hash_parts(parts) -> None:
        for part in parts:
            sha256.update(part)

    # Three stages overlap (numpy copies, file writes and hashlib all release the GIL): the
    # next tensors are converted on worker threads (one per two cores, at most four: 1 on the
    # 2-core VM) while this one is written here and the previous one hashed on another thread;
    # at most workers+1 converted tensors and two queued hashes are alive.
    workers = max(1, min(16, (os.cpu_count() or 2) - 2))
    with (
        open(path, "wb") as f,
        ThreadPoolExecutor(max_workers=workers) as pool,
        ThreadPoolExecutor(max_workers=1) as hasher,
    ):
        head = [struct.pack("<Q", len(header_bytes)), header_bytes]
        f.write(b"".join(head))
        hashed = [hasher.submit(hash_parts, head)] if sha256 is not None else []
        cursor = base
        queued = collections.deque(pool.submit(convert, spec) for spec in specs[:workers])
        for i, (name, _shape, _, _) in enumerate(specs):
            data = queued.popleft().result()
            if i + workers < len(specs):
                queued.append(pool.submit(convert, specs[i + workers]))
            start, stop = header[name]["data_offsets"]
            # Alignment padding is written, not skipped with a seek, so the hash sees every byte.
            parts = [
                bytes(base + start - cursor),
                memoryview(data.reshape(-1).view(np.uint8)) if data.size else b"",
            ]
            for part in parts:
                f.write(part)
            cursor = base + stop
            if sha256 is not None:
                if len(hashed) >= 2:
                    hashed.pop(0).result()
                hashed.append(hasher.submit(hash_parts, parts))
            del data, parts
            if progress:
                progress(stop - start)
        for job in hashed:
            job.result()
    return _stored(header, base)


def checkpoint_reader(files: dict[str, Path]) -> tuple[Read, Callable[[], None]]:
    """A ``read(name)`` of zero-copy views into the memory-mapped shards, and a ``close()``."""
    handles: dict[Path, MappedFile] = {}

    def read(name: str) -> np.ndarray:
        path = files[name]
        if path not in handles:
            handles[path] = MappedFile(path)
        return handles[path].tensor(name)

    def close() -> None:
        for handle in handles.values():
            handle.close()
        handles.clear()

    return read, close


def read_stored(path: Path) -> dict[str, StoredTensor]:
    """Where each tensor of an artifact's weights file lives (from its safetensors header)."""
    with open(path, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(size))
    base = 8 + size
    return {
        name: StoredTensor(
            name,
            _DTYPE_OF_CODE[h["dtype"]],
            tuple(h["shape"]),
            base + h["data_offsets"][0],
            h["data_offsets"][1] - h["data_offsets"][0],
        )
        for name, h in header.items()
        if name != "__metadata__"
    }
