"""The Huginn/Raven family: its config.json, checkpoint layout, torch reference and the
independent numpy forward (tests/huginn_numpy.py)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from loopcast.config import ModelConfig
from loopcast.errors import ConfigError
from loopcast.presets import PRESETS
from loopcast.recurrent_state import initial_state

torch = pytest.importorskip("torch")

from loopcast.exporter.checkpoint import expected_shapes, load_checkpoint, validate_checkpoint  # noqa: E402
from loopcast.exporter.inspect_checkpoint import describe_checkpoint  # noqa: E402
from loopcast.exporter.random_checkpoint import write_random_checkpoint  # noqa: E402
from loopcast.exporter.reference import KVCache  # noqa: E402
from loopcast.exporter.reference_huginn import RecurrentLM, greedy_generate  # noqa: E402

from tests.huginn_numpy import HuginnNumpy  # noqa: E402

TINY = PRESETS["tiny-huginn"]
# 0.1 keeps the random recurrence contractive (as the trained one: it settles), so fp32 rounding
# does not grow with r; at 0.15 it grows about 2x per 4 steps (1e-3 at r = 32).
HUGINN_STD = 0.1
# The release's config.json fields (tomg-group-umd/huginn-0125), as its RavenConfig saves them.
RELEASE_CONFIG = {
    "architectures": ["RavenForCausalLM"],
    "auto_map": {"AutoConfig": "raven_config_minimal.RavenConfig"},
    "model_type": "huginn_raven",
    "activation_checkpoint_impl": "per-iteration",
    "architecture_class_name": "RecurrentGPT",
    "bias": False,
    "block_class_name": "SandwichBlock",
    "block_size": 4096,
    "effective_expected_depth": 132,
    "head_dim": 96,
    "init_orthogonal": False,
    "init_strategy": "takase",
    "init_values": {
        "embed_scale": 72.6636084983398,
        "embedding": 0.008703882797784892,
        "out_proj": 0.0005356869554443541,
        "std": 0.008703882797784892,
    },
    "injection_type": "linear",
    "intermediate_size": 17920,
    "mean_backprop_depth": 8,
    "mean_recurrence": 32,
    "mlp_class_name": "GatedMLP",
    "n_embd": 5280,
    "n_heads": 55,
    "n_layers": 8,
    "n_layers_in_coda": 2,
    "n_layers_in_prelude": 2,
    "n_layers_in_recurrent_block": 4,
    "nonlin_name": "SiLU",
    "norm_class_name": "RMSNorm_llama",
    "norm_eps": 1e-06,
    "num_attention_heads": 55,
    "num_key_value_heads": 55,
    "padded_vocab_size": 65536,
    "padding_multiple": 4096,
    "qk_bias": True,
    "rope_base": 50000,
    "sampling_scheme": "poisson-lognormal-filling",
    "state_init": "like-init",
    "test_time_noise": 0,
    "test_time_noise_type": "fixed",
    "tie_embeddings": True,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.47.1",
    "vocab_size": 65536,
    "bos_token_id": 65504,
    "eos_token_id": 65505,
}


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return write_random_checkpoint(TINY, tmp_path_factory.mktemp("huginn") / "ckpt", seed=3, std=HUGINN_STD)


def test_release_config_reads_as_the_preset():
    config = ModelConfig.from_hf_dict(RELEASE_CONFIG)
    preset = PRESETS["huginn-3.5b"]
    assert config == preset
    assert (config.num_prelude_layers, config.num_layers, config.num_coda_layers) == (2, 4, 2)
    assert config.num_kv_slots == 32 * 4 + 4
    assert config.embed_scale == pytest.approx(RELEASE_CONFIG["init_values"]["embed_scale"])
    assert config.state_std == pytest.approx(math.sqrt(0.4))
    params = sum(math.prod(s) for s in expected_shapes(config).values())
    assert 3.4e9 < params < 3.7e9  # "3.5B"


@pytest.mark.parametrize("preset", ["tiny-huginn", "huginn-3.5b"])
def test_config_round_trips(preset):
    config = PRESETS[preset]
    assert ModelConfig.from_hf_dict(json.loads(json.dumps(config.to_hf_dict()))) == config


@pytest.mark.parametrize(
    "change, named",
    [
        ({"injection_type": "add"}, "injection_type"),
        ({"block_class_name": "TransformerPreNormBlock"}, "block_class_name"),
        ({"test_time_noise": 0.1}, "test_time_noise"),
        ({"bias": True}, "bias"),
        ({"padded_vocab_size": 65600}, "padded_vocab_size"),
        ({"n_layers": 9}, "n_layers"),
        ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope_scaling"),
        ({"mean_recurrence": 40, "max_recurrence": 32}, "mean_recurrence"),
    ],
)
def test_unsupported_fields_are_refused_in_one_line(change, named):
    with pytest.raises(ConfigError) as info:
        ModelConfig.from_hf_dict({**RELEASE_CONFIG, **change})
    assert named in str(info.value) and "\n" not in str(info.value)


def test_checkpoint_layout_is_the_reference_state_dict(tiny_dir):
    with torch.device("meta"):
        model = RecurrentLM(TINY)
    assert {k: tuple(v.shape) for k, v in model.state_dict().items()} == expected_shapes(TINY)
    assert "transformer.core_block.1.attn.qk_bias" in expected_shapes(TINY)
    validate_checkpoint(tiny_dir, TINY)
    text = describe_checkpoint(str(tiny_dir))
    assert "huginn_raven" in text and "core steps" in text and "adapter" in text


def test_initial_state_is_per_position_and_truncated():
    a = initial_state(64, 0.5, np.arange(6), seed=7)
    b = initial_state(64, 0.5, np.arange(3, 6), seed=7)
    np.testing.assert_array_equal(a[3:], b)
    assert np.abs(a).max() <= 1.5 and a.std() == pytest.approx(0.5, rel=0.2)
    assert not np.array_equal(a, initial_state(64, 0.5, np.arange(6), seed=8))
    assert not initial_state(64, 0.5, np.arange(2), seed=None).any()


@pytest.mark.parametrize("loops", [1, 4, 32])
@pytest.mark.parametrize("seed", [None, 5])
def test_reference_matches_numpy(tiny_dir, loops, seed):
    model = load_checkpoint(tiny_dir)
    ids = [3, 17, 42, 8, 77, 5]
    with torch.no_grad():
        got = model(torch.tensor([ids]), loops=loops, seed=seed).logits[0].numpy()
    state0 = initial_state(TINY.hidden_size, TINY.state_std, np.arange(len(ids)), seed)
    want = HuginnNumpy(tiny_dir).logits(ids, loops, state0)
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
    assert (got.argmax(-1) == want.argmax(-1)).all()


def test_cached_steps_match_recompute(tiny_dir):
    """Token-by-token with the KV cache (slot per (step, layer)) equals the whole-sequence
    recompute at every position, at r = 4 with a seeded state."""
    model = load_checkpoint(tiny_dir)
    prompt = [3, 17, 42]
    tokens, logits = greedy_generate(model, prompt, 5, loops=4, seed=11, max_length=32)
    with torch.no_grad():
        full = model(torch.tensor([prompt + tokens[:-1]]), loops=4, seed=11).logits[0]
    for i, row in enumerate(logits):
        torch.testing.assert_close(row, full[len(prompt) - 1 + i], atol=1e-5, rtol=0)
    cache = KVCache(TINY, 32)
    with pytest.raises(ValueError, match="loops"):
        model(torch.tensor([prompt]), loops=33, cache=cache)


def test_all_steps_logits_end_at_the_final(tiny_dir):
    model = load_checkpoint(tiny_dir)
    with torch.no_grad():
        out = model(torch.tensor([[1, 2, 3]]), loops=3, all_steps=True)
        two = model(torch.tensor([[1, 2, 3]]), loops=2).logits
    assert len(out.step_logits) == 3
    torch.testing.assert_close(out.step_logits[-1], out.logits)
    torch.testing.assert_close(out.step_logits[1], two)


def test_torch_backend_runs_the_recurrent_reference(tiny_dir):
    from loopcast.exporter.torch_backend import generate_with_reference
    from loopcast.ort_runtime.decoding.generation_config import GenerationConfig

    out = generate_with_reference(str(tiny_dir), None, [3, 17, 42], GenerationConfig(max_new_tokens=5))
    want, _ = greedy_generate(load_checkpoint(tiny_dir), [3, 17, 42], 5, max_length=8)
    assert out["tokens"] == want and out["stats"]["finish_reason"] == "length"
