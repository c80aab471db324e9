"""Sampled requests speculate inside the continuous batch (prompt lookup in verify_batch steps,
self-drafts in draft_batch/verify_tail_batch rounds) and still sample exactly plain sampling's
distribution: many seeded requests of one prompt through the batch engine, chi-square against
the enumerated plain distribution of their first tokens; a wrong acceptance rule fails the same
check, and top-k 1 sampling gives the greedy tokens."""

from __future__ import annotations

import numpy as np
import pytest
from loopcast.ort_runtime import load
from loopcast.ort_runtime.batching import engine as engine_module
from loopcast.ort_runtime.batching.engine import BatchingEngine, BatchRequest
from loopcast.ort_runtime.binding.batch_generator import BatchGenerator
from loopcast.ort_runtime.decoding.acceptors import SampledAcceptor
from loopcast.ort_runtime.decoding.generation_config import GenerationConfig, SpeculationConfig
from loopcast.ort_runtime.decoding.greedy_accept import AcceptResult
from loopcast.ort_runtime.decoding.sampling import SamplingParams

from tests.artifacts import artifact, require_exact_cpu_artifacts
from tests.ort_runtime.test_batch_self import _AlwaysSelf
from tests.ort_runtime.test_sampled_decoding import HORIZON, PARAMS, exact_distribution
from tests.ort_runtime.test_sampling import chi_square

TRIALS = 1200


class _AlwaysSpeculate(_AlwaysSelf):
    """Every step that can speculate does: verify steps for proposals, and every self-drafting
    request drafts (within the row budget)."""

    def engage(self, width, running, proposing):
        super().engage(width, running, proposing)
        return True


class _KeepEveryDraft(SampledAcceptor):
    """A wrong rule: keeps every draft, then draws the bonus token from the last row."""

    def accept(self, context, proposal, verified):
        drafts = list(proposal.tokens)
        row = verified.logits[len(drafts)]
        return AcceptResult(len(drafts), self.draw(row, list(context) + drafts), 0)


@pytest.fixture(scope="module")
def model():
    require_exact_cpu_artifacts()
    return load(artifact("ouro-r3", max_batch=4))


@pytest.fixture(scope="module")
def case(model):
    """A prompt whose tail recurs (prompt lookup drafts on it) and plain sampling's exact
    distribution of its first HORIZON tokens."""
    start = np.random.default_rng(5).integers(1, model.config.vocab_size, 4).tolist()
    prompt = start + model.generate(start, 40, stop_ids=()).tokens
    exact = exact_distribution(model, prompt)
    assert abs(sum(exact.values()) - 1) < 1e-9
    return prompt, exact


def _greedy_drafts(model):
    """``self_perturb``: each self-draft replaced by full-depth greedy's next token after the
    sequence so far (a point mass, so the rule stays lossless), so that drafts are accepted
    often: the random model's own shallow argmax never is."""
    cache: dict[tuple[int, ...], int] = {}

    def perturb(sequence, token):
        key = tuple(sequence)
        if key not in cache:
            cache[key] = model.generate(list(sequence), 1, stop_ids=()).tokens[0]
        return cache[key]

    return perturb


def _run(model, requests, wave: int = 200, **options):
    """Every request's tokens, its completion and the engine's stats; submitted in waves that fit
    the engine's waiting queue."""
    engine = BatchingEngine(BatchGenerator(model.loaded), gate=_AlwaysSpeculate(), **options).start()
    try:
        done, tokens = [], []
        for i in range(0, len(requests), wave):
            done += [engine.submit(r) for r in requests[i : i + wave]]
            tokens += [tuple(c.result(300)) for c in done[i:]]
        return tokens, done, dict(engine.stats)
    finally:
        engine.shutdown()


def _sampled_requests(prompt, mode: str, params: SamplingParams = PARAMS, n: int = TRIALS):
    config = GenerationConfig(speculation=SpeculationConfig(mode, num_draft_tokens=2))
    return [
        BatchRequest(
            prompt,
            HORIZON,
            stop_ids=(),
            sampling=SamplingParams(
                temperature=params.temperature,
                top_k=params.top_k,
                repetition_penalty=params.repetition_penalty,
                seed=seed,
            ),
            speculative=mode,
            config=config,
        )
        for seed in range(n)
    ]


@pytest.mark.parametrize("mode", ["prompt-lookup", "self"])
def test_batched_sampled_speculation_samples_the_plain_distribution(model, case, mode: str) -> None:
    prompt, exact = case
    options = {"self_perturb": _greedy_drafts(model)} if mode == "self" else {}
    draws, done, stats = _run(model, _sampled_requests(prompt, mode), **options)
    assert {c.speculative for c in done} == {mode}
    assert chi_square(exact, draws) > 1e-3
    assert 0 < stats["accepted"] < stats["proposed"], stats
    assert stats["verify_steps" if mode == "prompt-lookup" else "self_rounds"] > 0, stats


def test_a_wrong_rule_fails_the_same_check(model, case, monkeypatch) -> None:
    """The check can fail: the engine's acceptor replaced by one that keeps every draft."""
    prompt, exact = case
    monkeypatch.setattr(engine_module, "SampledAcceptor", _KeepEveryDraft)
    draws, _, stats = _run(model, _sampled_requests(prompt, "prompt-lookup"))
    assert stats["proposed"] > 0
    assert chi_square(exact, draws) < 1e-3


@pytest.mark.parametrize("mode", ["prompt-lookup", "self"])
def test_top_k_1_batched_speculation_equals_greedy(model, case, mode: str) -> None:
    """A one-hot distribution: the sampled rounds' plumbing (drafts, commits, contexts) against
    plain greedy's tokens, requests of different lengths sharing the batch."""
    prompt, _ = case
    requests = [
        BatchRequest(
            prompt[: 20 + 4 * i],
            12 + i,
            stop_ids=(),
            sampling=SamplingParams(top_k=1, seed=i),
            speculative=mode,
            config=GenerationConfig(speculation=SpeculationConfig(mode)),
        )
        for i in range(6)
    ]
    options = {"self_perturb": _greedy_drafts(model)} if mode == "self" else {}
    got, _, stats = _run(model, requests, **options)
    want = [tuple(model.stream_ids(r.ids, r.max_new_tokens, stop_ids=())) for r in requests]
    assert got == want
    assert stats["accepted"] > 0
