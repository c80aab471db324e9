"""The torch reference (the oracle): cached vs full-recompute greedy decoding, logits at every
loop depth through the entry points, the verify_tail contract, and Ouro's exit distribution."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from loopcast.exporter.checkpoint import load_checkpoint
from loopcast.exporter.reference import KVCache, LoopedLM, exit_probabilities
from loopcast.exporter.reference_generate import greedy_generate, greedy_generate_recompute

from loopcast.errors import LoopcastError, RequestError
from loopcast.presets import PRESETS

# fp32 on CPU: the cached and recomputed paths differ only in summation order.
ATOL = 1e-5
OURO = ["ouro-r3", "ouro-r2-gqa-v100", "ouro-r4-1layer-mqa"]
# Not in the shared set (the ONNX exporter may not take it): P/C > 0 must cost nothing here.
PRELUDE_CODA = PRESETS["tiny-ouro"].replace(num_loops=2, num_prelude_layers=1, num_coda_layers=1)
GENERATORS = [greedy_generate, greedy_generate_recompute]


def close(actual: torch.Tensor, expected: torch.Tensor, atol: float = ATOL) -> None:
    torch.testing.assert_close(actual, expected, atol=atol, rtol=0)


def prompt_of(length: int, vocab: int) -> list[int]:
    return [(7 * i + 3) % vocab for i in range(length)]


@pytest.fixture
def model(tiny_config, make_checkpoint) -> LoopedLM:
    return load_checkpoint(make_checkpoint(tiny_config), dtype=torch.float32)


@torch.no_grad()
def entry_points(
    model: LoopedLM, ids_BS: torch.Tensor, depth: int, *, start: int = 0, cache: KVCache | None = None
) -> torch.Tensor:
    """embed → prelude → core_loop(0..depth-1) → coda → head, called one by one."""
    ctx = model.context(start, ids_BS.shape[1], cache)
    x = model.prelude(model.embed(ids_BS), ctx)
    for loop in range(depth):
        x = model.core_loop(x, loop, ctx)
    return model.head(model.coda(x, ctx))


# -- cached decoding vs full recompute ---------------------------------------------------------


@pytest.mark.parametrize("prompt_len", [1, 9])
def test_cached_generation_matches_full_recompute(model, prompt_len):
    prompt = prompt_of(prompt_len, model.config.vocab_size)
    cached = greedy_generate(model, prompt, 16, keep_logits=True)
    full = greedy_generate_recompute(model, prompt, 16, keep_logits=True)
    assert cached.tokens == full.tokens
    assert len(cached.tokens) == 16
    assert cached.finish_reason == full.finish_reason == "length"
    close(torch.stack(cached.step_logits), torch.stack(full.step_logits))
    assert torch.isfinite(torch.stack(cached.step_logits)).all()


def test_cached_generation_matches_full_recompute_at_every_depth(model):
    prompt = prompt_of(5, model.config.vocab_size)
    for depth in range(1, model.config.num_loops + 1):
        cached = greedy_generate(model, prompt, 6, depth=depth, keep_logits=True)
        full = greedy_generate_recompute(model, prompt, 6, depth=depth, keep_logits=True)
        assert cached.tokens == full.tokens, f"depth {depth}"
        close(torch.stack(cached.step_logits), torch.stack(full.step_logits))


@pytest.mark.parametrize("prompt_len", [1, 15, 16])
def test_generation_stops_at_capacity_identically(model, prompt_len):
    # The last token needs no KV of its own, so a prompt of P tokens in a capacity of S yields
    # S - P + 1 tokens (one token when the prompt fills the cache exactly).
    max_length = 16
    prompt = prompt_of(prompt_len, model.config.vocab_size)
    cached = greedy_generate(model, prompt, 1000, max_length=max_length, keep_logits=True)
    full = greedy_generate_recompute(model, prompt, 1000, max_length=max_length, keep_logits=True)
    assert cached.tokens == full.tokens
    assert len(cached.tokens) == max_length - prompt_len + 1
    assert cached.finish_reason == full.finish_reason == "capacity"
    close(torch.stack(cached.step_logits), torch.stack(full.step_logits))


@pytest.mark.parametrize("tiny_config", ["ouro-r2-gqa-v100", "llama-untied-gqa"], indirect=True)
@pytest.mark.parametrize("room", [0, 2])
def test_default_max_length_is_max_position_embeddings(model, room):
    limit = model.config.max_position_embeddings
    prompt = prompt_of(limit - room, model.config.vocab_size)
    results = [gen(model, prompt, 100) for gen in GENERATORS]
    assert results[0].tokens == results[1].tokens
    assert len(results[0].tokens) == room + 1
    assert results[0].finish_reason == results[1].finish_reason == "capacity"


@pytest.mark.parametrize("tiny_config", ["ouro-r3", "llama-tied-gqa"], indirect=True)
def test_max_new_tokens_bounds_before_capacity(model):
    prompt = prompt_of(10, model.config.vocab_size)
    for gen in GENERATORS:
        exact = gen(model, prompt, 16 - 10 + 1, max_length=16)  # just fits: "length", not "capacity"
        assert (len(exact.tokens), exact.finish_reason) == (7, "length")
        none = gen(model, prompt, 0, max_length=16)
        assert (none.tokens, none.finish_reason) == ([], "length")


@pytest.mark.parametrize("tiny_config", ["ouro-r4-1layer-mqa", "llama-untied-gqa"], indirect=True)
def test_stop_id_ends_both_paths_and_is_kept(model):
    prompt = prompt_of(4, model.config.vocab_size)
    free = greedy_generate(model, prompt, 12).tokens
    stop = free[2]
    first = free.index(stop)
    for gen in GENERATORS:
        result = gen(model, prompt, 12, stop_ids=(stop,))
        assert result.tokens == free[: first + 1]
        assert result.finish_reason == "eos"


def test_prelude_and_coda_layers_decode_like_full_recompute(make_checkpoint):
    model = load_checkpoint(make_checkpoint(PRELUDE_CODA), dtype=torch.float32)
    prompt = prompt_of(6, model.config.vocab_size)
    cached = greedy_generate(model, prompt, 10, keep_logits=True)
    full = greedy_generate_recompute(model, prompt, 10, keep_logits=True)
    assert cached.tokens == full.tokens
    close(torch.stack(cached.step_logits), torch.stack(full.step_logits))
    ids = torch.tensor([prompt])
    with torch.no_grad():
        every = model(ids, all_depths=True)
        for depth in (1, 2):
            close(model(ids, last_loop=depth).final_logits, entry_points(model, ids, depth))
            close(every.logits[depth - 1], entry_points(model, ids, depth))


def test_all_depths_with_cache_and_coda_layers_is_refused(make_checkpoint):
    """A shallower depth's coda would need its own KV; the reference refuses to guess."""
    model = load_checkpoint(make_checkpoint(PRELUDE_CODA), dtype=torch.float32)
    cache = KVCache(model.config, 16)
    with torch.no_grad(), pytest.raises(ValueError, match="coda layers"):
        model(torch.tensor([prompt_of(6, model.config.vocab_size)]), cache=cache, all_depths=True)
    with torch.no_grad():  # without a cache every depth is defined
        assert len(model(torch.tensor([[1, 2, 3]]), all_depths=True).logits) == model.config.num_loops


# -- logits at every depth ---------------------------------------------------------------------


def test_logits_at_every_depth_without_cache(model):
    ids = torch.tensor([prompt_of(7, model.config.vocab_size), prompt_of(7, 50)[::-1]])
    with torch.no_grad():
        every = model(ids, all_depths=True)
        assert len(every.logits) == len(every.hidden) == model.config.num_loops
        for depth in range(1, model.config.num_loops + 1):
            shallow = model(ids, last_loop=depth)
            manual = entry_points(model, ids, depth)
            assert shallow.final_logits.shape == (2, 7, model.config.vocab_size)
            close(shallow.final_logits, manual)
            close(every.logits[depth - 1], manual)
            # The hidden state at depth d is what the lm_head reads at depth d (P = C = 0 here).
            close(model.head(every.hidden[depth - 1]), manual)


def test_logits_at_every_depth_with_cache(model):
    """Prefill then a two-row step at start > 0; each cached way equals a no-cache recompute."""
    cfg = model.config
    prompt, step = prompt_of(6, cfg.vocab_size), [5, 11]
    prompt_ids, step_ids = torch.tensor([prompt]), torch.tensor([step])
    n = len(prompt)
    with torch.no_grad():
        for depth in range(1, cfg.num_loops + 1):
            full = model(torch.tensor([prompt + step]), last_loop=depth).final_logits[:, n:]

            cache = KVCache(cfg, 16)
            close(
                model(prompt_ids, cache=cache, last_loop=depth).final_logits,
                model(prompt_ids, last_loop=depth).final_logits,
            )
            close(model(step_ids, start=n, cache=cache, last_loop=depth).final_logits, full)

            cache = KVCache(cfg, 16)
            entry_points(model, prompt_ids, depth, cache=cache)
            close(entry_points(model, step_ids, depth, start=n, cache=cache), full)

            cache = KVCache(cfg, 16)
            model(prompt_ids, cache=cache, all_depths=True)
            close(model(step_ids, start=n, cache=cache, all_depths=True).logits[depth - 1], full)


@pytest.mark.parametrize("tiny_config", OURO, indirect=True)
def test_verify_tail_from_depth_d_equals_full_model(model):
    cfg = model.config
    ids = torch.tensor([prompt_of(8, cfg.vocab_size)])
    with torch.no_grad():
        full = model(ids)
        for depth in range(1, cfg.num_loops):
            hidden = model(ids, last_loop=depth).hidden[-1]
            close(hidden, full.hidden[depth - 1])
            tail = model(first_loop=depth, hidden_BSH=hidden)
            close(tail.final_logits, full.final_logits)
            assert len(tail.hidden) == cfg.num_loops - depth
            for mine, theirs in zip(tail.hidden, full.hidden[depth:]):
                close(mine, theirs)
            for mine, theirs in zip(tail.gate_logits, full.gate_logits[depth:]):
                close(mine, theirs)


@torch.no_grad()
def _self_speculation_round(model: LoopedLM, cache: KVCache, start: int, rows: list[int], depth: int):
    """docs/architecture.md §5: rows run the draft one by one (depth < d KV), then verify_tail runs their
    depth-d hidden states through depths d..R-1 (depth >= d KV). Returns (draft, tail) logits."""
    hidden, draft_logits = [], []
    for i, token in enumerate(rows):
        out = model(torch.tensor([[token]]), start=start + i, cache=cache, last_loop=depth)
        hidden.append(out.hidden[-1])
        draft_logits.append(out.final_logits)
    tail = model(start=start, cache=cache, first_loop=depth, hidden_BSH=torch.cat(hidden, dim=1))
    return torch.cat(draft_logits, dim=1), tail.final_logits


@pytest.mark.parametrize("tiny_config", OURO, indirect=True)
def test_verify_tail_with_cache_and_rewind(model):
    """Draft + verify_tail on the cache equal a no-cache recompute, also after a rewind that
    leaves stale rows past n (they are rewritten before any row reads them)."""
    cfg = model.config
    prompt = prompt_of(5, cfg.vocab_size)
    n = len(prompt)
    first, second = [9, 4, 17], [30, 2, 8, 1]
    with torch.no_grad():
        for depth in range(1, cfg.num_loops):
            cache = KVCache(cfg, 16)
            model(torch.tensor([prompt]), cache=cache)
            draft, tail = _self_speculation_round(model, cache, n, first, depth)
            seq = torch.tensor([prompt + first])
            close(draft, model(seq, last_loop=depth).final_logits[:, n:])
            close(tail, model(seq).final_logits[:, n:])

            # Accept one row: n' = n + 1. Positions n+1.. hold the first round's stale KV.
            draft, tail = _self_speculation_round(model, cache, n + 1, second, depth)
            seq = torch.tensor([prompt + first[:1] + second])
            close(draft, model(seq, last_loop=depth).final_logits[:, n + 1 :])
            close(tail, model(seq).final_logits[:, n + 1 :])


def test_loop_range_is_checked(model):
    ids = torch.tensor([[1, 2]])
    with pytest.raises(ValueError, match="loop range"):
        model(ids, last_loop=model.config.num_loops + 1)
    with pytest.raises(ValueError, match="loop range"):
        model(ids, last_loop=0)
    if model.config.num_loops > 1:
        with pytest.raises(ValueError, match="hidden_BSH"):
            model(ids, first_loop=1)


# -- exit probabilities ------------------------------------------------------------------------


def exit_probabilities_numpy(gates_RN: np.ndarray) -> np.ndarray:
    """λ_r = σ(g_r); p_r = λ_r·Π_{s<r}(1-λ_s) for r < R-1; p_{R-1} = Π_{s<R-1}(1-λ_s)."""
    lam = 1.0 / (1.0 + np.exp(-gates_RN.astype(np.float64)))
    num_loops = lam.shape[0]
    probs = np.zeros_like(lam)
    for r in range(num_loops):
        survive = np.ones_like(lam[0])
        for s in range(r):
            survive = survive * (1.0 - lam[s])
        probs[r] = survive if r == num_loops - 1 else lam[r] * survive
    return probs


@pytest.mark.parametrize("num_loops", [1, 2, 3, 5])
def test_exit_probabilities_formula(num_loops):
    generator = torch.Generator().manual_seed(num_loops)
    gates = [torch.randn(2, 6, generator=generator) * 2 for _ in range(num_loops)]
    probs = exit_probabilities(gates)
    assert probs.shape == (2, 6, num_loops)
    expected = exit_probabilities_numpy(torch.stack(gates).numpy())  # [R, B, S]
    np.testing.assert_allclose(probs.numpy(), np.moveaxis(expected, 0, -1), atol=1e-6, rtol=0)
    np.testing.assert_allclose(probs.sum(-1).numpy(), 1.0, atol=1e-6, rtol=0)
    assert (probs >= 0).all()


@pytest.mark.parametrize("tiny_config", OURO, indirect=True)
def test_exit_gate_reads_the_loop_normed_state(model):
    model.model.early_exit_gate.bias.data.fill_(-1.5)  # random checkpoints have a zero bias
    ids = torch.tensor([prompt_of(6, model.config.vocab_size)])
    with torch.no_grad():
        out = model(ids)
    assert len(out.gate_logits) == model.config.num_loops
    weight = model.model.early_exit_gate.weight.detach().numpy().astype(np.float64)  # [1, H]
    bias = float(model.model.early_exit_gate.bias.detach())
    gates = np.stack([h[0].numpy().astype(np.float64) @ weight[0] + bias for h in out.hidden])  # [R, S]
    np.testing.assert_allclose(torch.stack(out.gate_logits)[:, 0].numpy(), gates, atol=1e-5, rtol=0)
    probs = exit_probabilities(out.gate_logits)[0]  # [S, R]
    np.testing.assert_allclose(probs.numpy(), exit_probabilities_numpy(gates).T, atol=1e-5, rtol=0)
    np.testing.assert_allclose(probs.sum(-1).numpy(), 1.0, atol=1e-6, rtol=0)


@pytest.mark.parametrize("tiny_config", ["llama-tied-gqa", "llama-untied-gqa"], indirect=True)
def test_llama_has_one_loop_and_no_gate(model):
    with torch.no_grad():
        out = model(torch.tensor([[1, 2, 3]]))
    assert model.config.num_loops == 1
    assert out.gate_logits == [] and len(out.logits) == 1


# -- bad requests ------------------------------------------------------------------------------


@pytest.mark.parametrize("tiny_config", ["ouro-r3"], indirect=True)
@pytest.mark.parametrize("generate", GENERATORS, ids=["cached", "recompute"])
def test_bad_requests_name_the_problem(model, generate):
    vocab = model.config.vocab_size
    limit = model.config.max_position_embeddings
    cases = [
        (
            dict(prompt_ids=list(range(17)), max_new_tokens=4, max_length=16),
            r"prompt of 17 tokens is longer than the max length 16",
        ),
        (
            dict(prompt_ids=[1] * (limit + 1), max_new_tokens=4),
            rf"prompt of {limit + 1} tokens is longer than the max length {limit}",
        ),
        (
            dict(prompt_ids=[1, vocab, 2], max_new_tokens=4),
            rf"token id {vocab} is outside the vocabulary \[0, {vocab}\)",
        ),
        (dict(prompt_ids=[1, -1], max_new_tokens=4), r"token id -1 is outside the vocabulary"),
        (dict(prompt_ids=[1, 2], max_new_tokens=-1), r"max_new_tokens must be >= 0, got -1"),
        (dict(prompt_ids=[], max_new_tokens=4), r"prompt is empty"),
    ]
    for kwargs, message in cases:
        kwargs = dict(kwargs)
        with pytest.raises(RequestError, match=message) as info:
            generate(model, kwargs.pop("prompt_ids"), kwargs.pop("max_new_tokens"), **kwargs)
        assert isinstance(info.value, LoopcastError)
