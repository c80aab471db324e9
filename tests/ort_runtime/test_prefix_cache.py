"""Prefix caching in the batching engine (ort_runtime/batching/prefix_cache.py): a prompt whose
prefix another request computed reuses that KV (in place in a freed slot, or copied from a
running one), and gets exactly the tokens of a cold prompt (CPU fp32, greedy)."""

from __future__ import annotations

import random
import time

import pytest
from loopcast.ort_runtime import load
from loopcast.ort_runtime.batching.engine import BatchingEngine, BatchRequest
from loopcast.ort_runtime.batching.prefix_cache import PrefixCache, PrefixPlan
from loopcast.ort_runtime.binding.batch_generator import BatchGenerator

from tests.artifacts import artifact, require_exact_cpu_artifacts


@pytest.fixture(scope="module")
def model():
    require_exact_cpu_artifacts()
    return load(artifact("ouro-r3", max_batch=4))


def plain(model, prompt, n):
    return list(model.stream_ids(prompt, n, stop_ids=()))


def test_plan_keeps_the_batch_narrow_in_place_or_copied_lru():
    cache = PrefixCache(4)
    cache.release(2, [1, 2, 3, 4])
    cache.release(1, [9, 9])
    # nothing runs: the lowest free slot, the match in slot 2 copied there
    assert cache.plan([1, 2, 3, 7], [0, 1, 2, 3], {}) == PrefixPlan(0, 2, 3)
    # slot 3 runs: a free slot inside the batch, least recently freed first (never used: 0)
    assert cache.plan([5, 6, 7, 8], [0, 1, 2], {3: [5, 6, 7]}) == PrefixPlan(0, 3, 3)
    # the match is in a free slot inside the batch: in place; the whole prompt is cached but its
    # last token still runs (its row gives the first generated token)
    assert cache.plan([1, 2, 3, 4], [1, 2], {3: [8]}) == PrefixPlan(2, 2, 3)
    # nothing matches: the least recently freed slot inside the batch (2 was freed before 1)
    assert cache.plan([8], [1, 2], {3: [7]}) == PrefixPlan(2, None, 0)
    assert cache.plan([8], [1, 2], {}) == PrefixPlan(1, None, 0)
    assert cache.stats["prefix_queries"] == 5 and cache.stats["prefix_hit_tokens"] == 9
    cache.occupy(2)
    assert cache.held(2) == [] and cache.plan([1, 2, 3], [2], {}) == PrefixPlan(2, None, 0)


def test_cached_prefix_gives_the_cold_tokens(model):
    """Freed slots keep their prefix through other sequences' steps (the dummy rows write past it),
    a running slot's prefix is copied, capacity evicts: every request gets its cold tokens, and
    cached_tokens says how many prompt tokens were reused."""
    rng = random.Random(5)
    base = [rng.randrange(12, 50) for _ in range(14)]
    a_prompt, d_prompt = base + [4], [7, 8, 9, 10]
    # the references first: B decodes alone while the test thread works between submissions, and
    # B must still be running (below its capacity) when D arrives
    a_cold = plain(model, a_prompt, 3)
    d_cold = plain(model, d_prompt, 5)
    engine = BatchingEngine(BatchGenerator(model.loaded, max_batch=3))
    # A (slot 0) finishes while B (slot 1) runs on: every step of B runs a dummy row in slot 0
    a = engine.submit(BatchRequest(base + [4], 3))
    b = engine.submit(BatchRequest([7, 8, 9], 10_000))
    engine.start()
    try:
        assert a.result(30) == a_cold and a.cached_tokens == 0
        # C continues A's prompt and first generated tokens: in place in A's freed slot
        c_prompt = a_prompt + a.tokens[:2] + [5]
        c = engine.submit(BatchRequest(c_prompt, 6))
        c_tokens = c.result(30)
        # D shares B's prompt while B runs: copied from B's slot into slot 0
        d = engine.submit(BatchRequest(d_prompt, 5))
        assert d.result(30) == d_cold and d.cached_tokens == 3
        assert not b.finish_reason  # B was running throughout
        assert c_tokens == plain(model, c_prompt, 6)
        assert c.cached_tokens == len(base) + 3
        # the same prompt again: all but its last token cached
        e = engine.submit(BatchRequest(d_prompt, 5))
        assert e.result(30) == d.tokens and e.cached_tokens == len(d_prompt) - 1
        b.cancel()
        b.result(30)
        assert b.tokens == plain(model, [7, 8, 9], len(b.tokens))
        # capacity: three unrelated prompts run in the three slots and evict every cached prefix
        others = [
            engine.submit(BatchRequest([rng.randrange(50, 90) for _ in range(5)], 10_000)) for _ in range(3)
        ]
        deadline = time.monotonic() + 30
        while sum(len(o.tokens) > 1 for o in others) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        for o in others:
            o.cancel()
            o.result(30)
            assert o.tokens == plain(model, o.request.ids, len(o.tokens))
        f = engine.submit(BatchRequest(d_prompt, 5))
        assert f.result(30) == d.tokens and f.cached_tokens == 0
        assert engine.prefix_caching == "on"
        assert engine.stats["prefix_hit_tokens"] == c.cached_tokens + d.cached_tokens + e.cached_tokens
    finally:
        engine.shutdown()


def test_concurrent_shared_prefixes_with_speculation_equal_plain(model):
    """Many requests over a few shared system-prompt-like prefixes, concurrently, greedy and
    prompt-lookup: every one gets the cold tokens; most reuse a prefix."""
    rng = random.Random(9)
    stems = [[rng.randrange(3, 12) for _ in range(10)] for _ in range(2)]
    work = [(stems[i % 2] + [rng.randrange(3, 12) for _ in range(rng.randrange(1, 6))], 8) for i in range(10)]
    expected = [plain(model, p, k) for p, k in work]
    engine = BatchingEngine(BatchGenerator(model.loaded, max_batch=4)).start()
    try:
        done = [
            engine.submit(BatchRequest(p, k, speculative="prompt-lookup" if i % 2 else "none"))
            for i, (p, k) in enumerate(work)
        ]
        assert [c.result(60) for c in done] == expected
        assert sum(c.cached_tokens > 0 for c in done) >= len(work) // 2
    finally:
        engine.shutdown()


def test_prefix_caching_off(model):
    engine = BatchingEngine(BatchGenerator(model.loaded, max_batch=2), prefix_caching=False).start()
    try:
        first = engine.submit(BatchRequest([3, 4, 5, 6], 4))
        first.result(30)
        again = engine.submit(BatchRequest([3, 4, 5, 6], 4))
        assert again.result(30) == first.tokens and again.cached_tokens == 0
        assert engine.prefix_caching == "off (turned off)" and "prefix_hits" not in engine.stats
    finally:
        engine.shutdown()
