"""Model configuration of the looped-transformer family (docs/architecture.md §1), torch-free.

A config is read from a Hugging Face ``config.json`` (``model_type`` ouro, llama, qwen2 or
mistral, in the formats of transformers 4 and 5) and validated once, here, against a table of
known fields (docs/checkpoints.md); everything downstream trusts it.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loopcast import rope
from loopcast.errors import ConfigError
from loopcast.rope import RopeScaling

SUPPORTED_MODEL_TYPES = ("ouro", "llama", "qwen2", "mistral", "huginn_raven")
ARCHITECTURES = {
    "huginn_raven": "RavenForCausalLM",
    "ouro": "OuroForCausalLM",
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "mistral": "MistralForCausalLM",
}
GENERATION_CONFIG = "generation_config.json"

# The known-fields table (docs/checkpoints.md): every config.json field loopcast reads or knows
# to be inert. A field outside the table for its model_type is refused, never ignored, because
# it may change the math (a new rope variant, a quantization scheme, a logit soft-cap...).
# Fields that leave the forward pass unchanged (token ids, training-only settings, bookkeeping):
_INERT = frozenset(
    {
        "architectures",
        "model_type",
        "transformers_version",
        "_name_or_path",
        "torch_dtype",
        "dtype",
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
        "initializer_range",
        "use_cache",
        "attention_dropout",
        "pretraining_tp",
        "output_attentions",
        "output_hidden_states",
        "return_dict",
        "id2label",
        "label2id",
        "problem_type",
        "is_encoder_decoder",
        "chunk_size_feed_forward",
        "tokenizer_class",
        "auto_map",
        "max_window_layers",
        "use_return_dict",
        "tie_encoder_decoder",
        "torchscript",
        "is_llama_config",
        "transformers.js_config",
    }
)
# Fields that change the math and are implemented (or checked and refused when unsupported).
_MATH_COMMON = frozenset(
    {
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "hidden_act",
        "rms_norm_eps",
        "max_position_embeddings",
        "tie_word_embeddings",
        "rope_theta",
        "rope_scaling",
        "rope_parameters",
        "partial_rotary_factor",
        "rope_interleaved",
        "use_mrope",
    }
)
KNOWN_FIELDS: dict[str, frozenset[str]] = {
    "llama": _INERT | _MATH_COMMON | {"attention_bias", "mlp_bias"},
    # Qwen2 attention always has q/k/v biases and no o_proj bias; the window fields are checked.
    "qwen2": _INERT | _MATH_COMMON | {"use_sliding_window", "sliding_window", "layer_types"},
    "mistral": _INERT | _MATH_COMMON | {"sliding_window"},
    "ouro": _INERT
    | _MATH_COMMON
    | {
        "attention_bias",
        "total_ut_steps",
        "early_exit_threshold",
        "use_sliding_window",
        "sliding_window",
        "layer_types",
        "num_prelude_layers",
        "num_coda_layers",
    },
}


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of one looped decoder.

    ``num_layers`` is the core stack L, applied ``num_loops`` (R) times. Ouro layers are
    "sandwich" layers (four RMSNorms); Llama-family layers (llama, qwen2, mistral) are pre-norm
    (two). The loop-norm (``model.norm``) is applied after every loop.
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
    rope_scaling: RopeScaling | None = None  # None: plain rope with rope_theta
    qkv_bias: bool = False  # q/k/v projections carry a bias (Qwen2, attention_bias)
    o_bias: bool = False  # o_proj carries a bias (Llama attention_bias)
    mlp_bias: bool = False  # gate/up/down carry biases (Llama mlp_bias)
    sliding_window: int | None = None  # Mistral: exports only up to this length (full attention there)
    extra_eos_token_ids: tuple[int, ...] = ()  # further stop ids (config lists, generation_config.json)
    # Ouro's default exit threshold (docs/adaptive-depth.md): below 1.0, plain greedy requests
    # that name no depth run the exit gate at it; None or 1.0: every loop
    early_exit_threshold: float | None = None
    # Recurrent depth (Huginn/Raven, loopcast/config_huginn.py): ``num_loops`` is the most core
    # steps an artifact runs (its KV slots), ``default_loops`` the release's r (mean_recurrence).
    default_loops: int | None = None
    rope_interleaved: bool = False  # rotary on adjacent pairs (Huginn's complex-like rotary)
    embed_scale: float = 1.0  # token embeddings are multiplied by this (Huginn: sqrt(hidden))
    state_std: float = 0.0  # the initial state's std before truncation at 3 std (Huginn)

    def __post_init__(self) -> None:
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(
                f"unknown model_type {self.model_type!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "num_loops",
            "max_position_embeddings",
        ):
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
        if self.model_type not in ("ouro", "huginn_raven") and self.num_loops != 1:
            raise ConfigError(f"{self.model_type} models run one loop, config asks for {self.num_loops}")
        # The bias pattern is fixed per architecture (what its config fields can express).
        biases = (self.qkv_bias, self.o_bias, self.mlp_bias)
        allowed = {
            "ouro": [(False, False, False)],
            "mistral": [(False, False, False)],
            "qwen2": [(True, False, False)],
            "huginn_raven": [(False, False, False), (True, False, False)],  # qk_bias: q and k only
            "llama": [(a, a, m) for a in (False, True) for m in (False, True)],
        }[self.model_type]
        if biases not in allowed:
            raise ConfigError(
                f"bias pattern qkv={biases[0]} o={biases[1]} mlp={biases[2]} is not one a "
                f"{self.model_type} config can express"
            )
        if self.sliding_window is not None and self.model_type != "mistral":
            raise ConfigError("sliding_window is only understood for mistral models")

        if self.model_type == "huginn_raven":
            from loopcast.config_huginn import check_recurrent

            check_recurrent(self)

    # -- derived ---------------------------------------------------------------------------
    @property
    def recurrent_depth(self) -> bool:
        """Huginn/Raven: prelude, a core block applied r times with the prelude output injected
        into every step (an adapter on [state, embedded]), coda; r is chosen per request."""
        return self.model_type == "huginn_raven"

    @property
    def loops_default(self) -> int:
        """The number of core steps a request runs unless it asks for another."""
        return self.default_loops if self.default_loops is not None else self.num_loops

    @property
    def sandwich_norm(self) -> bool:
        """Ouro layers normalise both the input and the output of attention and MLP."""
        return self.model_type == "ouro"

    @property
    def has_exit_gate(self) -> bool:
        return self.model_type == "ouro"

    @property
    def has_biases(self) -> bool:
        return self.qkv_bias or self.o_bias or self.mlp_bias

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Every id that ends generation, the config's first."""
        first = () if self.eos_token_id is None else (self.eos_token_id,)
        return first + tuple(i for i in self.extra_eos_token_ids if i != self.eos_token_id)

    @property
    def rope_type(self) -> str:
        return self.rope_scaling.rope_type if self.rope_scaling else "default"

    def rope_inv_freq(self):
        """Scaled rotary inverse frequencies ``[D/2]`` (numpy float64)."""
        return rope.inv_freq(self.rope_theta, self.head_dim, self.rope_scaling, self.max_position_embeddings)

    def rope_cos_sin(self, positions):
        """cos/sin ``[S, D/2]`` (numpy float32) at integer ``positions`` (numpy)."""
        return rope.cos_sin(
            self.rope_theta, self.head_dim, self.rope_scaling, self.max_position_embeddings, positions
        )

    @property
    def num_kv_slots(self) -> int:
        """Core slots ``r*L + l`` first, then prelude, then coda slots (docs/architecture.md §2)."""
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
        if model_type == "huginn_raven":
            from loopcast.config_huginn import huginn_from_hf_dict

            return huginn_from_hf_dict(cls, raw)
        unknown = sorted(set(raw) - KNOWN_FIELDS[model_type])
        if unknown:
            raise ConfigError(
                f"config field {unknown[0]!r} is not understood for model_type {model_type!r}; it may change "
                "the math, so it is refused rather than ignored (docs/checkpoints.md)"
            )
        architectures = raw.get("architectures") or [ARCHITECTURES[model_type]]
        if any(a != ARCHITECTURES[model_type] for a in architectures):
            raise ConfigError(
                f"architectures {architectures} are not supported for model_type {model_type!r} "
                f"(expected {ARCHITECTURES[model_type]})"
            )
        try:
            _reject_unsupported(raw)
            hidden = int(raw["hidden_size"])
            heads = int(raw["num_attention_heads"])
            theta, scaling = rope.parse_rope(raw)
            eos = raw.get("eos_token_id")
            eos_list = [int(i) for i in (eos if isinstance(eos, list) else [] if eos is None else [eos])]
            attention_bias = bool(raw.get("attention_bias", False))
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
                rope_theta=theta,
                max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
                num_prelude_layers=int(raw.get("num_prelude_layers", 0)),
                num_coda_layers=int(raw.get("num_coda_layers", 0)),
                bos_token_id=raw.get("bos_token_id"),
                eos_token_id=eos_list[0] if eos_list else None,
                torch_dtype=str(raw.get("dtype") or raw.get("torch_dtype") or "float32"),
                rope_scaling=scaling,
                qkv_bias=attention_bias or model_type == "qwen2",
                o_bias=attention_bias,
                mlp_bias=bool(raw.get("mlp_bias", False)),
                sliding_window=_sliding_window(raw),
                extra_eos_token_ids=tuple(eos_list[1:]),
                early_exit_threshold=(
                    float(raw["early_exit_threshold"])
                    if model_type == "ouro" and raw.get("early_exit_threshold") is not None
                    else None
                ),
            )
        except KeyError as exc:
            raise ConfigError(f"config.json lacks the required field {exc.args[0]!r}") from None
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"config.json has a malformed field: {exc}") from None

    def to_hf_dict(self) -> dict[str, Any]:
        if self.recurrent_depth:
            from loopcast.config_huginn import huginn_to_hf_dict

            return huginn_to_hf_dict(self)
        rope_parameters = {
            "rope_theta": self.rope_theta,
            "rope_type": "default",
            **(self.rope_scaling.to_hf_dict() if self.rope_scaling else {}),
        }
        eos = list(self.eos_token_ids)
        out: dict[str, Any] = {
            "model_type": self.model_type,
            "architectures": [ARCHITECTURES[self.model_type]],
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            # Both formats: rope_parameters (transformers >= 5) and rope_theta/rope_scaling (older).
            "rope_theta": self.rope_theta,
            "rope_parameters": rope_parameters,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": eos if len(eos) > 1 else self.eos_token_id,
            "torch_dtype": self.torch_dtype,
            "dtype": self.torch_dtype,
        }
        if self.model_type in ("llama", "ouro"):
            out["attention_bias"] = self.qkv_bias
        if self.model_type == "llama":
            out["mlp_bias"] = self.mlp_bias
        if self.model_type == "qwen2":
            out["use_sliding_window"] = False
        if self.model_type == "mistral":
            out["sliding_window"] = self.sliding_window
        if self.model_type == "ouro":
            out["total_ut_steps"] = self.num_loops
            if self.early_exit_threshold is not None:
                out["early_exit_threshold"] = self.early_exit_threshold
            out["use_sliding_window"] = False
        if self.num_prelude_layers or self.num_coda_layers:
            out["num_prelude_layers"] = self.num_prelude_layers
            out["num_coda_layers"] = self.num_coda_layers
        return out

    def replace(self, **changes: Any) -> ModelConfig:
        return dataclasses.replace(self, **changes)


def _reject_unsupported(raw: dict[str, Any]) -> None:
    """Refuse values of known fields that the exporter would silently get wrong."""
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise ConfigError(f"unsupported hidden_act {act!r}: only 'silu' (SwiGLU) is implemented")
    layer_types = raw.get("layer_types")
    if layer_types and any(t != "full_attention" for t in layer_types):
        raise ConfigError("sliding-window attention layers (layer_types) are not supported")
    # Upstream SmolLM2 / Qwen2 configs spell out the defaults; anything else changes the rotary math.
    for name in ("rope_interleaved", "use_mrope"):
        if raw.get(name):
            raise ConfigError(f"{name}={raw[name]!r} is not supported (only the half-split rotary of Llama)")
    # Ouro's exit threshold: 1.0 runs every loop; below it is the exit gate's default threshold.
    threshold = raw.get("early_exit_threshold")
    if threshold is not None and (
        isinstance(threshold, bool)
        or not isinstance(threshold, (int, float))
        or not 0.0 < float(threshold) <= 1.0
    ):
        raise ConfigError(f"early_exit_threshold must be a number in (0, 1], got {threshold!r}")
    if raw.get("model_type") == "ouro" and raw.get("attention_bias"):
        raise ConfigError("attention_bias is not supported for Ouro models")


def _sliding_window(raw: dict[str, Any]) -> int | None:
    """The window a full-attention export must stay within, or None.

    Ouro and Qwen2 carry a ``sliding_window`` value that is inert unless ``use_sliding_window``
    is set; Mistral's applies whenever it is not null. A window is refused for Ouro/Qwen2 and
    bounds the export length for Mistral (full and windowed attention agree below it).
    """
    window = raw.get("sliding_window")
    if raw.get("model_type") == "mistral":
        return int(window) if window else None
    if raw.get("use_sliding_window") and window:
        raise ConfigError(f"sliding-window attention (sliding_window={window}) is not supported")
    return None


def load_config(checkpoint_dir: Path) -> ModelConfig:
    """The checkpoint's config, with the stop ids of ``generation_config.json`` added."""
    path = Path(checkpoint_dir) / "config.json"
    config = ModelConfig.from_hf_dict(_read_json(path, required=True))
    generation = _read_json(Path(checkpoint_dir) / GENERATION_CONFIG, required=False)
    eos = generation.get("eos_token_id")
    extra = [eos] if isinstance(eos, int) else eos if isinstance(eos, list) else []
    if not all(isinstance(i, int) for i in extra):
        raise ConfigError(
            f"{Path(checkpoint_dir) / GENERATION_CONFIG}: eos_token_id must be an int or a list of ints"
        )
    if config.eos_token_id is None and extra:
        config = config.replace(eos_token_id=extra[0])
    merged = tuple(dict.fromkeys([*config.extra_eos_token_ids, *extra]))
    return config.replace(extra_eos_token_ids=tuple(i for i in merged if i != config.eos_token_id))


def generation_max_length(checkpoint_dir: Path) -> int | None:
    """``max_length`` of ``generation_config.json`` (total tokens), if the checkpoint sets one."""
    value = _read_json(Path(checkpoint_dir) / GENERATION_CONFIG, required=False).get("max_length")
    if value is not None and (not isinstance(value, int) or value < 1):
        raise ConfigError(
            f"{Path(checkpoint_dir) / GENERATION_CONFIG}: max_length must be a positive integer"
        )
    return value


def _read_json(path: Path, *, required: bool) -> dict[str, Any]:
    if not path.is_file():
        if required:
            raise ConfigError(f"{path}: {path.name} not found")
        return {}
    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a JSON object")
    return raw
