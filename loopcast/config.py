"""Model configuration of the looped-transformer family (DESIGN §1), torch-free.

A config is read from a Hugging Face ``config.json`` (``model_type`` "ouro" or "llama") and
validated once, here; everything downstream trusts it.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loopcast.errors import ConfigError

SUPPORTED_MODEL_TYPES = ("ouro", "llama")


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of one looped decoder.

    ``num_layers`` is the core stack L, applied ``num_loops`` (R) times. Ouro layers are
    "sandwich" layers (four RMSNorms); Llama layers are pre-norm (two). The loop-norm
    (``model.norm``) is applied after every loop.
    """

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_loops: int = 1
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    num_prelude_layers: int = 0
    num_coda_layers: int = 0
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    torch_dtype: str = "float32"

    def __post_init__(self) -> None:
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(
                f"unknown model_type {self.model_type!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                     "num_heads", "num_kv_heads", "head_dim", "num_loops",
                     "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"config field {name} must be a positive integer, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ConfigError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        if self.model_type == "llama" and self.num_loops != 1:
            raise ConfigError(f"llama models run one loop, config asks for {self.num_loops}")

    # -- derived ---------------------------------------------------------------------------
    @property
    def sandwich_norm(self) -> bool:
        """Ouro layers normalise both the input and the output of attention and MLP."""
        return self.model_type == "ouro"

    @property
    def has_exit_gate(self) -> bool:
        return self.model_type == "ouro"

    @property
    def num_kv_slots(self) -> int:
        """Core slots ``r*L + l`` first, then prelude, then coda slots (DESIGN §2)."""
        return self.num_loops * self.num_layers + self.num_prelude_layers + self.num_coda_layers

    def core_slot(self, loop: int, layer: int) -> int:
        return loop * self.num_layers + layer

    def prelude_slot(self, layer: int) -> int:
        return self.num_loops * self.num_layers + layer

    def coda_slot(self, layer: int) -> int:
        return self.num_loops * self.num_layers + self.num_prelude_layers + layer

    def kv_bytes_per_token(self, bytes_per_element: int) -> int:
        return 2 * self.num_kv_slots * self.num_kv_heads * self.head_dim * bytes_per_element

    # -- Hugging Face config.json ------------------------------------------------------------
    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        model_type = raw.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(
                f"unknown model_type {model_type!r} in config.json; supported: "
                f"{', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        _reject_unsupported(raw)
        try:
            hidden = int(raw["hidden_size"])
            heads = int(raw["num_attention_heads"])
            eos = raw.get("eos_token_id")
            if isinstance(eos, list):
                eos = eos[0] if eos else None
            return cls(
                model_type=model_type,
                vocab_size=int(raw["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(raw["intermediate_size"]),
                num_layers=int(raw["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=int(raw.get("num_key_value_heads") or heads),
                head_dim=int(raw.get("head_dim") or hidden // heads),
                num_loops=int(raw.get("total_ut_steps", 1)) if model_type == "ouro" else 1,
                rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                rope_theta=float(raw.get("rope_theta", 10000.0)),
                max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
                num_prelude_layers=int(raw.get("num_prelude_layers", 0)),
                num_coda_layers=int(raw.get("num_coda_layers", 0)),
                bos_token_id=raw.get("bos_token_id"),
                eos_token_id=eos,
                torch_dtype=str(raw.get("torch_dtype", "float32")),
            )
        except KeyError as exc:
            raise ConfigError(f"config.json lacks the required field {exc.args[0]!r}") from None
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"config.json has a malformed field: {exc}") from None

    def to_hf_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "model_type": self.model_type,
            "architectures": ["OuroForCausalLM" if self.model_type == "ouro" else "LlamaForCausalLM"],
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": None,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": False,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "torch_dtype": self.torch_dtype,
        }
        if self.model_type == "ouro":
            out["total_ut_steps"] = self.num_loops
            out["use_sliding_window"] = False
        if self.num_prelude_layers or self.num_coda_layers:
            out["num_prelude_layers"] = self.num_prelude_layers
            out["num_coda_layers"] = self.num_coda_layers
        return out

    def replace(self, **changes: Any) -> ModelConfig:
        return dataclasses.replace(self, **changes)


def _reject_unsupported(raw: dict[str, Any]) -> None:
    """Refuse features the exporter would silently get wrong."""
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise ConfigError(f"unsupported hidden_act {act!r}: only 'silu' (SwiGLU) is implemented")
    # Ouro configs carry a `sliding_window` value that is inert unless use_sliding_window is set.
    window_on = raw.get("use_sliding_window", raw.get("model_type") != "ouro")
    if window_on and raw.get("sliding_window"):
        raise ConfigError(f"sliding-window attention (sliding_window={raw.get('sliding_window')}) is not supported")
    layer_types = raw.get("layer_types")
    if layer_types and any(t != "full_attention" for t in layer_types):
        raise ConfigError("sliding-window attention layers (layer_types) are not supported")
    if raw.get("rope_scaling"):
        raise ConfigError(f"rope_scaling {raw['rope_scaling']!r} is not supported")
    if raw.get("attention_bias") or raw.get("mlp_bias"):
        raise ConfigError("attention_bias / mlp_bias are not supported")


def load_config(checkpoint_dir: Path) -> ModelConfig:
    path = Path(checkpoint_dir) / "config.json"
    if not path.is_file():
        raise ConfigError(f"{path}: config.json not found")
    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a JSON object")
    return ModelConfig.from_hf_dict(raw)


# Shapes used by tests and benchmarks; the tool `loopcast random-checkpoint` writes any of them.
PRESETS: dict[str, ModelConfig] = {
    "ouro-1.4b": ModelConfig(
        model_type="ouro", vocab_size=49152, hidden_size=2048, intermediate_size=5632,
        num_layers=24, num_heads=16, num_kv_heads=16, head_dim=128, num_loops=4,
        rms_norm_eps=1e-6, rope_theta=1e6, max_position_embeddings=65536,
        bos_token_id=1, eos_token_id=2, torch_dtype="float16",
    ),
    "tiny-ouro": ModelConfig(
        model_type="ouro", vocab_size=97, hidden_size=64, intermediate_size=96, num_layers=2,
        num_heads=4, num_kv_heads=4, head_dim=16, num_loops=3, rope_theta=1e4,
        max_position_embeddings=128, eos_token_id=0,
    ),
    "tiny-llama": ModelConfig(
        model_type="llama", vocab_size=101, hidden_size=64, intermediate_size=80, num_layers=2,
        num_heads=4, num_kv_heads=2, head_dim=16, num_loops=1, rope_theta=1e4,
        max_position_embeddings=128, tie_word_embeddings=True, eos_token_id=0,
    ),
}
