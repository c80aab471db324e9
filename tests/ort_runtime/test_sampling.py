"""Sampling: the processed distribution, and lossless speculative sampling checked statistically.

The speculative checks run on a synthetic "model" (a fixed logits table per context of the last
two tokens, vocabulary 5) whose plain-sampling distribution over short sequences is enumerated
exactly; the speculative procedure is sampled over many seeds and compared by chi-square. The
same harness is run with deliberately wrong acceptance rules, which it must reject: the test
can fail.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from loopcast.ort_runtime.decoding.sampling import (
    SamplingParams,
    make_rng,
    probabilities,
    sample,
    speculative_accept,
)

from loopcast.errors import RequestError

V = 5
HORIZON = 3


def _table(seed: int) -> dict[tuple[int, ...], np.ndarray]:
    rng = np.random.default_rng(seed)
    contexts = [()] + [(a,) for a in range(V)] + list(itertools.product(range(V), repeat=2))
    return {ctx: rng.normal(0.0, 1.5, V) for ctx in contexts}


TARGET, DRAFT = _table(1), _table(2)


def _logits(table, seq: tuple[int, ...]) -> np.ndarray:
    return table[tuple(seq[-2:])]


def _p(seq, params):
    return probabilities(_logits(TARGET, seq), params, seq)


def _q(seq, params):
    return probabilities(_logits(DRAFT, seq), params, seq)


def exact_plain(prompt: tuple[int, ...], params: SamplingParams) -> dict[tuple[int, ...], float]:
    """P(first HORIZON tokens) under plain sampling, by enumeration."""
    out = {}
    for seq in itertools.product(range(V), repeat=HORIZON):
        prob, ctx = 1.0, prompt
        for t in seq:
            prob *= _p(ctx, params)[t]
            ctx = ctx + (t,)
        if prob > 0:
            out[seq] = prob
    return out


def speculative_run(prompt, params, rng, rule, proposer: str, k: int = 2) -> tuple[int, ...]:
    """Rounds of (draft k → target rows → rule) until HORIZON tokens are produced."""
    produced: tuple[int, ...] = ()
    while len(produced) < HORIZON:
        ctx = prompt + produced
        drafts, qs = [], []
        for _ in range(k):
            here = ctx + tuple(drafts)
            if proposer == "deterministic":  # a one-hot proposer: the draft table's argmax
                drafts.append(int(np.argmax(_logits(DRAFT, here))))
            else:
                q = _q(here, params)
                qs.append(q)
                drafts.append(sample(q, rng))
        rows = [_p(ctx + tuple(drafts[:i]), params) for i in range(k + 1)]
        accepted, nxt = rule(drafts, qs if proposer == "stochastic" else None, rows, rng)
        produced += tuple(drafts[:accepted]) + (nxt,)
    return produced[:HORIZON]


def _chi2_pvalue(stat: float, dof: int) -> float:
    """Upper tail of chi-square (Wilson–Hilferty; ample for dof >= 10)."""
    z = ((stat / dof) ** (1 / 3) - (1 - 2 / (9 * dof))) / math.sqrt(2 / (9 * dof))
    return 0.5 * math.erfc(z / math.sqrt(2))


def chi_square(expected: dict, draws: list) -> float:
    """p-value of the draws against the exact distribution (cells under 5 expected pooled)."""
    n = len(draws)
    counts: dict = {}
    for d in draws:
        counts[d] = counts.get(d, 0) + 1
    if any(d not in expected for d in counts):
        return 0.0  # a sequence plain sampling can never produce
    stat, pooled_e, pooled_o, cells = 0.0, 0.0, 0, 0
    for seq, prob in expected.items():
        e, o = n * prob, counts.get(seq, 0)
        if e < 5:
            pooled_e, pooled_o = pooled_e + e, pooled_o + o
            continue
        stat += (o - e) ** 2 / e
        cells += 1
    if pooled_e > 0:
        stat += (pooled_o - pooled_e) ** 2 / pooled_e
        cells += 1
    return _chi2_pvalue(stat, max(cells - 1, 1))


# -- wrong rules: each breaks losslessness in its own way -------------------------------------


def accept_always(drafts, draft_probs, target_probs, rng):
    return len(drafts), sample(target_probs[-1], rng)


def resample_from_p(drafts, draft_probs, target_probs, rng):
    """The right accept test, but a rejection redraws from p instead of the residual."""
    for i, x in enumerate(drafts):
        q_x = 1.0 if draft_probs is None else draft_probs[i][x]
        if rng.random() < min(1.0, target_probs[i][x] / q_x):
            continue
        return i, sample(target_probs[i], rng)
    return len(drafts), sample(target_probs[-1], rng)


def inverted_ratio(drafts, draft_probs, target_probs, rng):
    """Accepts with min(1, q/p) instead of min(1, p/q); the residual is right."""
    for i, x in enumerate(drafts):
        p, q = target_probs[i], draft_probs[i]
        if rng.random() < min(1.0, q[x] / p[x]) if p[x] > 0 else True:
            continue
        residual = np.maximum(0.0, p - q)
        return i, sample(residual / residual.sum(), rng)
    return len(drafts), sample(target_probs[-1], rng)


def one_hot_rule_for_any_proposer(drafts, draft_probs, target_probs, rng):
    """Treats stochastic drafts as one-hot: lossless too (given x, the rule is exact), only
    accepting less often — a rule that looks wrong but is not, so the check must pass it."""
    return speculative_accept(drafts, None, target_probs, rng)


PARAMS = {
    "t1": SamplingParams(temperature=1.0),
    "t0.7-topk4-rep1.3": SamplingParams(temperature=0.7, top_k=4, repetition_penalty=1.3),
    "topp0.8-minp0.05": SamplingParams(temperature=1.2, top_p=0.8, min_p=0.05),
}
PROMPT = (3, 1)
TRIALS = 4000


@pytest.mark.parametrize("proposer", ["deterministic", "stochastic"])
@pytest.mark.parametrize("params", list(PARAMS))
def test_speculative_sampling_matches_plain_distribution(proposer: str, params: str) -> None:
    sp = PARAMS[params]
    expected = exact_plain(PROMPT, sp)
    draws = [
        speculative_run(PROMPT, sp, make_rng(SamplingParams(seed=s)), speculative_accept, proposer)
        for s in range(TRIALS)
    ]
    assert chi_square(expected, draws) > 1e-3


@pytest.mark.parametrize(
    "rule,proposer",
    [
        (accept_always, "deterministic"),
        (accept_always, "stochastic"),
        (resample_from_p, "deterministic"),
        (resample_from_p, "stochastic"),
        (inverted_ratio, "stochastic"),
    ],
)
def test_wrong_rules_fail_the_same_check(rule, proposer: str) -> None:
    sp = PARAMS["t1"]
    expected = exact_plain(PROMPT, sp)
    draws = [
        speculative_run(PROMPT, sp, make_rng(SamplingParams(seed=s)), rule, proposer) for s in range(TRIALS)
    ]
    assert chi_square(expected, draws) < 1e-6


def test_one_hot_rule_is_lossless_for_a_stochastic_proposer_too() -> None:
    sp = PARAMS["t1"]
    draws = [
        speculative_run(
            PROMPT, sp, make_rng(SamplingParams(seed=s)), one_hot_rule_for_any_proposer, "stochastic"
        )
        for s in range(TRIALS)
    ]
    assert chi_square(exact_plain(PROMPT, sp), draws) > 1e-3


def test_plain_sampling_matches_its_own_enumeration() -> None:
    """The harness itself: plain draws pass, so a failure above is the rule's fault."""
    sp = PARAMS["t0.7-topk4-rep1.3"]
    expected = exact_plain(PROMPT, sp)
    draws = []
    for s in range(TRIALS):
        rng, ctx = make_rng(SamplingParams(seed=s)), PROMPT
        for _ in range(HORIZON):
            ctx = ctx + (sample(_p(ctx, sp), rng),)
        draws.append(ctx[len(PROMPT) :])
    assert chi_square(expected, draws) > 1e-3


# -- the processed distribution ---------------------------------------------------------------


def test_probabilities_follow_transformers_order() -> None:
    logits = np.array([2.0, -1.0, 0.5, 3.0, 0.0])
    p = probabilities(logits, SamplingParams(repetition_penalty=2.0), [0, 1, 1])
    # penalty: 2.0 -> 1.0 (positive: divided), -1.0 -> -2.0 (negative: multiplied)
    ref = np.exp([1.0, -2.0, 0.5, 3.0, 0.0])
    np.testing.assert_allclose(p, ref / ref.sum())
    p = probabilities(logits, SamplingParams(temperature=0.5, top_k=2))
    ref = np.exp(np.array([2.0, 3.0]) / 0.5)
    np.testing.assert_allclose(p[[0, 3]], ref / ref.sum())
    assert p[[1, 2, 4]].sum() == 0
    # top-p 0.7: sorted masses 0.61, 0.22, ... -> the two most likely reach 0.7
    p = probabilities(logits, SamplingParams(top_p=0.7))
    assert (p > 0).sum() == 2 and p[3] > p[0] > 0
    full = probabilities(logits, SamplingParams())
    p = probabilities(logits, SamplingParams(min_p=0.2))
    assert set(np.flatnonzero(p)) == set(np.flatnonzero(full >= 0.2 * full.max()))
    greedy = probabilities(logits, SamplingParams(temperature=0))
    assert greedy[3] == 1.0 and greedy.sum() == 1.0


def test_top_p_on_a_large_flat_vocabulary_uses_the_full_sort() -> None:
    logits = np.zeros(5000)
    p = probabilities(logits, SamplingParams(top_p=0.3001))  # 1500.5 tokens' worth: keep 1501
    assert (p > 0).sum() == 1501


def test_sample_never_draws_a_zero_probability_token() -> None:
    p = np.array([0.0, 0.5, 0.0, 0.5, 0.0])
    rng = make_rng(SamplingParams(seed=0))
    assert {sample(p, rng) for _ in range(500)} == {1, 3}


def test_same_seed_same_draws() -> None:
    p = probabilities(np.arange(10.0), SamplingParams())
    a = [sample(p, make_rng(SamplingParams(seed=7))) for _ in range(3)]
    rng1, rng2 = make_rng(SamplingParams(seed=7)), make_rng(SamplingParams(seed=7))
    assert [sample(p, rng1) for _ in range(50)] == [sample(p, rng2) for _ in range(50)]
    assert len(set(a)) == 1


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(temperature=-1),
        dict(temperature=float("nan")),
        dict(top_k=-1),
        dict(top_k=1.5),
        dict(top_p=0),
        dict(top_p=1.5),
        dict(min_p=-0.1),
        dict(repetition_penalty=0),
        dict(seed=-3),
        dict(seed=1.5),
    ],
)
def test_invalid_params_are_refused(kwargs) -> None:
    with pytest.raises(RequestError, match=next(iter(kwargs))):
        SamplingParams(**kwargs)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(temperature=0.7),
        dict(temperature=1.3, top_k=7),
        dict(top_p=0.8),
        dict(temperature=0.9, min_p=0.1),
        dict(repetition_penalty=1.4),
        dict(temperature=0.6, top_k=20, top_p=0.9, min_p=0.05, repetition_penalty=1.2),
    ],
)
def test_probabilities_equal_transformers_processors(kwargs) -> None:
    """The oracle: transformers' own logits processors, in generate()'s order."""
    torch = pytest.importorskip("torch")
    gen = pytest.importorskip("transformers.generation.logits_process")
    sp = SamplingParams(**kwargs)
    procs = gen.LogitsProcessorList()
    if sp.repetition_penalty != 1.0:
        procs.append(gen.RepetitionPenaltyLogitsProcessor(sp.repetition_penalty))
    procs.append(gen.TemperatureLogitsWarper(sp.temperature))
    if sp.top_k:
        procs.append(gen.TopKLogitsWarper(sp.top_k))
    if sp.top_p < 1:
        procs.append(gen.TopPLogitsWarper(sp.top_p))
    if sp.min_p:
        procs.append(gen.MinPLogitsWarper(sp.min_p))
    rng = np.random.default_rng(3)
    for _ in range(5):
        logits = (rng.standard_normal(300) * 2).astype(np.float32)
        context = rng.integers(0, 300, 40)
        ref = torch.softmax(procs(torch.tensor(context[None]), torch.tensor(logits[None]).double()), -1)[
            0
        ].numpy()
        np.testing.assert_allclose(probabilities(logits, sp, context), ref, rtol=1e-9, atol=1e-12)
