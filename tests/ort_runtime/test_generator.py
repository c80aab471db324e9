"""The ORT generator: greedy parity with the reference, rewind, fixed buffers, isolation."""

from __future__ import annotations

import numpy as np
import pytest
from loopcast.exporter.reference_generate import greedy_generate
from loopcast.ort_runtime import load

from tests.artifacts import TINY, artifact, reference
from tests.ort_runtime.stream_helpers import engine_stream

DEMO_PROMPTS = [
    "def fibonacci(n):\n",
    "import os\nimport sys\n",
    "class Stack:\n    def __init__(self):\n",
    "    def __repr__(self):\n        return ",
    "for i in range(10):\n",
    "# Copyright 2001 Python Software",
    "def main(argv=None):\n    parser = ",
    "    try:\n        import",
    '"""Tests for the',
    "if __name__ ==",
    "    @property\n    def name(self):\n",
    "raise ValueError(",
    "    with open(path) as f:\n",
    "from collections import",
    "def test_",
    "    self.assertEqual(",
    "    return self._",
    "lambda x:",
    "async def fetch(",
    "        for key, value in",
]


@pytest.fixture(scope="module")
def demo():
    return load(artifact("demo"))


def test_demo_greedy_matches_reference_20_prompts(demo) -> None:
    ref = reference("demo")
    assert len(DEMO_PROMPTS) >= 20
    for prompt in DEMO_PROMPTS:
        ids = demo.encode(prompt)
        expected = greedy_generate(ref, ids, 128, max_length=512, stop_ids=(0,)).tokens
        got = demo.generate(ids, 128)
        assert got.tokens == expected, prompt
        assert got.finish_reason == ("eos" if expected[-1] == 0 else "length")


@pytest.mark.parametrize("name", list(TINY))
def test_tiny_greedy_matches_reference(name: str) -> None:
    model, ref = load(artifact(name)), reference(name)
    rng = np.random.default_rng(1)
    for length in (1, 5, 17):
        ids = rng.integers(0, ref.config.vocab_size, length).tolist()
        expected = greedy_generate(ref, ids, 40, max_length=ref.config.max_position_embeddings).tokens
        assert model.generate(ids, 40, stop_ids=()).tokens == expected


def test_capacity_stops_with_length_and_state_stays_valid() -> None:
    name = "ouro-r3"
    model, ref = load(artifact(name, max_length=24)), reference(name)
    ids = [5, 6, 7, 8, 9, 10]
    got = model.generate(ids, 100, stop_ids=())
    assert got.finish_reason == "length"
    assert len(got.tokens) == 24 - len(ids) + 1
    assert got.tokens == greedy_generate(ref, ids, 100, max_length=24).tokens
    # still usable: a fresh request on the same model and default generator
    assert model.generate(ids, 5, stop_ids=()).tokens == got.tokens[:5]


def test_rewind_equals_fresh_run_from_prefix(demo) -> None:
    gen = demo.new_generator()
    prompt = demo.encode("def parse(text):\n    ")
    first = list(engine_stream(gen, prompt, 30))
    keep = len(prompt) + 10
    gen.rewind(keep)
    assert gen.n == keep
    again = list(engine_stream(gen, [first[10]], 20))
    fresh = list(engine_stream(demo.new_generator(), prompt + first[:11], 20))
    assert again == fresh
    assert again[:19] == first[11:30]
    gen.rewind(0)
    assert gen.n == 0
    assert list(engine_stream(gen, prompt, 30)) == first


def test_no_allocation_per_token(demo) -> None:
    gen = demo.new_generator()
    before = [id(x) for x in gen.bound_objects()]
    tokens = list(engine_stream(gen, demo.encode("import re\n"), 100))
    assert len(tokens) == 100
    after = [id(x) for x in gen.bound_objects()]
    assert before == after
    assert len(before) > 4 * demo.config.num_kv_slots


def test_two_generators_interleaved_equal_alone(demo) -> None:
    a_ids, b_ids = demo.encode("class Node:\n"), demo.encode("def walk(tree):\n")
    alone_a = list(engine_stream(demo.new_generator(), a_ids, 40))
    alone_b = list(engine_stream(demo.new_generator(), b_ids, 40))
    ga, gb = demo.new_generator(), demo.new_generator()
    sa, sb = engine_stream(ga, a_ids, 40), engine_stream(gb, b_ids, 40)
    got_a, got_b = [], []
    for _ in range(40):
        got_a.append(next(sa))
        got_b.append(next(sb))
    assert got_a == alone_a and got_b == alone_b


def test_streaming_text_equals_generate_text(demo) -> None:
    prompt = "def greet(name):\n    print("
    pieces = list(demo.stream(prompt, 40))
    result = demo.generate(prompt, 40)
    assert [p.token for p in pieces] == result.tokens
    assert "".join(p.text for p in pieces) == result.text
