"""Checkpoint directories: save → load round trips, sharding, the `demo` name, and bad input
that fails with the file or tensor named."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from loopcast.exporter.checkpoint import (
    INDEX_FILE,
    SINGLE_FILE,
    checkpoint_dtype,
    expected_shapes,
    load_checkpoint,
    resolve_checkpoint,
    save_checkpoint,
    validate_checkpoint,
    write_checkpoint,
)
from loopcast.exporter.random_checkpoint import random_tensors, write_random_checkpoint
from loopcast.exporter.reference import LoopedLM, init_weights
from safetensors.torch import load_file, save_file

from loopcast.config import load_config
from loopcast.errors import CheckpointError, ConfigError, LoopcastError
from loopcast.presets import PRESETS

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
DTYPE_IDS = ["fp32", "fp16", "bf16"]


def assert_same_tensors(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert sorted(actual) == sorted(expected)
    for name, tensor in expected.items():
        assert actual[name].dtype == tensor.dtype, name
        assert torch.equal(actual[name], tensor), name


# -- round trips -------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("tiny_config", ["ouro-r3", "llama-tied-gqa", "llama-untied-gqa"], indirect=True)
def test_save_load_round_trip_is_bit_exact(tiny_config, dtype, tmp_path):
    model = LoopedLM(tiny_config)
    init_weights(model, seed=3, std=0.1)
    path = save_checkpoint(model, tmp_path / "ckpt", dtype=dtype)
    assert sorted(p.name for p in path.iterdir()) == ["config.json", SINGLE_FILE]

    loaded = load_checkpoint(path)
    assert loaded.config == tiny_config.replace(torch_dtype=str(dtype).removeprefix("torch."))
    assert checkpoint_dtype(path) == str(dtype).removeprefix("torch.")
    expected = {n: t.detach().to(dtype) for n, t in model.state_dict().items()}
    assert_same_tensors(loaded.state_dict(), expected)
    assert set(expected) == set(expected_shapes(tiny_config))
    assert ("lm_head.weight" in expected) != tiny_config.tie_word_embeddings

    # Saving what was loaded writes the same bytes.
    again = save_checkpoint(loaded, tmp_path / "again")
    assert (again / SINGLE_FILE).read_bytes() == (path / SINGLE_FILE).read_bytes()
    assert load_config(again) == load_config(path)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_random_checkpoint_loads_the_tensors_it_wrote(tiny_config, make_checkpoint, dtype):
    path = make_checkpoint(tiny_config, seed=1, dtype=dtype, std=0.1)
    loaded = load_checkpoint(path)
    assert loaded.config == tiny_config.replace(torch_dtype=str(dtype).removeprefix("torch."))
    assert_same_tensors(loaded.state_dict(), dict(random_tensors(tiny_config, 1, 0.1, dtype)))
    # An explicit dtype converts on load.
    widened = load_checkpoint(path, dtype=torch.float32)
    assert all(t.dtype == torch.float32 for t in widened.state_dict().values())


@pytest.mark.parametrize("tiny_config", ["ouro-r3", "llama-untied-gqa"], indirect=True)
def test_sharded_checkpoint_loads_like_a_single_file(tiny_config, make_checkpoint, tmp_path):
    max_shard_bytes = 30_000
    sharded = write_random_checkpoint(
        tiny_config, tmp_path / "sharded", seed=0, std=0.1, max_shard_bytes=max_shard_bytes
    )
    names = sorted(p.name for p in sharded.iterdir())
    shards = [n for n in names if n.endswith(".safetensors")]
    assert len(shards) >= 3
    assert SINGLE_FILE not in names and INDEX_FILE in names and "config.json" in names
    assert shards == [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    assert not [n for n in names if n.startswith(".") or n.endswith(".tmp")]

    weight_map = json.loads((sharded / INDEX_FILE).read_text())["weight_map"]
    assert set(weight_map) == set(expected_shapes(tiny_config))
    assert set(weight_map.values()) == set(shards)
    for shard in shards:
        tensors = load_file(sharded / shard)
        assert all(weight_map[n] == shard for n in tensors)
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        assert nbytes <= max_shard_bytes or len(tensors) == 1, shard  # only a lone big tensor overflows

    single = load_checkpoint(make_checkpoint(tiny_config, seed=0, std=0.1))
    assert_same_tensors(load_checkpoint(sharded).state_dict(), single.state_dict())
    assert load_config(sharded) == load_config(make_checkpoint(tiny_config, seed=0, std=0.1))


def test_demo_resolves_and_loads():
    path = resolve_checkpoint("demo")
    assert (path / "config.json").is_file() and (path / SINGLE_FILE).is_file()
    model = load_checkpoint("demo")
    assert model.config.model_type == "ouro"
    assert model.config.num_loops == 4
    assert validate_checkpoint(path, model.config)
    with torch.no_grad():
        out = model(torch.tensor([[1, 2, 3]]), all_depths=True)
    assert len(out.logits) == 4 and all(torch.isfinite(x.float()).all() for x in out.logits)


def test_write_refuses_a_non_empty_directory_and_keeps_it(tiny_config, tmp_path):
    out = tmp_path / "taken"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(CheckpointError, match="exists and is not an empty directory") as info:
        write_random_checkpoint(tiny_config, out)
    assert str(out) in str(info.value)
    assert [p.name for p in out.iterdir()] == ["notes.txt"]


def test_failed_write_leaves_nothing_behind(tiny_config, tmp_path):
    def tensors():
        for i, item in enumerate(random_tensors(tiny_config, 0)):
            if i == 3:
                raise RuntimeError("disk full")
            yield item

    with pytest.raises(RuntimeError, match="disk full"):
        write_checkpoint(tiny_config, tensors, tmp_path / "ckpt", max_shard_bytes=10_000)
    assert list(tmp_path.iterdir()) == []


# -- bad checkpoints ---------------------------------------------------------------------------


@pytest.fixture
def broken(make_checkpoint, tmp_path) -> Path:
    """A private copy of the tiny Ouro checkpoint, to damage."""
    path = tmp_path / "broken"
    shutil.copytree(make_checkpoint(PRESETS["tiny-ouro"]), path)
    return path


def _rewrite_weights(path: Path, change) -> None:
    tensors = load_file(path / SINGLE_FILE)
    change(tensors)
    save_file(tensors, path / SINGLE_FILE, metadata={"format": "pt"})


def _edit_config(path: Path, **fields) -> None:
    raw = json.loads((path / "config.json").read_text())
    raw.update(fields)
    (path / "config.json").write_text(json.dumps(raw))


def _fails(path, error: type[LoopcastError], *fragments: str) -> str:
    with pytest.raises(error) as info:
        load_checkpoint(path)
    message = str(info.value)
    assert "\n" not in message
    for fragment in fragments:
        assert fragment in message, message
    return message


def test_missing_directory(tmp_path):
    _fails(tmp_path / "nowhere", CheckpointError, str(tmp_path / "nowhere"), "not found")


def test_missing_config(broken):
    (broken / "config.json").unlink()
    _fails(broken, ConfigError, str(broken / "config.json"), "config.json not found")


def test_malformed_config(broken):
    (broken / "config.json").write_text("{ not json")
    _fails(broken, ConfigError, "config.json", "not valid JSON")


def test_config_missing_a_field(broken):
    raw = json.loads((broken / "config.json").read_text())
    del raw["hidden_size"]
    (broken / "config.json").write_text(json.dumps(raw))
    _fails(broken, ConfigError, "hidden_size")


def test_missing_weights(broken):
    (broken / SINGLE_FILE).unlink()
    _fails(broken, CheckpointError, str(broken), "no weights", SINGLE_FILE)


def test_unknown_model_type(broken):
    _edit_config(broken, model_type="gpt2")
    _fails(broken, ConfigError, "unknown model_type 'gpt2'", "ouro", "llama")


def test_unsupported_feature(broken):
    _edit_config(broken, rope_parameters={"rope_type": "longrope", "rope_theta": 1e4, "factor": 2.0})
    _fails(broken, ConfigError, "rope type 'longrope' is not supported")


def test_missing_tensor_is_named(broken):
    name = "model.layers.1.mlp.down_proj.weight"
    _rewrite_weights(broken, lambda t: t.pop(name))
    _fails(broken, CheckpointError, f"tensor {name} is missing")


def test_tensor_of_wrong_shape_is_named(broken):
    name = "model.layers.0.self_attn.k_proj.weight"
    _rewrite_weights(broken, lambda t: t.__setitem__(name, torch.zeros(32, 64)))
    _fails(broken, CheckpointError, f"tensor {name} has shape [32, 64]", "expected [64, 64]")


def test_unexpected_tensor_is_named(broken):
    _rewrite_weights(broken, lambda t: t.__setitem__("model.extra.weight", torch.zeros(2)))
    _fails(broken, CheckpointError, "unexpected tensor model.extra.weight")


def test_integer_tensor_is_named(broken):
    name = "model.norm.weight"
    _rewrite_weights(broken, lambda t: t.__setitem__(name, torch.ones(64, dtype=torch.int32)))
    _fails(broken, CheckpointError, f"tensor {name} has dtype I32", "floating-point")


def test_corrupt_weights_file(broken):
    (broken / SINGLE_FILE).write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{garbage")
    _fails(broken, CheckpointError, SINGLE_FILE, "not a readable safetensors file")


def test_missing_shard_is_named(tmp_path):
    path = write_random_checkpoint(PRESETS["tiny-llama"], tmp_path / "sharded", max_shard_bytes=30_000)
    shard = sorted(path.glob("model-*.safetensors"))[1]
    shard.unlink()
    _fails(path, CheckpointError, shard.name, "is missing")


@pytest.mark.parametrize(
    "config",
    [
        PRESETS["tiny-ouro"],
        PRESETS["tiny-llama"],
        PRESETS["tiny-qwen2"],
        PRESETS["tiny-llama"].replace(qkv_bias=True, o_bias=True, mlp_bias=True, tie_word_embeddings=False),
        PRESETS["tiny-ouro"].replace(num_prelude_layers=1, num_coda_layers=2),
    ],
    ids=["ouro", "llama", "qwen2", "llama-biases", "ouro-prelude-coda"],
)
def test_expected_shapes_are_the_reference_state_dict(config):
    """The torch-free shape table (what export validates against) is the reference's layout."""
    with torch.device("meta"):
        model = LoopedLM(config)
    assert expected_shapes(config) == {n: tuple(p.shape) for n, p in sorted(model.state_dict().items())}
