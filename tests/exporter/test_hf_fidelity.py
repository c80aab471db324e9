"""Fidelity against transformers itself: checkpoints saved by transformers' own Llama, Qwen2 and
Mistral modules (``save_pretrained``), for every rope type and bias variant; the logits of our
torch reference and of our exported ONNX graphs must equal transformers' logits, and greedy
tokens must be the same. transformers is used only here, as the independent oracle; the export
path never imports it."""

from __future__ import annotations

import json
import shutil
from functools import cache
from pathlib import Path

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

from click.testing import CliRunner  # noqa: E402
from loopcast.cli import main  # noqa: E402
from loopcast.exporter.checkpoint import load_checkpoint  # noqa: E402
from loopcast.exporter.export import ExportOptions, export_checkpoint  # noqa: E402
from loopcast.exporter.reference_generate import greedy_generate  # noqa: E402
from loopcast.ort_runtime import load  # noqa: E402
from loopcast.ort_runtime.binding.generator import Generator  # noqa: E402
from loopcast.ort_runtime.loading.artifact import open_artifact  # noqa: E402

from loopcast.config import load_config  # noqa: E402
from loopcast.errors import ExportError  # noqa: E402
from tests.artifacts import scratch_root  # noqa: E402

ATOL = RTOL = 1e-4
SHAPE = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    bos_token_id=1,
    eos_token_id=2,
)

# name -> (transformers config class name, config kwargs). Positions reach 40, so every scaled
# band of llama3/yarn (original context 32) is exercised.
VARIANTS: dict[str, tuple[str, dict]] = {
    "llama-theta5e5": ("LlamaConfig", dict(rope_parameters={"rope_type": "default", "rope_theta": 5e5})),
    "llama-linear": (
        "LlamaConfig",
        dict(rope_parameters={"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0}),
    ),
    "llama-dynamic": (
        "LlamaConfig",
        dict(rope_parameters={"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}),
    ),
    "llama-llama3": (
        "LlamaConfig",
        dict(
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 5e5,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            }
        ),
    ),
    "llama-yarn": (
        "LlamaConfig",
        dict(
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 1e4,
                "factor": 4.0,
                "original_max_position_embeddings": 32,
            }
        ),
    ),
    "llama-yarn-mscale": (
        "LlamaConfig",
        dict(
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 1e4,
                "factor": 4.0,
                "original_max_position_embeddings": 32,
                "mscale": 1.0,
                "mscale_all_dim": 0.5,
                "beta_fast": 16,
                "beta_slow": 2,
            }
        ),
    ),
    "llama-biases-tied": ("LlamaConfig", dict(attention_bias=True, mlp_bias=True, tie_word_embeddings=True)),
    "qwen2-qkv-bias": (
        "Qwen2Config",
        dict(rope_parameters={"rope_type": "default", "rope_theta": 1e6}, tie_word_embeddings=True),
    ),
    "mistral-no-window": ("MistralConfig", dict(sliding_window=None, head_dim=16)),
    "mistral-window-4096": ("MistralConfig", dict(sliding_window=4096)),
}
MUST_SHOW = ["llama-theta5e5", "llama-llama3", "qwen2-qkv-bias"]


def _randomize(model) -> None:
    """Every parameter random (transformers inits biases to zero and norms to one, which would
    hide a dropped bias or a swapped norm)."""
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            noise = torch.randn(param.shape, generator=generator)
            param.copy_(1.0 + 0.1 * noise if "norm" in name else 0.15 * noise)


@cache
def hf_checkpoint(name: str) -> Path:
    class_name, extra = VARIANTS[name]
    config = getattr(transformers, class_name)(**{**SHAPE, **extra})
    model_class = getattr(transformers, class_name.replace("Config", "ForCausalLM"))
    model = model_class(config)
    _randomize(model)
    path = scratch_root() / "hf" / name
    model.save_pretrained(path)
    return path


@cache
def hf_model(name: str):
    model_class = getattr(transformers, VARIANTS[name][0].replace("Config", "ForCausalLM"))
    return model_class.from_pretrained(hf_checkpoint(name), attn_implementation="eager").eval()


@cache
def exported(name: str) -> Path:
    out = scratch_root() / "hf" / f"{name}-artifact"
    export_checkpoint(hf_checkpoint(name), out, ExportOptions(max_length=64, verify_width=4))
    return out


def _prompt(length: int = 40) -> list[int]:
    return np.random.default_rng(5).integers(3, SHAPE["vocab_size"], length).tolist()


def _hf_logits(name: str, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return hf_model(name)(torch.tensor([ids])).logits[0].float().numpy()


@pytest.mark.parametrize("name", list(VARIANTS))
def test_reference_logits_equal_transformers(name: str) -> None:
    ids = _prompt()
    ours = load_checkpoint(hf_checkpoint(name), dtype=torch.float32)
    with torch.no_grad():
        logits = ours(torch.tensor([ids])).final_logits[0].numpy()
    np.testing.assert_allclose(logits, _hf_logits(name, ids), rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_onnx_logits_equal_transformers(name: str) -> None:
    """prefill (last row), then teacher-forced decode rows and one verify block, each row
    against transformers' logits at its position."""
    ids = _prompt()
    expected = _hf_logits(name, ids)
    gen = Generator(open_artifact(exported(name)))
    out = gen.run("prefill", 0, tokens=ids[:24])
    np.testing.assert_allclose(out.logits[-1], expected[23], rtol=RTOL, atol=ATOL)
    gen.commit(ids[:24])
    for pos in range(24, 36):
        out = gen.run("decode", pos, tokens=[ids[pos]])
        np.testing.assert_allclose(
            out.logits[0], expected[pos], rtol=RTOL, atol=ATOL, err_msg=f"position {pos}"
        )
        gen.commit([ids[pos]])
    out = gen.run("verify", 36, tokens=ids[36:40])
    np.testing.assert_allclose(out.logits, expected[36:40], rtol=RTOL, atol=ATOL)


def _hf_greedy(name: str, prompt: list[int], steps: int) -> list[int]:
    ids = list(prompt)
    for _ in range(steps):
        ids.append(int(_hf_logits(name, ids)[-1].argmax()))
    return ids[len(prompt) :]


@pytest.mark.parametrize("name", MUST_SHOW)
def test_greedy_tokens_equal_transformers_and_reference(name: str) -> None:
    prompt, steps = _prompt(12), 16
    expected = _hf_greedy(name, prompt, steps)
    ours = load(exported(name)).generate(prompt, steps, stop_ids=())
    assert ours.tokens == expected
    reference = load_checkpoint(hf_checkpoint(name), dtype=torch.float32)
    assert greedy_generate(reference, prompt, steps, stop_ids=()).tokens == expected


@pytest.mark.parametrize(
    "name, lines",
    [
        (
            "llama-theta5e5",
            ["model_type      llama", "rope            theta 500000, type default", "biases          none"],
        ),
        (
            "llama-llama3",
            [
                "rope            theta 500000, type llama3, factor 8, high_freq_factor 4, "
                "low_freq_factor 1, original_max_position_embeddings 32"
            ],
        ),
        (
            "qwen2-qkv-bias",
            [
                "model_type      qwen2",
                "rope            theta 1e+06, type default",
                "biases          q/k/v",
                "vocab           128 (tied lm_head)",
            ],
        ),
    ],
)
def test_inspect_shows_what_transformers_saved(name: str, lines: list[str]) -> None:
    result = CliRunner().invoke(main, ["inspect", str(hf_checkpoint(name))])
    assert result.exit_code == 0, result.output
    for line in lines:
        assert line in result.output.splitlines(), result.output


def test_old_format_config_reads_the_same() -> None:
    """transformers 4 spelling (rope_theta + rope_scaling with ``type``, torch_dtype) of the
    llama3 checkpoint gives the same config."""
    new = hf_checkpoint("llama-llama3")
    old = scratch_root() / "hf" / "llama3-old-format"
    shutil.copytree(new, old, dirs_exist_ok=True)
    raw = json.loads((old / "config.json").read_text())
    params = raw.pop("rope_parameters")
    raw["rope_theta"] = params.pop("rope_theta")
    raw["rope_scaling"] = {"type": params.pop("rope_type"), **params}
    raw["torch_dtype"] = raw.pop("dtype")
    (old / "config.json").write_text(json.dumps(raw))
    assert load_config(old) == load_config(new)


def test_window_below_max_length_is_refused(tmp_path) -> None:
    path = tmp_path / "windowed"
    shutil.copytree(hf_checkpoint("mistral-window-4096"), path)
    raw = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**raw, "sliding_window": 16}))
    with pytest.raises(ExportError, match="exceeds the model's sliding_window 16"):
        export_checkpoint(path, tmp_path / "art", ExportOptions(max_length=64))
    assert not (tmp_path / "art").exists()


# -- EOS lists ---------------------------------------------------------------------------------


def _with_eos(tmp_path: Path, name: str, *, config_eos=None, generation_eos=None) -> Path:
    path = tmp_path / name
    shutil.copytree(hf_checkpoint("llama-theta5e5"), path)
    if config_eos is not None:
        raw = json.loads((path / "config.json").read_text())
        (path / "config.json").write_text(json.dumps({**raw, "eos_token_id": config_eos}))
    if generation_eos is not None:
        raw = json.loads((path / "generation_config.json").read_text())
        (path / "generation_config.json").write_text(json.dumps({**raw, "eos_token_id": generation_eos}))
    return path


@pytest.mark.parametrize("where", ["config", "generation_config"])
def test_generation_stops_at_any_listed_eos_id(tmp_path, where: str) -> None:
    prompt = _prompt(12)
    free = load(exported("llama-theta5e5")).generate(prompt, 12, stop_ids=()).tokens
    # The second listed id is one greedy decoding first produces at step k; the first never shows.
    k = next(i for i in range(2, len(free)) if free[i] not in free[:i])
    unused = next(i for i in range(3, SHAPE["vocab_size"]) if i not in free)
    eos = [unused, free[k]]
    kwargs = {"config_eos": eos} if where == "config" else {"generation_eos": eos}
    path = _with_eos(tmp_path, where, **kwargs)
    assert set(eos) <= set(load_config(path).eos_token_ids)
    art = tmp_path / f"{where}-artifact"
    manifest = export_checkpoint(path, art, ExportOptions(max_length=64))
    assert set(eos) <= set(manifest.eos_token_ids)
    result = load(art).generate(prompt, 12)
    assert result.tokens == free[: k + 1]
    assert result.finish_reason != "length"
    reference = load_checkpoint(path, dtype=torch.float32)
    assert (
        greedy_generate(reference, prompt, 12, stop_ids=reference.config.eos_token_ids).tokens
        == free[: k + 1]
    )
