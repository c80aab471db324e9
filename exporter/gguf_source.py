"""A GGUF file as an export source: its config, tensors and blocks under the upstream names
(docs/architecture.md, "GGUF input").

Llama-family (``general.architecture`` llama) and Qwen2 files. The tensors are read with the
``gguf`` package (the exporter's ``[gguf]`` extra) from the memory-mapped file: F32/F16/BF16 as
float, Q4_0/Q4_1/Q8_0 as blocks that become MatMulNBits tensors as they are (exporter/gguf_blocks.py)
or, where loopcast keeps the tensor in float (the embedding), the values llama.cpp computes from
them. llama.cpp's converter permutes a Llama's q/k rows for ggml's rope; they are permuted back,
so the artifact computes what the Hugging Face checkpoint does. Metadata keys that change the
math and that loopcast does not implement are refused by name, never ignored.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from loopcast.exporter.gguf_blocks import BlockType, dequantize_blocks, to_matmulnbits, unpermute_rows
from loopcast.exporter.quantize import Quantized

from loopcast.config import ModelConfig
from loopcast.errors import CheckpointError
from loopcast.quant import QuantLinear, QuantMethod, QuantScheme, WeightFormat

ARCHITECTURES = ("llama", "qwen2")
# {arch}.<key> → what it sets; any other {arch}.* key is refused (it may change the math)
_CONFIG_KEYS = {
    "context_length": "max_position_embeddings",
    "embedding_length": "hidden_size",
    "block_count": "num_layers",
    "feed_forward_length": "intermediate_size",
    "attention.head_count": "num_heads",
    "attention.head_count_kv": "num_kv_heads",
    "attention.key_length": "head_dim",
    "attention.value_length": "head_dim (must equal key_length)",
    "rope.freq_base": "rope_theta",
    "rope.dimension_count": "the rotary dims (must be head_dim)",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "vocab_size": "vocab_size",
}
# GGUF tensor name (per layer after "blk.{i}.") → upstream name
_LAYER_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_output.bias": "self_attn.o_proj.bias",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "ffn_gate.bias": "mlp.gate_proj.bias",
    "ffn_up.bias": "mlp.up_proj.bias",
    "ffn_down.bias": "mlp.down_proj.bias",
} | {f"attn_{p}.{kind}": f"self_attn.{p}_proj.{kind}" for p in "qkv" for kind in ("weight", "bias")}
_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
SUPPORTED_TYPES = ", ".join(t.name for t in BlockType)


def _gguf_name(upstream: str) -> str:
    """The GGUF name of an upstream tensor name (for error lines)."""
    for ours, theirs in _GLOBAL_TENSORS.items():
        if theirs == upstream:
            return ours
    _, _, index, rest = upstream.split(".", 3)
    return f"blk.{index}." + {v: k for k, v in _LAYER_TENSORS.items()}[rest]


def is_gguf(path: str | Path) -> bool:
    return Path(path).suffix.lower() == ".gguf" and Path(path).is_file()


def _reader(path: Path):
    try:
        import gguf
    except ImportError:
        raise CheckpointError(
            f"{path}: reading GGUF files needs the gguf package (pip install 'loopcast[gguf]')"
        ) from None
    try:
        return gguf.GGUFReader(path)
    except (OSError, ValueError, KeyError, IndexError) as exc:
        raise CheckpointError(f"{path}: not a readable GGUF file ({exc})") from None


@dataclass(frozen=True)
class _Tensor:
    gguf_name: str
    kind: BlockType
    data: np.ndarray  # [N, K] float, or uint8 [N, nb, block bytes]
    permute_heads: int | None  # un-permute the rows into this many heads (Llama q/k)


class GGUFSource:
    """One open GGUF file: ``config``, ``read(name)`` (float, upstream names), ``native`` (the
    MatMulNBits tensors of a fused matrix from its blocks), ``scheme`` (None: float layers)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._gguf = _reader(self.path)
        self.metadata: dict[str, Any] = {}
        for key, field in self._gguf.fields.items():
            if not key.startswith("GGUF."):
                self.metadata[key] = field.contents()
        self.architecture = str(self.metadata.get("general.architecture"))
        if self.architecture not in ARCHITECTURES:
            raise CheckpointError(
                f"{self.path}: general.architecture {self.architecture!r} is not supported "
                f"(loopcast reads {', '.join(ARCHITECTURES)} GGUF files)"
            )
        raw = {t.name: t for t in self._gguf.tensors}
        self.config = self._config(raw)
        self._tensors = self._map_tensors(raw)
        self.scheme = self._scheme()

    # --- config -------------------------------------------------------------------------------

    def _key(self, key: str, default: Any = None) -> Any:
        value = self.metadata.get(f"{self.architecture}.{key}", default)
        if value is None:
            raise CheckpointError(f"{self.path}: metadata key {self.architecture}.{key} is missing")
        return value

    def _config(self, raw: dict) -> ModelConfig:
        prefix = f"{self.architecture}."
        for key in sorted(self.metadata):
            if key.startswith(prefix) and key.removeprefix(prefix) not in _CONFIG_KEYS:
                raise CheckpointError(
                    f"{self.path}: metadata key {key} is not supported (it may change the model's "
                    "math, and loopcast does not implement it)"
                )
        if "token_embd.weight" not in raw:
            raise CheckpointError(f"{self.path}: tensor token_embd.weight is missing")
        hidden = int(self._key("embedding_length"))
        heads = int(self._key("attention.head_count"))
        head_dim = int(self._key("attention.key_length", hidden // heads))
        if int(self._key("attention.value_length", head_dim)) != head_dim:
            raise CheckpointError(f"{self.path}: attention.value_length differs from key_length")
        if int(self._key("rope.dimension_count", head_dim)) != head_dim:
            raise CheckpointError(
                f"{self.path}: {self.architecture}.rope.dimension_count is not head_dim {head_dim}: "
                "partial rotary embeddings are not supported"
            )
        vocab = int(raw["token_embd.weight"].shape[1])
        if int(self._key("vocab_size", vocab)) != vocab:
            raise CheckpointError(f"{self.path}: vocab_size differs from token_embd.weight's rows")
        bos = self.metadata.get("tokenizer.ggml.bos_token_id")
        eos = self.metadata.get("tokenizer.ggml.eos_token_id")
        eot = self.metadata.get("tokenizer.ggml.eot_token_id")
        return ModelConfig(
            model_type=self.architecture,
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=int(self._key("feed_forward_length")),
            num_layers=int(self._key("block_count")),
            num_heads=heads,
            num_kv_heads=int(self._key("attention.head_count_kv", heads)),
            head_dim=head_dim,
            rms_norm_eps=float(self._key("attention.layer_norm_rms_epsilon")),
            rope_theta=float(self._key("rope.freq_base", 10000.0)),
            max_position_embeddings=int(self._key("context_length")),
            tie_word_embeddings="output.weight" not in raw,
            bos_token_id=None if bos is None else int(bos),
            eos_token_id=None if eos is None else int(eos),
            extra_eos_token_ids=() if eot is None or eot == eos else (int(eot),),
            qkv_bias="blk.0.attn_q.bias" in raw,
            o_bias="blk.0.attn_output.bias" in raw,
            mlp_bias="blk.0.ffn_up.bias" in raw,
        )

    # --- tensors ------------------------------------------------------------------------------

    def _map_tensors(self, raw: dict) -> dict[str, _Tensor]:
        from loopcast.exporter.checkpoint import expected_shapes

        out: dict[str, _Tensor] = {}
        cfg, llama = self.config, self.architecture == "llama"
        expected = expected_shapes(cfg)
        for name, t in raw.items():
            upstream = _GLOBAL_TENSORS.get(name)
            permute = None
            if name.startswith("blk."):
                _, index, rest = name.split(".", 2)
                if rest in _LAYER_TENSORS and index.isdigit() and int(index) < cfg.num_layers:
                    upstream = f"model.layers.{index}.{_LAYER_TENSORS[rest]}"
                    if llama and rest.startswith(("attn_q.", "attn_k.")):
                        permute = cfg.num_heads if rest.startswith("attn_q.") else cfg.num_kv_heads
            if upstream is None:
                raise CheckpointError(f"{self.path}: tensor {name} is not supported for {self.architecture}")
            try:
                kind = BlockType(int(t.tensor_type))
            except ValueError:
                type_name = getattr(t.tensor_type, "name", t.tensor_type)
                hint = ""
                if name in ("output.weight", "token_embd.weight"):  # llama-quantize's K-quant default
                    hint = " (llama-quantize --output-tensor-type q8_0 --token-embedding-type q8_0 avoids it)"
                raise CheckpointError(
                    f"{self.path}: tensor {name} has type {type_name}; loopcast reads {SUPPORTED_TYPES}{hint}"
                ) from None
            shape = tuple(int(d) for d in reversed(t.shape))  # numpy order: [N, K]
            if kind.bits is not None:  # N rows of K/32 blocks
                data = t.data.reshape(int(np.prod(shape[:-1])), -1, kind.block_bytes)
            elif kind is BlockType.BF16:  # the reader gives its bytes
                import ml_dtypes

                data = np.ascontiguousarray(t.data).view(ml_dtypes.bfloat16).reshape(shape)
            else:
                data = t.data.reshape(shape)
            if shape != expected.get(upstream, shape):
                raise CheckpointError(
                    f"{self.path}: tensor {name} has shape {list(shape)}, expected {list(expected[upstream])}"
                )
            out[upstream] = _Tensor(name, kind, data, permute)
        missing = sorted(set(expected) - set(out))
        if missing:
            raise CheckpointError(
                f"{self.path}: no tensor for {missing[0]} (GGUF name {_gguf_name(missing[0])})"
            )
        return out

    def read(self, name: str) -> np.ndarray:
        """The upstream tensor ``name`` as float (norms and biases 1-D), q/k rows un-permuted."""
        t = self._tensors[name]
        data = t.data if t.kind.bits is None else dequantize_blocks(t.data, t.kind)
        if t.permute_heads is not None:
            data = unpermute_rows(data, t.permute_heads)
        return data

    def native(self, sources: list[str], linear: QuantLinear) -> Quantized:
        """The MatMulNBits tensors of the graphs' matrix fused from ``sources`` (stacked on N)."""
        parts = []
        for name in sources:
            t = self._tensors[name]
            if t.kind.bits != linear.bits:
                raise AssertionError(f"{t.gguf_name} is {t.kind.name}, the scheme wants {linear.bits} bits")
            raw = t.data if t.permute_heads is None else unpermute_rows(t.data, t.permute_heads)
            sym, fzp = linear.symmetric, linear.float_zero_points
            parts.append(to_matmulnbits(raw, t.kind, symmetric=sym, float_zero_points=fzp))
        zps = [p.zero_points for p in parts if p.zero_points is not None]
        return Quantized(
            np.concatenate([p.packed for p in parts]),
            np.concatenate([p.scales for p in parts]),
            np.concatenate(zps) if zps else None,
            parts[0].k,
            sum(p.n for p in parts),
            linear.bits,
            linear.block_size,
        )

    # --- the scheme the blocks carry ------------------------------------------------------------

    def type_counts(self) -> Counter:
        return Counter(t.kind.name for t in self._tensors.values())

    def _scheme(self) -> QuantScheme | None:
        """int4/int8 block 32 when every layer projection is Q4_0/Q4_1/Q8_0 of one width (symmetric
        unless a Q4_1 asks for fp32 zero points); None when they are all float. The head takes
        its own blocks (the embedding's when tied); the embedding stays float."""
        projections = {
            n: t
            for n, t in self._tensors.items()
            if n.startswith("model.layers.") and n.endswith("proj.weight")
        }
        kinds = {t.kind for t in projections.values()}
        bits = {k.bits for k in kinds}
        if bits == {None}:
            return None
        if len(bits) > 1:
            mixed = sorted(projections.items(), key=lambda kv: (kv[1].kind.bits or 0, kv[0]))
            raise CheckpointError(
                f"{self.path}: tensor {mixed[0][1].gguf_name} is {mixed[0][1].kind.name} but tensor "
                f"{mixed[-1][1].gguf_name} is {mixed[-1][1].kind.name}: the layers' projections must "
                "share one width (4 or 8 bits, or float)"
            )
        head = self._tensors[
            "lm_head.weight" if "lm_head.weight" in self._tensors else "model.embed_tokens.weight"
        ]
        kinds_all = kinds | ({head.kind} if head.kind.bits else set())
        float_zp = BlockType.Q4_1 in kinds_all
        layer_bits = 4 if bits == {4} else 8
        fmt = {4: WeightFormat.INT4, 8: WeightFormat.INT8}
        return QuantScheme(
            fmt[layer_bits],
            32,
            symmetric=not float_zp,
            head=fmt[head.kind.bits] if head.kind.bits else WeightFormat.FLOAT,
            method=QuantMethod.GGUF,
            float_zero_points=float_zp,
        )

    def with_accuracy_level(self, level: int) -> QuantScheme | None:
        if self.scheme is None:
            return None
        return dataclasses.replace(self.scheme, accuracy_level=level)

    def describe(self) -> str:
        """What ``loopcast inspect model.gguf`` prints."""
        cfg = self.config
        types = ", ".join(f"{n} {k}" for k, n in sorted(self.type_counts().items()))
        scheme = self.scheme.describe() if self.scheme is not None else "none (float layers)"
        tok = self.metadata.get("tokenizer.ggml.model")
        lines = [
            f"gguf            {self.path} ({self.path.stat().st_size / 2**20:.1f} MiB)",
            f"model           {cfg.model_type}, {cfg.num_layers} layers, hidden {cfg.hidden_size}, "
            f"heads {cfg.num_heads}/{cfg.num_kv_heads} x {cfg.head_dim}, ffn {cfg.intermediate_size}, "
            f"vocab {cfg.vocab_size}, context {cfg.max_position_embeddings}, rope theta {cfg.rope_theta:g}"
            + (", tied embeddings" if cfg.tie_word_embeddings else ""),
            f"tensors         {types}",
            f"exports as      {scheme}"
            + (" (re-quantized only with --quantize)" if self.scheme is None else ""),
            f"tokenizer       {tok or 'none'}"
            + (", chat template" if "tokenizer.chat_template" in self.metadata else ""),
        ]
        return "\n".join(lines)
