"""Every graph kind against the torch reference (CPU EP, fp32): logits, argmax and KV."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from loopcast.exporter.reference import KVCache
from loopcast.ort_runtime.binding.generator import Generator
from loopcast.ort_runtime.loading.artifact import open_artifact

from tests.artifacts import TINY, artifact, reference

ATOL = RTOL = 1e-4
CASES = list(TINY) + ["demo"]


def _close(actual: np.ndarray, expected: torch.Tensor) -> None:
    expected = expected.detach().numpy()
    np.testing.assert_allclose(actual, expected, rtol=RTOL, atol=ATOL)


def _check_kv(gen: Generator, cache: KVCache, slots, stop: int) -> None:
    for slot in slots:
        key, value = gen.kv_arrays(slot)
        np.testing.assert_allclose(
            key[0, :, :stop],
            cache.key[slot, 0, :, :stop].numpy(),
            rtol=RTOL,
            atol=ATOL,
            err_msg=f"key slot {slot}",
        )
        np.testing.assert_allclose(
            value[0, :, :stop],
            cache.value[slot, 0, :, :stop].numpy(),
            rtol=RTOL,
            atol=ATOL,
            err_msg=f"value slot {slot}",
        )


@pytest.mark.parametrize("name", CASES)
def test_every_graph_kind_matches_reference(name: str) -> None:
    model = reference(name)
    cfg = model.config
    path = artifact(name)
    loaded = open_artifact(path)
    gen = Generator(loaded)
    W = loaded.manifest.verify_width
    cache = KVCache(cfg, loaded.manifest.max_length)
    rng = np.random.default_rng(7)
    prompt = rng.integers(3, cfg.vocab_size, 9).tolist()

    with torch.no_grad():
        # prefill: the last row's logits and next token; KV of every slot.
        ref = model(torch.tensor([prompt]), start=0, cache=cache)
        out = gen.run("prefill", 0, tokens=prompt)
        _close(out.logits[-1], ref.final_logits[0, -1])
        assert int(out.next_ids[-1]) == int(ref.final_logits[0, -1].argmax())
        gen.commit(prompt)
        _check_kv(gen, cache, range(cfg.num_kv_slots), len(prompt))

        # decode one row at n.
        token = int(out.next_ids[-1])
        ref = model(torch.tensor([[token]]), start=gen.n, cache=cache)
        out = gen.run("decode", gen.n, tokens=[token])
        _close(out.logits, ref.final_logits[0])
        gen.commit([token])

        # verify W rows at n (rows attend causally to each other and the prefix).
        rows = rng.integers(3, cfg.vocab_size, W).tolist()
        ref = model(torch.tensor([rows]), start=gen.n, cache=cache)
        out = gen.run("verify", gen.n, tokens=rows)
        _close(out.logits, ref.final_logits[0])
        assert out.next_ids.tolist() == ref.final_logits[0].argmax(-1).tolist()
        gen.commit(rows)
        _check_kv(gen, cache, range(cfg.num_kv_slots), gen.n)

        if cfg.num_loops > 1:
            d = loaded.manifest.draft_depth
            token = int(out.next_ids[-1])
            ref_d = model(torch.tensor([[token]]), start=gen.n, cache=cache, last_loop=d)
            out = gen.run("draft", gen.n, tokens=[token])
            _close(out.logits, ref_d.final_logits[0])
            _close(out.hidden, ref_d.hidden[-1][0])
            assert int(out.next_ids[0]) == int(ref_d.final_logits[0, 0].argmax())
            top2 = torch.topk(ref_d.final_logits[0, 0], 2).values
            assert out.top2_gap == pytest.approx(float(top2[0] - top2[1]), abs=1e-4)
            # draft wrote only depth<d slots at n; verify_tail fed the reference's depth-d
            # states must equal the full model.
            hidden = torch.cat([ref_d.hidden[-1]] * W, dim=1)
            ref_t = model(None, start=gen.n, cache=cache, first_loop=d, hidden_BSH=hidden)
            out = gen.run("verify_tail", gen.n, hidden=hidden[0].numpy())
            _close(out.logits, ref_t.final_logits[0])
            assert out.next_ids.tolist() == ref_t.final_logits[0].argmax(-1).tolist()
            gen.commit([token] * W)
            _check_kv(gen, cache, range(cfg.num_kv_slots), gen.n)


@pytest.mark.parametrize("name", ["ouro-r3", "llama-tied-gqa", "demo"])
def test_prefill_in_chunks_equals_one_call(name: str) -> None:
    loaded = open_artifact(artifact(name))
    cfg = loaded.config
    prompt = np.random.default_rng(3).integers(3, cfg.vocab_size, 23).tolist()
    whole, chunked = Generator(loaded), Generator(loaded)
    t_whole = whole.prefill(prompt)
    t_chunked = chunked.prefill(prompt, chunk=5)
    assert t_whole == t_chunked
    for slot in range(cfg.num_kv_slots):
        for a, b in zip(whole.kv_arrays(slot), chunked.kv_arrays(slot)):
            np.testing.assert_allclose(a[0, :, :23], b[0, :, :23], rtol=1e-5, atol=1e-5)


def test_verify_tail_reads_hidden_at_depth_d_for_every_depth() -> None:
    """Export with each possible draft depth; draft(d) equals the reference stopped at d."""
    name = "ouro-r4-1layer"
    model = reference(name)
    for d in range(1, model.config.num_loops):
        loaded = open_artifact(artifact(name, draft_depth=d))
        gen = Generator(loaded)
        cache = KVCache(model.config, loaded.manifest.max_length)
        with torch.no_grad():
            ref = model(torch.tensor([[5]]), start=0, cache=cache, last_loop=d)
        out = gen.run("draft", 0, tokens=[5])
        _close(out.logits, ref.final_logits[0])
        _close(out.hidden, ref.hidden[-1][0])
