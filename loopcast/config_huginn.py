"""The Huginn/Raven ``config.json`` (``model_type: huginn_raven``; docs/checkpoints.md), torch-free.

Huginn-0125 ("Raven") is a recurrent-depth decoder: a prelude of ``n_layers_in_prelude``
layers, a core block of ``n_layers_in_recurrent_block`` layers applied r times (the release
runs ``mean_recurrence`` = 32), and a coda of ``n_layers_in_coda`` layers:

    e = prelude(wte(ids)·√H)
    s_0 = initial state (truncated normal or zero);  s_{k+1} = core(adapter([s_k, e]))
    logits = lm_head(ln_f(coda(ln_f(s_r))))

Its config names differ from transformers' (``n_embd``, ``n_heads``, ``norm_eps``,
``rope_base``, ``block_size``, ``tie_embeddings``, ``qk_bias``); they are read into the one
:class:`~loopcast.config.ModelConfig`. Every field is read, known to be inert, or refused, as
for the other families; the class-name fields must name the only blocks the release has.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from loopcast.errors import ConfigError

if TYPE_CHECKING:
    from loopcast.config import ModelConfig

ARCHITECTURE = "RavenForCausalLM"
# Fields that leave the forward pass unchanged: bookkeeping, training-only settings (weight
# init, the training-time recurrence sampler, activation checkpointing) and derived values
# that are checked against what they derive from.
_INERT = frozenset(
    {
        "architectures",
        "model_type",
        "auto_map",
        "transformers_version",
        "_name_or_path",
        "name",
        "hf_config",
        "torch_dtype",
        "dtype",
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
        "use_cache",
        "padding_multiple",
        "init_strategy",
        "init_orthogonal",
        "sampling_scheme",
        "mean_backprop_depth",
        "activation_checkpoint_impl",
        "effective_expected_depth",
        "keys_to_ignore_at_inference",
        "return_dict",
        "output_attentions",
        "output_hidden_states",
        "torchscript",
        "tie_word_embeddings",
    }
)
# Fields that change the math: read, or checked and refused when loopcast cannot compute them.
_MATH = frozenset(
    {
        "n_embd",
        "n_heads",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "n_layers",
        "n_layers_in_prelude",
        "n_layers_in_recurrent_block",
        "n_layers_in_coda",
        "mean_recurrence",
        "max_recurrence",  # loopcast's own: the most core steps an artifact runs (its KV slots)
        "vocab_size",
        "padded_vocab_size",
        "intermediate_size",
        "block_size",
        "norm_eps",
        "rope_base",
        "tie_embeddings",
        "qk_bias",
        "bias",
        "architecture_class_name",
        "block_class_name",
        "norm_class_name",
        "mlp_class_name",
        "nonlin_name",
        "injection_type",
        "state_init",
        "init_values",
        "test_time_noise",
        "test_time_noise_type",
    }
)
KNOWN_FIELDS = _INERT | _MATH
# The only value each class-name field may take: the blocks of the release's modeling code.
_CLASSES = {
    "architecture_class_name": "RecurrentGPT",
    "block_class_name": "SandwichBlock",
    "norm_class_name": "RMSNorm_llama",
    "mlp_class_name": "GatedMLP",
    "nonlin_name": "SiLU",
    "injection_type": "linear",
    "state_init": "like-init",
}


def init_std(hidden: int) -> float:
    """The release's ``init_values["std"]``: sqrt(2 / (5 H)) (its "takase" init)."""
    return math.sqrt(2 / (5 * hidden))


def huginn_from_hf_dict(cls: type[ModelConfig], raw: dict[str, Any]) -> ModelConfig:
    unknown = sorted(set(raw) - KNOWN_FIELDS)
    if unknown:
        raise ConfigError(
            f"config field {unknown[0]!r} is not understood for model_type 'huginn_raven'; it may "
            "change the math, so it is refused rather than ignored (docs/checkpoints.md)"
        )
    architectures = raw.get("architectures") or [ARCHITECTURE]
    if any(a != ARCHITECTURE for a in architectures):
        raise ConfigError(
            f"architectures {architectures} are not supported for model_type 'huginn_raven' "
            f"(expected {ARCHITECTURE})"
        )
    for name, want in _CLASSES.items():
        if name in raw and raw[name] != want:
            raise ConfigError(f"{name} {raw[name]!r} is not supported (only {want!r}, the release's)")
    if "tie_word_embeddings" in raw and bool(raw["tie_word_embeddings"]) != bool(
        raw.get("tie_embeddings", True)
    ):
        raise ConfigError("tie_word_embeddings and tie_embeddings disagree")
    if raw.get("bias"):
        raise ConfigError("bias=true (biases on every linear, the adapter's too) is not supported")
    if raw.get("test_time_noise"):
        raise ConfigError(
            f"test_time_noise {raw['test_time_noise']} is not supported (noise injected into every "
            "core step; only 0)"
        )
    try:
        hidden = int(raw["n_embd"])
        heads = int(raw.get("n_heads", raw.get("num_attention_heads", 0)))
        if "n_heads" in raw and "num_attention_heads" in raw and int(raw["num_attention_heads"]) != heads:
            raise ConfigError("n_heads and num_attention_heads disagree")
        if heads < 1 or hidden % heads:
            raise ConfigError(f"n_embd ({hidden}) must be a multiple of n_heads ({heads})")
        head_dim = int(raw.get("head_dim") or hidden // heads)
        if head_dim * heads != hidden:
            raise ConfigError(
                f"head_dim {head_dim} x n_heads {heads} must equal n_embd {hidden} (the output "
                "projection is n_embd x n_embd)"
            )
        prelude = int(raw.get("n_layers_in_prelude", 2))
        core = int(raw.get("n_layers_in_recurrent_block", 4))
        coda = int(raw.get("n_layers_in_coda", 2))
        if "n_layers" in raw and int(raw["n_layers"]) != prelude + core + coda:
            raise ConfigError(
                f"n_layers {raw['n_layers']} must be n_layers_in_prelude + n_layers_in_recurrent_block "
                f"+ n_layers_in_coda = {prelude + core + coda}"
            )
        vocab = int(raw["vocab_size"])
        if int(raw.get("padded_vocab_size", vocab)) != vocab:
            raise ConfigError(
                f"padded_vocab_size {raw['padded_vocab_size']} differs from vocab_size {vocab} "
                "(a padded embedding is not supported)"
            )
        mean = int(raw.get("mean_recurrence", 32))
        maximum = int(raw.get("max_recurrence", mean))
        init_values = raw.get("init_values") or {}
        if not isinstance(init_values, dict):
            raise ConfigError("init_values must be an object")
        embed_scale = math.sqrt(hidden)  # the modeling code's emb_scale, whatever init_values say
        std = float(init_values.get("std", init_std(hidden)))
        eos = raw.get("eos_token_id")
        eos_list = [int(i) for i in (eos if isinstance(eos, list) else [] if eos is None else [eos])]
        return cls(
            model_type="huginn_raven",
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=core,
            num_heads=heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=head_dim,
            num_loops=maximum,
            default_loops=mean,
            rms_norm_eps=float(raw.get("norm_eps", 1e-6)),
            rope_theta=float(raw.get("rope_base", 50_000.0)),
            max_position_embeddings=int(raw.get("block_size", 4096)),
            tie_word_embeddings=bool(raw.get("tie_embeddings", True)),
            num_prelude_layers=prelude,
            num_coda_layers=coda,
            bos_token_id=raw.get("bos_token_id"),
            eos_token_id=eos_list[0] if eos_list else None,
            extra_eos_token_ids=tuple(eos_list[1:]),
            torch_dtype=str(raw.get("dtype") or raw.get("torch_dtype") or "float32"),
            qkv_bias=bool(raw.get("qk_bias", True)),
            rope_interleaved=True,
            embed_scale=embed_scale,
            state_std=std * embed_scale,
        )
    except KeyError as exc:
        raise ConfigError(f"config.json lacks the required field {exc.args[0]!r}") from None
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"config.json has a malformed field: {exc}") from None


def huginn_to_hf_dict(config: ModelConfig) -> dict[str, Any]:
    """The release's field names (what ``huginn_from_hf_dict`` reads back to the same config)."""
    eos = list(config.eos_token_ids)
    out: dict[str, Any] = {
        "model_type": "huginn_raven",
        "architectures": [ARCHITECTURE],
        "n_embd": config.hidden_size,
        "n_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "n_layers": config.num_prelude_layers + config.num_layers + config.num_coda_layers,
        "n_layers_in_prelude": config.num_prelude_layers,
        "n_layers_in_recurrent_block": config.num_layers,
        "n_layers_in_coda": config.num_coda_layers,
        "mean_recurrence": config.loops_default,
        "vocab_size": config.vocab_size,
        "padded_vocab_size": config.vocab_size,
        "intermediate_size": config.intermediate_size,
        "block_size": config.max_position_embeddings,
        "norm_eps": config.rms_norm_eps,
        "rope_base": config.rope_theta,
        "tie_embeddings": config.tie_word_embeddings,
        "qk_bias": config.qkv_bias,
        "bias": False,
        **_CLASSES,
        "init_values": {"std": config.state_std / config.embed_scale, "embed_scale": config.embed_scale},
        "test_time_noise": 0,
        "bos_token_id": config.bos_token_id,
        "eos_token_id": eos if len(eos) > 1 else config.eos_token_id,
        "torch_dtype": config.torch_dtype,
    }
    if config.num_loops != config.loops_default:
        out["max_recurrence"] = config.num_loops
    return out


def check_recurrent(config: ModelConfig) -> None:
    """What a recurrent-depth ModelConfig must satisfy (called from its ``__post_init__``)."""
    if config.num_heads * config.head_dim != config.hidden_size:
        raise ConfigError("huginn_raven needs num_heads x head_dim == hidden_size")
    if config.default_loops is not None and not 1 <= config.default_loops <= config.num_loops:
        raise ConfigError(
            f"mean_recurrence {config.default_loops} must be in 1..{config.num_loops} (max_recurrence)"
        )
    if config.qkv_bias and config.num_kv_heads != config.num_heads:
        # qk_bias is [2, 1, heads, D]: the release adds its k half to every head of k
        raise ConfigError("qk_bias needs num_key_value_heads == n_heads (the release's bias is per q head)")
    if not config.rope_interleaved:
        raise ConfigError("huginn_raven rotates adjacent pairs (rope_interleaved)")
    if config.state_std < 0:
        raise ConfigError(f"the initial state's std must be >= 0, got {config.state_std}")
