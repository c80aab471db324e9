"""Concurrency rules of LoopcastModel (ort_runtime/api.py): the convenience methods never share
a generator, so interleaved streams and calls from several threads return exactly the tokens
of sequential runs."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from loopcast.ort_runtime import load

from tests.artifacts import artifact

MODES = [("none", "always"), ("prompt-lookup", "always"), ("self", "always")]


@pytest.fixture(scope="module")
def model():
    return load(artifact("ouro-r3", draft_depth=1, max_length=96))


@pytest.fixture(scope="module")
def prompts(model) -> list[list[int]]:
    rng = np.random.default_rng(11)
    out = [rng.integers(1, model.config.vocab_size, n).tolist() for n in (3, 7, 12, 5)]
    out.append([4, 5, 6, 4, 5, 6, 4, 5])  # repetitive: prompt lookup proposes drafts
    return out


def _sequential(model, prompts, mode) -> list[list[int]]:
    return [model.generate(p, 24, speculative=mode[0], gate=mode[1]).tokens for p in prompts]


@pytest.mark.parametrize("mode", MODES, ids=[m[0] for m in MODES])
def test_interleaved_streams_equal_sequential_runs(model, prompts, mode) -> None:
    expected = _sequential(model, prompts, mode)
    streams = [model.stream_ids(p, 24, speculative=mode[0], gate=mode[1]) for p in prompts]
    got: list[list[int]] = [[] for _ in prompts]
    live = set(range(len(prompts)))
    while live:
        for i in sorted(live):  # one token from each stream in turn
            try:
                got[i].append(next(streams[i]))
            except StopIteration:
                live.discard(i)
    assert got == expected


def test_text_streams_interleave() -> None:
    demo = load(artifact("demo"))
    prompts = ["def add(a, b):\n", "class Stack:\n"]
    expected = [demo.generate(p, 16).text for p in prompts]
    a, b = demo.stream(prompts[0], 16), demo.stream(prompts[1], 16)
    texts = ["", ""]
    for pa, pb in zip(a, b):
        texts[0] += pa.text
        texts[1] += pb.text
    texts[0] += "".join(p.text for p in a)
    texts[1] += "".join(p.text for p in b)
    assert texts == expected


def test_threads_equal_sequential_runs(model, prompts) -> None:
    expected = {mode: _sequential(model, prompts, mode) for mode in MODES}
    failures: list[str] = []

    def worker(k: int) -> None:
        for round_ in range(3):
            mode = MODES[(k + round_) % len(MODES)]
            for i in range(len(prompts)):
                j = (i + k) % len(prompts)
                tokens = model.generate(prompts[j], 24, speculative=mode[0], gate=mode[1]).tokens
                if tokens != expected[mode][j]:
                    failures.append(f"thread {k} {mode} prompt {j}: {tokens} != {expected[mode][j]}")

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert failures == []


def test_abandoned_and_failed_calls_give_their_generator_back(model) -> None:
    first = model.stream_ids([5, 6, 7], 20)
    next(first)
    first.close()  # stopped early: back in the pool
    with pytest.raises(Exception, match="vocabulary"):
        model.generate([5, 10**6], 4)  # rejected request: back in the pool too
    assert len(model._pool._idle) <= 2
    # A reused generator starts from an empty sequence.
    assert model.generate([5, 6, 7], 8).tokens == model.generate([5, 6, 7], 8).tokens
