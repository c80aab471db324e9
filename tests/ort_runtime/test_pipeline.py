"""The pipelined mixed-depth strategy returns exactly plain greedy's tokens (CPU fp32).

Beyond the final tokens, every cycle is checked against a teacher-forced serial reference at
the first affected cycle: the lane finishing loop R must give plain greedy's next token at its
position, and a lane on the true path finishing the exit loop must draft what the draft graph
gives at that position when fed plain greedy's tokens. Rejections are forced through the
drafts hook (all, alternating, consecutive runs, at the KV capacity, with EOS and the length
limit reached while lanes are outstanding).
"""

from __future__ import annotations

import numpy as np
import pytest
from loopcast.ort_runtime import load
from loopcast.ort_runtime.binding.generator import Generator
from loopcast.ort_runtime.decoding.speculate import GenerationStats

from loopcast.errors import RequestError
from loopcast.manifest import DRAFT
from tests.artifacts import artifact, require_exact_cpu_artifacts
from tests.ort_runtime.stream_helpers import run_fresh

LOOPED = ["ouro-r2-gqa", "ouro-r3", "ouro-r4-1layer"]  # R = 2, 3, 4


@pytest.fixture(scope="module", autouse=True)
def _exact_artifacts():
    require_exact_cpu_artifacts()


def run(
    gen: Generator, prompt: list[int], n: int, *, stop_ids=(), **spec
) -> tuple[list[int], GenerationStats]:
    """A fresh generation on ``gen`` (rewound first); ``gen.n`` is left as the generation leaves it."""
    return run_fresh(gen, prompt, n, stop_ids=stop_ids, **spec)


def draft_reference(gen: Generator, sequence: list[int], prompt_len: int) -> dict[int, int]:
    """Teacher-forced depth-d argmax at each position >= prompt_len: the draft graph fed the
    plain greedy sequence (its depth-d KV written by the true tokens only)."""
    gen.rewind(0)
    gen.prefill(sequence[:prompt_len])
    out = {}
    for q in range(prompt_len, len(sequence)):
        out[q] = int(gen.run(DRAFT, q, tokens=[sequence[q]], want_logits=False).next_ids[0])
        gen.commit([sequence[q]])
    gen.rewind(0)
    return out


def check_cycles(
    trace, sequence: list[int], prompt_len: int, loops: int, exit_depth: int, drafts: dict[int, int] | None
) -> int:
    """Compare every cycle with the serial reference; returns how many rows were checked."""
    tokens: dict[int, int] = {}  # the latest token that entered loop 0 at each position
    checked = 0
    for c, (positions, ids, entering) in enumerate(trace):
        if positions[0] >= 0:
            tokens[positions[0]] = entering
        last = positions[loops - 1]
        if last >= 0:
            assert ids[loops - 1] == sequence[last + 1], f"cycle {c}: full-depth token at position {last}"
            checked += 1
        q = positions[exit_depth - 1]
        if (
            drafts is not None
            and q >= 0
            and all(tokens.get(j, sequence[j]) == sequence[j] for j in range(prompt_len, q + 1))
        ):
            assert ids[exit_depth - 1] == drafts[q], f"cycle {c}: depth-{exit_depth} draft at position {q}"
            checked += 1
    return checked


@pytest.mark.parametrize("name", LOOPED)
def test_tiny_ouro_every_exit_and_gate_equals_plain(name: str) -> None:
    model = load(artifact(name))
    gen = model.new_generator()
    R = model.config.num_loops
    rng = np.random.default_rng(3)
    for prompt in (
        rng.integers(0, model.config.vocab_size, 6).tolist(),
        rng.integers(0, model.config.vocab_size, 3).tolist() * 4,
    ):
        plain, plain_stats = run(gen, prompt, 40)
        assert plain_stats.core_calls_per_token == pytest.approx(R * (len(plain) - 1) / len(plain))
        sequence = prompt + plain
        drafts = draft_reference(gen, sequence, len(prompt))
        for exit_depth in range(1, R):
            for gate in ("always", "auto"):
                got, stats = run(
                    gen, prompt, 40, speculative="pipeline", gate=gate, pipeline_exit=exit_depth, trace=True
                )
                assert got == plain, (exit_depth, gate)
                assert gen.n == len(sequence) - 1  # the last token is pending, as after plain decoding
                gen.rewind(0)
                if gate == "always":
                    trace = stats.pipeline_trace
                    assert (
                        check_cycles(
                            trace, sequence, len(prompt), R, exit_depth, drafts if exit_depth == 1 else None
                        )
                        >= len(plain) - 1
                    )


def _oracle(sequence: list[int], wrong=lambda pos: False, vocab: int = 64):
    def hook(position: int, draft: int) -> int:
        truth = sequence[position] if position < len(sequence) else draft
        return (truth + 1) % vocab if wrong(position) else truth

    return hook


@pytest.fixture(scope="module")
def demo():
    return load(artifact("demo"))


PATTERNS = {
    "all-right": lambda p: False,
    "all-wrong": lambda p: True,
    "alternating": lambda p: p % 2 == 0,
    "consecutive-runs": lambda p: (p // 3) % 2 == 0,  # three rollbacks in a row, then three accepts
    "every-fifth": lambda p: p % 5 == 0,
}


@pytest.mark.parametrize("pattern", list(PATTERNS))
def test_forced_rejections_on_the_demo(demo, pattern: str) -> None:
    gen = demo.new_generator()
    prompt = demo.encode("def merge(left, right):\n    result = []\n")
    plain, _ = run(gen, prompt, 64)
    sequence = prompt + plain
    drafts = draft_reference(gen, sequence, len(prompt))
    hook = _oracle(sequence, PATTERNS[pattern], demo.config.vocab_size)
    got, stats = run(gen, prompt, 64, speculative="pipeline", gate="always", draft_hook=hook, trace=True)
    assert got == plain
    R = demo.config.num_loops
    check_cycles(stats.pipeline_trace, sequence, len(prompt), R, 1, drafts)
    if pattern == "all-right":
        # One pass over the core layers per token once the first lane is through: (N - 1) rounds,
        # the first R cycles long, every later one a single cycle.
        assert stats.cycles == len(plain) - 2 + R
        assert stats.accepted == stats.proposed == len(plain) - 2
        assert stats.discarded_lanes == 0
    if pattern == "all-wrong":
        assert stats.accepted == 0 and stats.cycles == R * (len(plain) - 1)


def test_eos_and_length_limit_with_outstanding_lanes(demo) -> None:
    gen = demo.new_generator()
    prompt = demo.encode("class Queue:\n    def __init__(self):\n")
    plain, _ = run(gen, prompt, 48)
    sequence = prompt + plain
    hook = _oracle(sequence)  # every draft right: R-1 lanes are in flight at any finish
    eos = plain[9]
    want, want_stats = run(gen, prompt, 48, stop_ids=(eos,))
    n_after = gen.n
    gen.rewind(0)
    got, stats = run(gen, prompt, 48, stop_ids=(eos,), speculative="pipeline", gate="always", draft_hook=hook)
    assert got == want and stats.finish_reason == want_stats.finish_reason == "eos"
    assert gen.n == n_after and stats.discarded_lanes > 0
    gen.rewind(0)
    for limit in (1, 2, 5, 17):
        got, stats = run(gen, prompt, limit, speculative="pipeline", gate="always", draft_hook=hook)
        assert got == plain[:limit] and stats.finish_reason == "length"
        assert gen.n == len(prompt) + limit - 1
        gen.rewind(0)
    assert run(gen, prompt, 48)[0] == plain  # the generator is still usable


@pytest.mark.parametrize("pattern", ["all-right", "alternating"])
def test_kv_capacity_with_outstanding_lanes(pattern: str) -> None:
    """Lanes are never spawned past the KV capacity; the generation ends there as plain does."""
    model = load(artifact("ouro-r4-1layer", max_length=24))
    gen = model.new_generator()
    prompt = [5, 9, 2, 11]
    plain, plain_stats = run(gen, prompt, 100)
    assert plain_stats.finish_reason == "length" and len(prompt) + len(plain) == 24 + 1
    gen.rewind(0)
    hook = _oracle(prompt + plain, PATTERNS[pattern], model.config.vocab_size)
    got, stats = run(gen, prompt, 100, speculative="pipeline", gate="always", draft_hook=hook, trace=True)
    assert got == plain and stats.finish_reason == "length"
    assert all(p < 24 for positions, _, _ in stats.pipeline_trace for p in positions)


def test_demo_pipeline_equals_plain_with_its_own_drafts(demo) -> None:
    from tests.ort_runtime.test_generator import DEMO_PROMPTS

    accepted = proposed = 0
    for prompt in DEMO_PROMPTS[:8]:
        plain = demo.generate(prompt, 64)
        for gate in ("always", "auto"):
            got = demo.generate(prompt, 64, speculative="pipeline", gate=gate)
            assert got.tokens == plain.tokens and got.finish_reason == plain.finish_reason, (prompt, gate)
            if gate == "always":
                accepted += got.stats.accepted
                proposed += got.stats.proposed
                assert got.stats.core_calls_per_token < demo.config.num_loops
    assert 0 < accepted < proposed


def test_pipeline_refusals_leave_the_generator_usable(demo) -> None:
    gen = demo.new_generator()
    prompt = demo.encode("x = 1\n")
    plain, _ = run(gen, prompt, 8)
    bad = [
        dict(speculative="pipeline", pipeline_exit=0),
        dict(speculative="pipeline", pipeline_exit=4),
        dict(speculative="pipeline", num_draft_tokens=2),
    ]
    for spec in bad:
        with pytest.raises(RequestError):
            run(gen, prompt, 8, **spec)
        assert gen.n == 0
    llama = load(artifact("llama-tied-gqa"))
    with pytest.raises(RequestError, match="cycle graph"):
        llama.generate([1, 2, 3], 4, speculative="pipeline")
    stock = load(artifact("ouro-r3", ops="stock"))
    with pytest.raises(RequestError, match="cycle graph"):
        stock.generate([1, 2, 3], 4, speculative="pipeline", allow_inexact=True)
    assert run(gen, prompt, 8)[0] == plain


def test_cycle_rows_are_decode_rows_bit_for_bit(demo) -> None:
    """A lane's full-depth logits row in a cycle equals the decode step's row at that position
    bit for bit, with the other rows busy (the CUDA twin is in test_cuda.py)."""
    from loopcast.ort_runtime.decoding.exactness import decode_rows

    R = demo.config.num_loops
    ids = demo.encode("def fibonacci(n):\n")
    fed, rows = decode_rows(demo.new_generator(), ids, 2 * R)
    gen = demo.new_generator()
    gen.prefill(ids)
    for c in range(len(fed)):  # the lane of fed[i] enters at cycle i and finishes at cycle i + R - 1
        positions = [len(ids) + c - r if 0 <= c - r < len(fed) else -1 for r in range(R)]
        gen.run_cycle(fed[c], positions)
        if c >= R - 1:
            assert np.array_equal(gen.cycle.logits.pull()[0, R - 1], rows[c - R + 1]), c
