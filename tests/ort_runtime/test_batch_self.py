"""Self-speculation inside the continuous batch (ort_runtime/batching/self_round.py): requests
that self-draft, use prompt lookup, sample or decode plainly share rounds of draft_batch and
verify_tail_batch calls and get exactly the tokens of plain generation, with the gate forced on,
with forced rejections, and with the default gate."""

from __future__ import annotations

import random

import pytest
from loopcast.ort_runtime import load
from loopcast.ort_runtime.batching.engine import BatchCostGate, BatchingEngine, BatchRequest
from loopcast.ort_runtime.binding.batch_generator import BatchGenerator
from loopcast.ort_runtime.decoding.generation_config import GenerationConfig, SpeculationConfig
from loopcast.ort_runtime.decoding.sampling import SamplingParams

from loopcast.errors import RequestError
from tests.artifacts import artifact, require_exact_cpu_artifacts


@pytest.fixture(scope="module")
def model():
    require_exact_cpu_artifacts()
    return load(artifact("ouro-r3", max_batch=4))


class _AlwaysSelf(BatchCostGate):
    """Every self-speculating request drafts on every step it can (within the row budget)."""

    def engage_self(self, width, running, candidates, row_budget):
        super().engage_self(width, running, candidates, row_budget)
        chosen, rows = {}, 0
        for slot, k in candidates.items():
            if rows + k + 1 <= row_budget:
                chosen[slot], rows = k, rows + k + 1
        return chosen


def _requests(seed: int, n: int):
    rng = random.Random(seed)
    out = []
    for i in range(n):
        prompt = [rng.randrange(90) for _ in range(rng.randrange(1, 9))]
        mode = ("self", "self", "prompt-lookup", "none")[i % 4]
        k = rng.choice((None, 1, 3))
        config = GenerationConfig(speculation=SpeculationConfig(mode, num_draft_tokens=k))
        out.append(BatchRequest(prompt, rng.randrange(2, 18), speculative=mode, config=config))
    return out


def _oracle(model, requests, wrong_every: int = 0):
    """An oracle's drafts (``self_perturb``): plain greedy's next token, so rounds accept every
    draft; ``wrong_every`` n: the draft at every n-th position is wrong instead (partial accepts)."""
    full = [r.ids + list(model.stream_ids(r.ids, r.max_new_tokens, stop_ids=())) for r in requests]

    def perturb(sequence, token):
        if wrong_every and len(sequence) % wrong_every == 0:
            return (token + 1) % 90
        for seq in full:
            if len(seq) > len(sequence) and seq[: len(sequence)] == sequence:
                return seq[len(sequence)]
        return token

    return perturb


def _run(model, requests, **engine_options):
    engine = BatchingEngine(BatchGenerator(model.loaded), **engine_options).start()
    try:
        done = [engine.submit(r) for r in requests]
        return [c.result(120) for c in done], done, engine.stats
    finally:
        engine.shutdown()


@pytest.mark.parametrize(
    "options",
    [
        {"gate": _AlwaysSelf()},
        # forced rejections mid-chain: every second self-drafted token replaced
        {"gate": _AlwaysSelf(), "self_perturb": lambda seq, t: (t + 7) % 90 if len(seq) % 2 else t},
        {"gate": _AlwaysSelf(), "draft_row_budget": 3},  # at most one request drafts (k <= 2)
        # prompts prefilled 2 tokens a step while rounds run: their slots' dummy rows at n_b..
        {"gate": _AlwaysSelf(), "prefill_chunk": 2},
        {},  # the default gate
    ],
    ids=["always", "perturbed", "row-budget", "chunked", "default-gate"],
)
def test_self_rounds_equal_plain_greedy(model, options):
    requests = _requests(0, 8)  # 8 requests through 4 slots: they join and leave between rounds
    expected = [list(model.stream_ids(r.ids, r.max_new_tokens, stop_ids=())) for r in requests]
    got, done, stats = _run(model, requests, **options)
    assert got == expected
    if options:
        assert stats["self_rounds"] > 0 and stats["proposed"] > 0
        assert {c.speculative for c in done} == {"self", "prompt-lookup", "none"}
    if "self_perturb" in options:
        assert stats["accepted"] < stats["proposed"]


@pytest.mark.parametrize("wrong_every", [0, 3])
def test_accepted_drafts_commit_in_place(model, wrong_every):
    """Oracle drafts: rounds accept all of them (or up to every third position), so slots commit
    several rows per round while rejected rows' KV lies past them; still plain greedy's tokens."""
    requests = _requests(1, 8)
    expected = [list(model.stream_ids(r.ids, r.max_new_tokens, stop_ids=())) for r in requests]
    perturb = _oracle(model, requests, wrong_every)
    got, done, stats = _run(model, requests, gate=_AlwaysSelf(), self_perturb=perturb)
    assert got == expected
    selfs = [c for c in done if c.speculative == "self"]
    accepted, proposed = sum(c.accepted for c in selfs), sum(c.proposed for c in selfs)
    if wrong_every:
        assert 0 < accepted < proposed
    else:
        assert accepted == proposed > 10


def test_sampled_and_stop_ids_in_self_rounds(model):
    """A seeded sampled request and a stop id inside self rounds: the greedy requests get plain
    generation's tokens."""
    params = SamplingParams(temperature=0.9, top_k=20, seed=3)
    plain = list(model.stream_ids([5, 6, 7], 12, stop_ids=()))
    stop = plain[5]
    self_config = GenerationConfig(speculation=SpeculationConfig("self"))
    requests = [
        BatchRequest([5, 6, 7], 12, stop_ids=(stop,), speculative="self", config=self_config),
        BatchRequest([1, 2], 10, sampling=params, speculative="self", config=self_config),
        BatchRequest([3, 4, 5], 9, speculative="self", config=self_config),
    ]
    got, done, stats = _run(model, requests, gate=_AlwaysSelf())
    assert got[0] == plain[: plain.index(stop) + 1] and done[0].finish_reason == "eos"
    # the sampled request self-drafts too (exact in distribution, not per seed:
    # tests/ort_runtime/test_batch_sampled_speculation.py)
    assert len(got[1]) == 10 and done[1].speculative == "self"
    assert got[2] == list(model.stream_ids([3, 4, 5], 9, stop_ids=()))
    assert stats["self_rounds"] > 0


def test_without_the_self_batch_kinds_self_decodes_plainly(model):
    """An artifact (or a load) without draft_batch/verify_tail_batch: a self request is served
    plainly, and its completion says why."""
    kinds = ("prefill", "decode", "verify", "decode_batch", "verify_batch")
    older = load(model.loaded.path, kinds=kinds)
    engine = BatchingEngine(BatchGenerator(older.loaded), gate=_AlwaysSelf()).start()
    try:
        config = GenerationConfig(speculation=SpeculationConfig("self"))
        c = engine.submit(BatchRequest([4, 5, 6], 8, speculative="self", config=config))
        assert c.result(60) == list(model.stream_ids([4, 5, 6], 8, stop_ids=()))
        assert c.speculative.startswith("none (the artifact has no draft_batch graph")
    finally:
        engine.shutdown()


def test_self_needs_a_draft_depth():
    require_exact_cpu_artifacts()
    llama = load(artifact("llama-untied", max_batch=8))
    engine = BatchingEngine(BatchGenerator(llama.loaded))
    assert "self" not in engine.speculative_modes
    with pytest.raises(RequestError, match="speculative 'self'"):
        engine.submit(BatchRequest([1, 2], 4, speculative="self"))


def _gate_with_costs(decode: float, draft: float, tail: float, width: int = 4) -> BatchCostGate:
    gate = BatchCostGate(probe_every=3)
    for kind, cost in (("decode_batch", decode), ("draft_batch", draft), ("verify_tail_batch", tail)):
        gate.observe_cost(kind, width, cost)  # the warm-up run, left out
        gate.observe_cost(kind, width, cost)
    return gate


def test_gate_picks_requests_by_their_acceptance():
    # a round of K=3: 4 draft calls + 1 tail = 4·0.1 + 1.2 = 1.6 decodes; 4 running requests
    gate = _gate_with_costs(1.0, 0.1, 1.2)
    both = {0: 3, 1: 4}
    assert gate.engage_self(4, 4, both, 100) == both  # optimistic α = k: (4 + 7) / 1.7 > 4
    for _ in range(20):
        gate.observe_self(0, 3)  # request 0 accepts everything, request 1 nothing
        gate.observe_self(1, 0)
    # (4 + 3) / 1.6 > 4, and request 1's fifth draft call would cost more than it brings
    assert gate.engage_self(4, 4, both, 100) == {0: 3}
    assert gate.engage_self(4, 4, both, 3) == {}  # k + 1 = 4 rows exceed the budget of 3
    gate.forget(0)  # a new request in slot 0 starts from the mean over all rounds (~1.5, not 3)
    assert gate.engage_self(4, 4, {0: 3}, 100) == {}
    off = [gate.engage_self(4, 4, {0: 3}, 100) for _ in range(3)]
    assert off[:1] == [{}] and {0: 3} in off  # a probe every probe_every steps


def test_gate_scales_costs_to_an_unmeasured_width():
    gate = _gate_with_costs(1.0, 0.5, 4.0, width=4)  # a round of K=3 costs 6 decodes: never worth it
    gate.observe_cost("decode_batch", 8, 2.0)
    gate.observe_cost("decode_batch", 8, 2.0)
    # width 8: draft and tail costs scaled from width 4 (x2), so no exploring round
    assert gate.engage_self(8, 8, {s: 3 for s in range(8)}, 100) == {}
    assert gate.engage_self(2, 2, {0: 3}, 100) == {}  # no decode cost at width 2: decode first
