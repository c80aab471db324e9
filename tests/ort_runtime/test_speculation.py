"""Every speculative mode returns exactly the tokens of plain greedy (CPU fp32)."""

from __future__ import annotations

import numpy as np
import pytest
from loopcast.ort_runtime import load
from loopcast.ort_runtime.decoding.proposers import SelfDraftProposer
from loopcast.ort_runtime.decoding.protocols import CostsBase
from loopcast.ort_runtime.decoding.speculate import GenerationStats

from loopcast.errors import RequestError
from tests.artifacts import TINY, artifact, require_exact_cpu_artifacts
from tests.ort_runtime.stream_helpers import engine_stream
from tests.ort_runtime.test_generator import DEMO_PROMPTS

MODES = [
    ("prompt-lookup", "always"),
    ("prompt-lookup", "hit-density"),
    ("prompt-lookup", "cost"),
    ("self", "always"),
    ("self", "hit-density"),
    ("self", "cost"),
]


@pytest.fixture(scope="module", autouse=True)
def _exact_artifacts():
    require_exact_cpu_artifacts()


@pytest.fixture(scope="module")
def demo():
    return load(artifact("demo"))


@pytest.fixture(scope="module")
def demo_plain(demo):
    return {prompt: demo.generate(prompt, 128) for prompt in DEMO_PROMPTS}


@pytest.mark.parametrize("mode,gate", MODES)
def test_demo_all_modes_equal_plain(demo, demo_plain, mode: str, gate: str) -> None:
    accepted = 0
    for prompt in DEMO_PROMPTS:
        plain = demo_plain[prompt]
        spec = demo.generate(prompt, 128, speculative=mode, gate=gate)
        assert spec.tokens == plain.tokens, prompt
        assert spec.finish_reason == plain.finish_reason
        assert spec.stats.exact_greedy
        accepted += spec.stats.accepted
    assert accepted > 0


def test_edit_workload_repeating_the_prompt(demo) -> None:
    text = "def area(width, height):\n    return width * height\n\n\n"
    prompt = text * 3 + "def area("
    plain = demo.generate(prompt, 64)
    spec = demo.generate(prompt, 64, speculative="prompt-lookup")
    assert spec.tokens == plain.tokens
    assert spec.stats.tokens_per_round > 1.5


@pytest.mark.parametrize("name", list(TINY))
@pytest.mark.parametrize("k", [1, 4])
def test_tiny_configs_all_modes(name: str, k: int) -> None:
    model = load(artifact(name))
    rng = np.random.default_rng(11)
    motif = rng.integers(0, model.config.vocab_size, 6).tolist()
    for ids in (rng.integers(0, model.config.vocab_size, 7).tolist(), motif * 3):
        plain = model.generate(ids, 48, stop_ids=())
        modes = MODES if model.config.num_loops > 1 else MODES[:3]
        for mode, gate in modes:
            spec = model.generate(ids, 48, stop_ids=(), speculative=mode, gate=gate, num_draft_tokens=k)
            assert spec.tokens == plain.tokens, (mode, gate)


# -- adversarial proposers, injected through the proposer interface ------------------------------


class Oracle:
    """Knows the plain greedy continuation; ``corrupt(pos, true) -> token`` spoils drafts."""

    name = "oracle"

    def __init__(self, prompt: list[int], continuation: list[int], corrupt=None) -> None:
        self.sequence = prompt + continuation
        self.corrupt = corrupt or (lambda pos, token, k: token)
        self.rounds = 0

    def propose(self, context, k):
        start = len(context)
        truth = self.sequence[start : start + k]
        self.rounds += 1
        return [self.corrupt(i, t, len(truth)) for i, t in enumerate(truth)]


WRONG = {
    "always-right": lambda i, t, k: t,
    "always-wrong": lambda i, t, k: (t + 1) % 64,
    "alternating": lambda i, t, k: t if i % 2 == 0 else (t + 1) % 64,
    "first-wrong": lambda i, t, k: (t + 1) % 64 if i == 0 else t,
    "last-wrong": lambda i, t, k: (t + 1) % 64 if i == k - 1 else t,
}


@pytest.mark.parametrize("kind", list(WRONG))
@pytest.mark.parametrize("k", [1, 4])
def test_adversarial_token_proposers(demo, kind: str, k: int) -> None:
    prompt = demo.encode("class Queue:\n    def __init__(self):\n")
    plain = demo.generate(prompt, 80, stop_ids=())
    oracle = Oracle(prompt, plain.tokens, WRONG[kind])
    spec = demo.generate(
        prompt,
        80,
        stop_ids=(),
        speculative="prompt-lookup",
        proposer=oracle,
        num_draft_tokens=k,
        gate="always",
    )
    assert spec.tokens == plain.tokens
    if kind == "always-right":
        assert spec.stats.accepted == spec.stats.proposed
    if kind in ("always-wrong", "first-wrong"):
        assert spec.stats.accepted == 0 and spec.stats.rounds > 50  # ≥50 tokens after rejections


@pytest.mark.parametrize("kind", ["always-wrong", "alternating", "first-wrong", "last-wrong"])
def test_self_drafts_with_forced_rejections(demo, kind: str) -> None:
    """Perturbed self-drafts write KV for rejected tokens; it must never be read."""
    prompt = demo.encode("def merge(left, right):\n    result = []\n")
    plain = demo.generate(prompt, 80, stop_ids=())
    vocab = demo.config.vocab_size
    perturb = {
        "always-wrong": lambda i, t: (t + 1) % vocab,
        "alternating": lambda i, t: t if i % 2 else (t + 7) % vocab,
        "first-wrong": lambda i, t: (t + 3) % vocab if i == 0 else t,
        "last-wrong": lambda i, t: (t + 3) % vocab if i == 3 else t,
    }[kind]
    spec = demo.generate(
        prompt,
        80,
        stop_ids=(),
        speculative="self",
        num_draft_tokens=4,
        proposer=SelfDraftProposer(perturb),
        gate="always",
    )
    assert spec.tokens == plain.tokens
    assert spec.stats.rounds >= 16


def test_draft_crossing_eos(demo) -> None:
    prompt = demo.encode("x = 1\n")
    plain = demo.generate(prompt, 30, stop_ids=())
    eos = plain.tokens[5]  # pretend the 6th token is the end of text
    expected = plain.tokens[:6]
    oracle = Oracle(prompt, plain.tokens)
    spec = demo.generate(
        prompt, 30, stop_ids=(eos,), speculative="prompt-lookup", proposer=oracle, gate="always"
    )
    want = demo.generate(prompt, 30, stop_ids=(eos,))
    assert spec.tokens == want.tokens == expected[: want.tokens.__len__()]
    assert spec.finish_reason == want.finish_reason == "eos"
    gen_after = demo.generate(prompt, 30, stop_ids=())
    assert gen_after.tokens == plain.tokens  # model still usable


@pytest.mark.parametrize("limit", [1, 2, 3, 7])
def test_draft_crossing_max_new_tokens(demo, limit: int) -> None:
    prompt = demo.encode("import json\n")
    plain = demo.generate(prompt, 40, stop_ids=())
    spec = demo.generate(
        prompt,
        limit,
        stop_ids=(),
        speculative="prompt-lookup",
        proposer=Oracle(prompt, plain.tokens),
        gate="always",
    )
    assert spec.tokens == plain.tokens[:limit]
    spec = demo.generate(prompt, limit, stop_ids=(), speculative="self", gate="always")
    assert spec.tokens == plain.tokens[:limit]


@pytest.mark.parametrize("mode", ["prompt-lookup", "self"])
def test_draft_crossing_kv_capacity(mode: str) -> None:
    model = load(artifact("ouro-r3", max_length=23))
    ids = [3, 4, 5, 3, 4, 5, 3]
    plain = model.generate(ids, 100, stop_ids=())
    assert len(plain.tokens) == 23 - len(ids) + 1
    proposer = Oracle(ids, plain.tokens + [1] * 10) if mode == "prompt-lookup" else None
    spec = model.generate(ids, 100, stop_ids=(), speculative=mode, proposer=proposer, gate="always")
    assert spec.tokens == plain.tokens and spec.finish_reason == "length"


class FixedCosts(CostsBase):
    """Step costs as measured on CPU for the demo (verify W=5 ≈ 1.25× decode), fixed so the
    gate's decisions do not depend on this machine's timing noise."""

    draft_share = 0.25

    def decode(self) -> float:
        return 1.0

    def mean(self, kind: str) -> float:
        return {"decode": 1.0, "verify": 1.25}.get(kind)

    def snapshot_ms(self) -> dict:
        return {}


@pytest.mark.parametrize("gate,max_rounds", [("cost", 16), ("hit-density", 20)])
def test_gates_disengage_when_drafts_keep_missing(demo, gate: str, max_rounds: int) -> None:
    prompt = demo.encode("def scan(tokens):\n")
    plain = demo.generate(prompt, 120, stop_ids=())
    oracle = Oracle(prompt, plain.tokens, WRONG["always-wrong"])
    spec = dict(mode="prompt-lookup", gate=gate, proposer=oracle, costs=FixedCosts())
    stats = GenerationStats()
    tokens = list(engine_stream(demo.new_generator(), prompt, 120, **spec, stats=stats))
    assert tokens == plain.tokens
    assert stats.rounds <= max_rounds, stats.rounds  # learns within a few rounds, then rare probes
    if gate == "cost":
        assert stats.steps.get("decode", 0) >= 100


def test_bad_speculation_requests(demo) -> None:
    # Library errors name the parameter (the CLI maps it to its flag).
    with pytest.raises(RequestError, match="num_draft_tokens must be in 1..4"):
        demo.generate("x", 5, speculative="self", num_draft_tokens=5)
    with pytest.raises(RequestError, match="speculative must be one of"):
        demo.generate("x", 5, speculative="medusa")
    with pytest.raises(RequestError, match="gate must be one of"):
        demo.generate("x", 5, speculative="self", gate="sometimes")
    llama = load(artifact("llama-tied-gqa"))
    with pytest.raises(RequestError, match="verify_tail"):
        llama.generate([1, 2], 5, speculative="self")
    assert demo.generate("x", 5).tokens  # still usable


@pytest.mark.parametrize("mode", ["none", "prompt-lookup", "self"])
def test_closing_a_stream_early_keeps_n_consistent(demo, mode: str) -> None:
    """Rounds commit drafts before yielding them; an early close must rewind to what was yielded."""
    prompt = demo.encode("x = [1, 2, 3]\nx = [1, 2, 3]\nx = [1,")
    plain = demo.generate(prompt, 40, stop_ids=()).tokens
    gen = demo.new_generator()
    it = demo.stream_ids(prompt, 40, stop_ids=(), speculative=mode, generator=gen)
    got = [next(it) for _ in range(3)]
    it.close()
    assert got == plain[:3]
    assert gen.n == len(prompt) + 2  # the third token is pending, exactly as in plain greedy
    rest = list(demo.stream_ids([got[-1]], 10, stop_ids=(), generator=gen))
    assert rest == plain[3:13]
