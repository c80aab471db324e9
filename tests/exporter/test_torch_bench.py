"""The PyTorch decode baseline: the timed step is the reference's decode (same next token as
``LoopedLM.forward`` on the same cache), timings are positive, and the traffic model matches a
count of the state_dict's parameters."""

from __future__ import annotations

import copy

import pytest
import torch
from loopcast.exporter.reference import LoopedLM, init_weights
from loopcast.exporter.torch_bench import (
    bytes_per_decode_step,
    decode_step_fn,
    decode_step_ms,
    device_bandwidth_gbs,
    floor_ms,
    load_reference,
    random_cache,
)

from loopcast.errors import RequestError
from loopcast.presets import PRESETS

# Not in the shared set: prelude and coda layers must be counted and run too.
PRELUDE_CODA = PRESETS["tiny-ouro"].replace(num_loops=2, num_prelude_layers=1, num_coda_layers=1)
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture
def model(tiny_config, make_checkpoint) -> LoopedLM:
    return load_reference(make_checkpoint(tiny_config), torch.float32, "cpu")


def prelude_coda_model() -> LoopedLM:
    model = LoopedLM(PRELUDE_CODA)
    init_weights(model, seed=3, std=0.1)
    return model.eval().requires_grad_(False)


@torch.no_grad()
def assert_step_matches_forward(model: LoopedLM, max_length: int = 24) -> None:
    vocab = model.config.vocab_size
    for past in (0, 5, max_length - 1):
        cache = random_cache(model, past=past, max_length=max_length, seed=past)
        step = decode_step_fn(model, cache, past)
        tokens = [(11 * i + past) % vocab for i in range(4)]
        expected, actual = [], []
        for token in tokens:
            ids_B1 = torch.tensor([[token]])
            reference_cache = copy.deepcopy(cache)  # forward and step each write row `past`
            logits_V = model(ids_B1, start=past, cache=reference_cache).final_logits[0, -1]
            expected.append(int(logits_V.argmax()))
            actual.append(int(step(ids_B1)[0]))
        assert actual == expected, f"past={past}"


def test_load_reference_is_frozen_eval(model):
    assert not model.training
    assert not any(p.requires_grad for p in model.parameters())


def test_step_gives_the_forward_next_token(model):
    assert_step_matches_forward(model)


def test_step_runs_prelude_and_coda():
    assert_step_matches_forward(prelude_coda_model())


@pytest.mark.parametrize("tiny_config", ["ouro-r3"], indirect=True)
def test_step_refuses_a_position_outside_the_cache(model):
    cache = random_cache(model, past=3, max_length=8)
    with pytest.raises(RequestError, match="max_length"):
        decode_step_fn(model, cache, 8)


@pytest.mark.parametrize("tiny_config", ["ouro-r3", "llama-tied-gqa"], indirect=True)
def test_eager_step_time_is_positive_on_cpu(model):
    ms = decode_step_ms(model, past=7, max_length=16, cuda_graph=False, iters=3, warmup=1)
    assert isinstance(ms, float) and ms > 0


@pytest.mark.parametrize("tiny_config", ["ouro-r3"], indirect=True)
def test_cuda_graph_on_cpu_is_refused(model):
    with pytest.raises(ValueError, match="CUDA"):
        decode_step_ms(model, past=3, max_length=8, cuda_graph=True)


@pytest.mark.parametrize("config", [*PRESETS.values(), PRELUDE_CODA], ids=[*PRESETS, "prelude-coda"])
def test_bytes_per_step_counts_core_weights_once_per_loop(config):
    with torch.device("meta"):
        state = LoopedLM(config).state_dict()
    core_prefixes = ("model.layers.", "model.norm.")
    core = sum(t.numel() for n, t in state.items() if n.startswith(core_prefixes))
    gate = sum(t.numel() for n, t in state.items() if "early_exit_gate" in n)
    embed = state["model.embed_tokens.weight"]
    # The rest, less the gate (not computed) and the embedding, which is gathered one row at a
    # time; a tied head reads it whole once more.
    rest = sum(t.numel() for t in state.values()) - core - gate - embed.numel() + embed.shape[1]
    if config.tie_word_embeddings:
        rest += embed.numel()
    past, dtype_bytes = 37, 2
    kv = (
        (config.num_loops * config.num_layers + config.num_prelude_layers + config.num_coda_layers)
        * 2
        * config.num_kv_heads
        * (past + 1)
        * config.head_dim
        * dtype_bytes
    )

    counted = bytes_per_decode_step(config, dtype_bytes, past)
    assert counted == {
        "weights": (config.num_loops * core + rest) * dtype_bytes,
        "kv": kv,
        "total": (config.num_loops * core + rest) * dtype_bytes + kv,
    }


def test_ouro_1p4b_floor_is_weight_bound():
    # Ouro-1.4B in fp16: ~1.2B core params read 4 times, so ~10 GB per step before any KV.
    counted = bytes_per_decode_step(PRESETS["ouro-1.4b"], 2, past=1023)
    assert 9.5e9 < counted["weights"] < 11e9
    assert counted["kv"] == 96 * 2 * 16 * 1024 * 128 * 2
    assert floor_ms(counted["total"], 4000.0) == pytest.approx(counted["total"] / 4e12 * 1e3)


def test_bandwidth_is_positive_on_cpu():
    assert device_bandwidth_gbs("cpu", nbytes=2**22, iters=3) > 0


def test_floor_refuses_zero_bandwidth():
    with pytest.raises(ValueError, match="bandwidth"):
        floor_ms(10**9, 0.0)


@needs_cuda
@pytest.mark.parametrize("tiny_config", ["ouro-r2-gqa-v100"], indirect=True)
def test_cuda_graph_step_times_are_positive(model):
    model = model.to("cuda")
    for cuda_graph in (False, True):
        assert decode_step_ms(model, past=9, max_length=32, cuda_graph=cuda_graph, iters=5) > 0
