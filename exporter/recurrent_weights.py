"""The artifact tensors of a recurrent-depth (Huginn) checkpoint, in the graphs' layout.

The release's fused matrices keep their fusion: ``Wqkv`` is already the packed q|k|v that
GroupQueryAttention takes and ``mlp.fc`` the gate|up pair; each is transposed for MatMul under
the names the shared blocks read (``{layer}.qkv_proj.weight_T``, ``{layer}.gate_up_proj.weight_T``,
...). ``qk_bias`` becomes the packed bias ``[q bias | k bias | 0]`` added before the rotary.

The release rotates adjacent pairs (x[2i], x[2i+1]); the graphs' attention ops rotate halves
(x[i], x[i + D/2]). Within every q and k head the rows of ``Wqkv`` (and the bias) are reordered
evens first, then odds, so that the halves are the release's pairs: the rotation is the same,
and q·k is unchanged because q and k are reordered alike (v is not). The stored K are in that
order too, which nothing outside the graphs reads. One graph layout then serves the stock and
the loopcast attention ops (whose kernels rotate halves only). Heads padded for the CUDA
kernels (Huginn-0125's 96 → 128: exporter/head_padding.py) are padded after the reordering, so
each half (the evens, the odds) is followed by its zeros.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from loopcast.exporter.head_padding import HeadPadding

from loopcast.config import ModelConfig

Read = Callable[[str], np.ndarray]


def recurrent_layer_prefixes(config: ModelConfig) -> list[tuple[str, str]]:
    """(artifact prefix, checkpoint prefix) of every block: core, prelude, coda."""
    out = [(f"layers.{i}", f"transformer.core_block.{i}") for i in range(config.num_layers)]
    out += [(f"prelude_layers.{i}", f"transformer.prelude.{i}") for i in range(config.num_prelude_layers)]
    out += [(f"coda_layers.{i}", f"transformer.coda.{i}") for i in range(config.num_coda_layers)]
    return out


def pairs_to_halves(config: ModelConfig, rows: np.ndarray) -> np.ndarray:
    """``Wqkv`` rows (or the packed bias) with every q and k head's dims evens first, then odds."""
    d = config.head_dim
    q_heads = config.num_heads
    order = np.arange(rows.shape[0])
    within = np.concatenate([np.arange(0, d, 2), np.arange(1, d, 2)])
    for head in range(q_heads + config.num_kv_heads):  # q heads, then k heads; v stays
        order[head * d : (head + 1) * d] = head * d + within
    return np.asarray(rows)[order]


def recurrent_tensors(
    config: ModelConfig, max_length: int, read: Read, transposed, pad: HeadPadding
) -> list[tuple]:
    """(name, shape, producer) of every tensor, each attention head stored as ``pad.stored`` dims;
    ``transposed(names, read)`` is the writer's chunked stack-and-transpose (exporter/weights.py)."""
    from loopcast.exporter.weights import rotary_tables

    heads = config.num_heads + 2 * config.num_kv_heads  # Wqkv's rows: q, k and v heads

    def halves(name: str) -> np.ndarray:
        return pad.heads(pairs_to_halves(config, read(name)), heads)

    def o_read(name: str) -> np.ndarray:  # proj [H, heads·head_dim]: the input columns
        return pad.heads(read(name), config.num_heads, axis=1)

    h, d, inter = config.hidden_size, pad.stored, config.intermediate_size  # d: the stored head size
    q, kv = config.num_heads * d, config.num_kv_heads * d
    specs: list[tuple] = [
        ("embed_tokens.weight", (config.vocab_size, h), lambda: read("transformer.wte.weight")),
        ("embed_scale", (1,), lambda: np.array([config.embed_scale], np.float32)),
    ]
    for ours, theirs in recurrent_layer_prefixes(config):
        for i in range(1, 5):
            specs.append(
                (f"{ours}.norm_{i}.weight", (h,), lambda t=theirs, i=i: read(f"{t}.norm_{i}.weight"))
            )
        specs.append(
            (f"{ours}.qkv_proj.weight_T", (h, q + 2 * kv), transposed([f"{theirs}.attn.Wqkv.weight"], halves))
        )
        if config.qkv_bias:
            specs.append(
                (
                    f"{ours}.qkv_proj.bias",
                    (q + 2 * kv,),
                    lambda t=theirs: pad.heads(_packed_bias(config, read, t), heads),
                )
            )
        specs.append((f"{ours}.o_proj.weight_T", (q, h), transposed([f"{theirs}.attn.proj.weight"], o_read)))
        specs.append(
            (f"{ours}.gate_up_proj.weight_T", (h, 2 * inter), transposed([f"{theirs}.mlp.fc.weight"], read))
        )
        specs.append(
            (f"{ours}.down_proj.weight_T", (inter, h), transposed([f"{theirs}.mlp.proj.weight"], read))
        )
    specs.append(("adapter.weight_T", (2 * h, h), transposed(["transformer.adapter.weight"], read)))
    specs.append(("norm.weight", (h,), lambda: read("transformer.ln_f.weight")))
    if not config.tie_word_embeddings:
        specs.append(("lm_head.weight_T", (h, config.vocab_size), transposed(["lm_head.weight"], read)))
    return specs + rotary_tables(config, max_length, pad)


def recurrent_matrix(config: ModelConfig, name: str, read: Read) -> np.ndarray:
    """The checkpoint matrix ``[N, K]`` behind the graphs' matrix ``name`` (``{layer}.{proj}.weight_T``,
    the head or the embedding), in the artifact's layout (Wqkv's q and k heads in halves order):
    what ``--quantize`` quantizes (exporter/weights.py). Heads are never padded under it."""
    if name in ("lm_head.weight_T", "embed_tokens.weight"):
        tied = config.tie_word_embeddings or name == "embed_tokens.weight"
        return read("transformer.wte.weight" if tied else "lm_head.weight")
    ours, proj = name.removesuffix(".weight_T").rsplit(".", 1)
    theirs = dict(recurrent_layer_prefixes(config))[ours]
    if proj == "qkv_proj":
        return pairs_to_halves(config, read(f"{theirs}.attn.Wqkv.weight"))
    source = {"o_proj": "attn.proj", "gate_up_proj": "mlp.fc", "down_proj": "mlp.proj"}[proj]
    return read(f"{theirs}.{source}.weight")


def _packed_bias(config: ModelConfig, read: Read, layer: str) -> np.ndarray:
    """[q bias | k bias | 0] over the model's heads, halves reordered: [(Hq + 2·Hkv)·head_dim]."""
    qk = np.asarray(read(f"{layer}.attn.qk_bias"))  # [2, 1, heads, D]
    v = np.zeros(config.num_kv_heads * config.head_dim, qk.dtype)
    return pairs_to_halves(config, np.concatenate([qk[0].reshape(-1), qk[1].reshape(-1), v]))
