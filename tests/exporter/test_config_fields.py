"""The known-fields rule (docs/checkpoints.md), field by field: every config field that changes
the math is either read (and changing it changes the config) or refused with one line; a field
outside the table is refused, never ignored."""

from __future__ import annotations

import json

import pytest

from loopcast.config import KNOWN_FIELDS, ModelConfig, load_config
from loopcast.errors import ConfigError

BASE = {
    "llama": {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 100,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    },
    "qwen2": {
        "model_type": "qwen2",
        "architectures": ["Qwen2ForCausalLM"],
        "vocab_size": 100,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "use_sliding_window": False,
        "sliding_window": None,
    },
    "mistral": {
        "model_type": "mistral",
        "architectures": ["MistralForCausalLM"],
        "vocab_size": 100,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "sliding_window": None,
    },
    "ouro": {
        "model_type": "ouro",
        "vocab_size": 100,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "total_ut_steps": 3,
    },
}


def parse(model_type: str, **changes) -> ModelConfig:
    return ModelConfig.from_hf_dict({**BASE[model_type], **changes})


# Fields that change the math, each with a value that must change the parsed config.
READ = [
    ("vocab_size", 120),
    ("hidden_size", 128),
    ("intermediate_size", 80),
    ("num_hidden_layers", 3),
    ("num_attention_heads", 8),
    ("num_key_value_heads", 1),
    ("head_dim", 32),
    ("rms_norm_eps", 1e-5),
    ("max_position_embeddings", 64),
    ("tie_word_embeddings", True),
    ("rope_theta", 5e5),
    ("rope_parameters", {"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0}),
    ("rope_scaling", {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}),
]


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "mistral"])
@pytest.mark.parametrize("field, value", READ, ids=[f for f, _ in READ])
def test_math_field_is_read(model_type, field, value):
    # The old-format rope fields replace the new-format block (both at once must agree).
    old_format = field in ("rope_scaling", "rope_theta")
    base = {k: v for k, v in BASE[model_type].items() if not (old_format and k == "rope_parameters")}
    changed = ModelConfig.from_hf_dict({**base, field: value})
    assert changed != ModelConfig.from_hf_dict(base)


@pytest.mark.parametrize(
    "model_type, field, value, check",
    [
        ("llama", "attention_bias", True, lambda c: c.qkv_bias and c.o_bias and not c.mlp_bias),
        ("llama", "mlp_bias", True, lambda c: c.mlp_bias and not c.qkv_bias),
        ("qwen2", "attention_dropout", 0.0, lambda c: c.qkv_bias and not c.o_bias),
        ("mistral", "sliding_window", 4096, lambda c: c.sliding_window == 4096),
        ("llama", "eos_token_id", [5, 7, 9], lambda c: c.eos_token_ids == (5, 7, 9)),
        ("llama", "dtype", "bfloat16", lambda c: c.torch_dtype == "bfloat16"),
        ("llama", "torch_dtype", "float16", lambda c: c.torch_dtype == "float16"),
        ("ouro", "total_ut_steps", 4, lambda c: c.num_loops == 4),
        ("ouro", "early_exit_threshold", 1.0, lambda c: c.num_loops == 3),
        # the exit gate's default threshold (docs/adaptive-depth.md), kept through the manifest
        (
            "ouro",
            "early_exit_threshold",
            0.9,
            lambda c: c.early_exit_threshold == 0.9 and c.to_hf_dict()["early_exit_threshold"] == 0.9,
        ),
    ],
)
def test_field_sets_the_config(model_type, field, value, check):
    assert check(parse(model_type, **{field: value}))


REFUSED = [
    ("llama", {"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ("llama", {"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}}, "rope type 'longrope'"),
    ("llama", {"rope_parameters": {"rope_type": "mrope", "rope_theta": 1e4}}, "rope type 'mrope'"),
    (
        "llama",
        {
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 1e4,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "beta": 2,
            }
        },
        "rope parameter 'beta'",
    ),
    (
        "llama",
        {"rope_parameters": {"rope_type": "linear", "rope_theta": 1e4}},
        "needs the parameter 'factor'",
    ),
    (
        "llama",
        {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4}, "rope_theta": 5e5},
        "rope_theta",
    ),
    ("llama", {"rope_scaling": {"type": "linear", "factor": 2.0}}, "both rope_parameters and rope_scaling"),
    ("llama", {"partial_rotary_factor": 0.5}, "partial_rotary_factor 0.5"),
    ("llama", {"architectures": ["LlamaForSequenceClassification"]}, "architectures"),
    ("llama", {"rope_interleaved": True}, "rope_interleaved=True"),
    ("qwen2", {"use_mrope": True}, "use_mrope=True"),
    ("qwen2", {"use_sliding_window": True, "sliding_window": 8}, "sliding_window=8"),
    ("qwen2", {"layer_types": ["full_attention", "sliding_attention"]}, "layer_types"),
    ("ouro", {"use_sliding_window": True, "sliding_window": 8}, "sliding_window=8"),
    ("ouro", {"attention_bias": True}, "attention_bias"),
    ("ouro", {"early_exit_threshold": 1.5}, "early_exit_threshold must be a number in (0, 1], got 1.5"),
    ("llama", {"early_exit_threshold": 1.0}, "'early_exit_threshold' is not understood"),
    ("qwen2", {"attention_bias": True}, "'attention_bias' is not understood"),
    ("mistral", {"mlp_bias": True}, "'mlp_bias' is not understood"),
    ("llama", {"quantization_config": {"quant_method": "gptq"}}, "'quantization_config' is not understood"),
    ("llama", {"final_logit_softcapping": 30.0}, "'final_logit_softcapping' is not understood"),
    ("llama", {"attn_logit_softcapping": 50.0}, "'attn_logit_softcapping' is not understood"),
    ("llama", {"query_pre_attn_scalar": 256}, "'query_pre_attn_scalar' is not understood"),
    ("llama", {"logits_scaling": 8.0}, "'logits_scaling' is not understood"),
    ("llama", {"embedding_multiplier": 12.0}, "'embedding_multiplier' is not understood"),
    ("ouro", {"total_ut_steps": 4, "use_moe": True}, "'use_moe' is not understood"),
]


@pytest.mark.parametrize(
    "model_type, changes, fragment", REFUSED, ids=[f"{m}-{next(iter(c))}" for m, c, _ in REFUSED]
)
def test_field_is_refused_in_one_line(model_type, changes, fragment):
    with pytest.raises(ConfigError) as info:
        parse(model_type, **changes)
    assert fragment in str(info.value)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("model_type", list(KNOWN_FIELDS))
def test_round_trip_stays_inside_the_table(model_type):
    config = parse(model_type)
    written = config.to_hf_dict()
    assert set(written) <= KNOWN_FIELDS[model_type]
    assert ModelConfig.from_hf_dict(written) == config


def test_upstream_default_spellings_are_accepted():
    """SmolLM2's config spells out the defaults (and carries metadata for transformers.js)."""
    assert parse(
        "llama",
        rope_interleaved=False,
        is_llama_config=True,
        **{"transformers.js_config": {"kv_cache_dtype": {"q4f16": "float16"}}},
    ) == parse("llama")
    assert parse("qwen2", use_mrope=False) == parse("qwen2")


def test_generation_config_adds_stop_ids(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({**BASE["llama"], "eos_token_id": 2}))
    (tmp_path / "generation_config.json").write_text(
        json.dumps({"eos_token_id": [2, 8, 9], "max_length": 77})
    )
    assert load_config(tmp_path).eos_token_ids == (2, 8, 9)
    from loopcast.config import generation_max_length

    assert generation_max_length(tmp_path) == 77


def test_dynamic_rope_is_default_below_max_positions():
    dynamic = parse("llama", rope_parameters={"rope_type": "dynamic", "rope_theta": 1e4, "factor": 4.0})
    plain = parse("llama")
    assert (dynamic.rope_inv_freq() == plain.rope_inv_freq()).all()


def test_default_max_length_follows_generation_config_and_window():
    from loopcast.exporter.export import ExportOptions

    llama = parse("llama", max_position_embeddings=256)
    assert ExportOptions().resolved(llama).max_length == 256
    assert ExportOptions().resolved(llama, generation_length=77).max_length == 77
    assert ExportOptions().resolved(llama, generation_length=10_000).max_length == 256
    windowed = parse("mistral", max_position_embeddings=256, sliding_window=64)
    assert ExportOptions().resolved(windowed).max_length == 64
    assert ExportOptions(max_length=64).resolved(windowed).max_length == 64
