"""The recurrent-depth (Huginn) pipeline returns exactly plain greedy's tokens (CPU fp32, tiny-huginn).

Beyond the final tokens, every cycle whose leaving row holds a lane is checked against the
serial reference at the first affected cycle: the lane leaving the coda at position p must give
plain greedy's token p+1, with the logits of plain's one-row coda call bit for bit. Rejections are
forced through the drafts (a proposer replaying plain's continuation with chosen positions
spoiled: none, every third, every one, consecutive runs), with EOS, the length limit and the KV
capacity reached while lanes are in flight.
"""

from __future__ import annotations

import numpy as np
import pytest

from loopcast.errors import RequestError
from loopcast.presets import PRESETS
from loopcast.vocab import GraphKind, OpSet, graph_plan

pytest.importorskip("torch")  # the fixture exports the checkpoint

from loopcast.ort_runtime.binding.recurrent_generator import RecurrentGenerator  # noqa: E402
from loopcast.ort_runtime.decoding.generation_config import GenerationConfig  # noqa: E402
from loopcast.ort_runtime.decoding.recurrent_stream import stream_recurrent  # noqa: E402
from loopcast.ort_runtime.decoding.stats import GenerationStats  # noqa: E402
from loopcast.ort_runtime.loading.artifact import open_artifact  # noqa: E402

from tests.artifacts import huginn as tiny_huginn  # noqa: E402
from tests.artifacts import require_exact_cpu_artifacts  # noqa: E402

MAX_LENGTH = 48
PROMPT = [3, 17, 42, 8, 3, 17, 42]  # repeats: prompt lookup drafts from the start
VOCAB = PRESETS["tiny-huginn"].vocab_size


@pytest.fixture(scope="module")
def gen():
    require_exact_cpu_artifacts()
    _, art = tiny_huginn(MAX_LENGTH)
    return RecurrentGenerator(open_artifact(art))


class Oracle:
    """Drafts plain greedy's token at each position, spoiled at the positions in ``spoil``."""

    def __init__(self, sequence: list[int], spoil=()) -> None:
        self.sequence, self.spoil = sequence, set(spoil)

    def propose(self, context, k):
        q = len(context)
        if q >= len(self.sequence):
            return []
        truth = self.sequence[q]
        return [(truth + 1) % VOCAB if q in self.spoil else truth]


def run(gen, prompt, n, *, proposer=None, trace=False, stop_ids=(), **options):
    gen.rewind(0)
    stats = GenerationStats()
    config = GenerationConfig.from_options(max_new_tokens=n, stop_ids=stop_ids, **options)
    tokens = list(stream_recurrent(gen, prompt, config, stats=stats, proposer=proposer, trace=trace))
    return tokens, stats, gen.n


def plain(gen, prompt, n, loops, state_seed=None, stop_ids=()):
    """Plain greedy decoding's tokens, the logits of each, and the n it leaves."""
    tokens, stats, n_left = run(gen, prompt, n, loops=loops, state_seed=state_seed, stop_ids=stop_ids)
    gen.rewind(0)
    gen.configure(loops, state_seed)
    _, logits = gen.greedy(prompt, len(tokens))
    return tokens, logits, n_left


def check_cycles(trace, sequence: list[int], logits: list[np.ndarray], prompt_len: int, loops: int) -> int:
    """Every cycle whose leaving row holds a lane against plain decoding (the serial reference);
    returns how many were checked."""
    checked = 0
    for c, (positions, target, _, row_logits) in enumerate(trace):
        p = positions[loops - 1]
        if p < 0:
            continue
        assert target == sequence[p + 1], f"cycle {c}: the lane leaving at position {p}"
        # the leaving row is plain's one-row coda call bit for bit
        assert np.array_equal(row_logits, logits[p + 1 - prompt_len]), f"cycle {c}: logits at position {p}"
        checked += 1
    return checked


@pytest.mark.parametrize("loops", [1, 4, 32])
@pytest.mark.parametrize("state_seed", [None, 7])
def test_prompt_lookup_lanes_equal_plain(gen, loops, state_seed):
    want, logits, n_left = plain(gen, PROMPT, 16, loops, state_seed)
    for gate in ("always", "auto"):
        got, stats, n_got = run(
            gen, PROMPT, 16, loops=loops, state_seed=state_seed, speculative="pipeline", gate=gate, trace=True
        )
        assert got == want, (loops, gate)
        assert n_got == n_left  # the prefix, the prompt and every token but the last
        assert stats.strategy == "pipeline" and stats.exact_greedy
        if gate == "always":
            assert (
                check_cycles(stats.pipeline_trace, PROMPT + want, logits, len(PROMPT), loops) == len(want) - 1
            )


@pytest.mark.parametrize("loops", [4, 32])
@pytest.mark.parametrize(
    "spoil",
    [(), range(0, 99, 3), range(99), [*range(12, 16), *range(20, 23)]],
    ids=["none", "every-third", "all", "runs"],
)
def test_forced_rejections_equal_plain_at_every_cycle(gen, loops, spoil):
    want, logits, n_left = plain(gen, PROMPT, 20, loops)
    sequence = PROMPT + want
    got, stats, n_got = run(
        gen,
        PROMPT,
        20,
        loops=loops,
        speculative="pipeline",
        gate="always",
        proposer=Oracle(sequence, spoil),
        trace=True,
    )
    assert got == want and n_got == n_left
    assert check_cycles(stats.pipeline_trace, sequence, logits, len(PROMPT), loops) == len(want) - 1
    spoiled = [q for q in range(len(PROMPT) + 1, len(sequence) - 1) if q in set(spoil)]
    assert stats.proposed - stats.accepted == len(spoiled)  # each spoiled draft rejected, nothing else
    if not spoiled:  # full acceptance: after the first lane's r cycles, one token per cycle
        assert stats.cycles == loops + len(want) - 2
        assert stats.core_passes == stats.cycles  # one pass over the core per cycle
    if spoiled and loops > 1:
        assert stats.discarded_lanes > 0


@pytest.mark.parametrize("loops", [4, 32])
def test_eos_and_length_limit_with_lanes_in_flight(gen, loops):
    want, _, _ = plain(gen, PROMPT, 20, loops)
    sequence = PROMPT + want
    eos = want[9]
    stop_want, _, stop_n = plain(gen, PROMPT, 20, loops, stop_ids=(eos,))
    got, stats, n_got = run(
        gen,
        PROMPT,
        20,
        loops=loops,
        speculative="pipeline",
        gate="always",
        proposer=Oracle(sequence),
        stop_ids=(eos,),
    )
    assert got == stop_want and n_got == stop_n and stats.finish_reason == "eos"
    assert stats.discarded_lanes > 0  # lanes past the EOS were in flight
    for limit in (1, 2, 5):
        got, stats, n_got = run(
            gen, PROMPT, limit, loops=loops, speculative="pipeline", gate="always", proposer=Oracle(sequence)
        )
        assert got == want[:limit] and n_got == len(PROMPT) + limit - 1 and stats.finish_reason == "length"


def test_the_kv_capacity_with_lanes_in_flight(gen):
    """Lanes are never spawned past the KV capacity; the generation stops there as plain does."""
    prompt = (PROMPT * 7)[: MAX_LENGTH - 6]
    want, _, n_left = plain(gen, prompt, 40, 8)
    assert len(prompt) + len(want) == MAX_LENGTH + 1  # plain ran to the capacity
    got, stats, n_got = run(
        gen, prompt, 40, loops=8, speculative="pipeline", gate="always", proposer=Oracle(prompt + want)
    )
    assert got == want and n_got == n_left == MAX_LENGTH and stats.finish_reason == "length"


class Never:
    def propose(self, context, k):
        return []


def test_the_gate_stands_down_when_no_lane_gets_a_draft(gen):
    """Without drafts every token is a cold lane (r cycles): the hit-density gate turns to plain
    steps, probing now and then; ungated, every round is the pipeline's. Tokens equal plain's."""
    want, _, n_left = plain(gen, PROMPT, 40, 4)
    auto, auto_stats, n_auto = run(gen, PROMPT, 40, loops=4, speculative="pipeline", proposer=Never())
    always, always_stats, _ = run(
        gen, PROMPT, 40, loops=4, speculative="pipeline", gate="always", proposer=Never()
    )
    assert auto == always == want and n_auto == n_left
    assert always_stats.rounds == len(want) - 1 and always_stats.cycles == 4 * (len(want) - 1)
    assert auto_stats.gate_transitions >= 1 and auto_stats.rounds < len(want) // 2


def test_a_generation_continues_after_the_pipeline(gen):
    """The pipeline leaves the KV as plain decoding does: a second generation on the same
    prefix, plain, gives the tokens of an all-plain run."""
    gen.rewind(0)
    config = GenerationConfig.from_options(max_new_tokens=6, stop_ids=(), loops=4)
    first_plain = list(stream_recurrent(gen, PROMPT, config))
    second_plain = list(stream_recurrent(gen, [5, 6], config))
    gen.rewind(0)
    piped = config.replace(speculative="pipeline")
    assert list(stream_recurrent(gen, PROMPT, piped)) == first_plain
    assert list(stream_recurrent(gen, [5, 6], config)) == second_plain


def test_what_the_pipeline_refuses_is_named(gen):
    _, art = tiny_huginn(MAX_LENGTH)
    loaded = open_artifact(art)
    for made, needle in (
        (RecurrentGenerator(loaded, kv_sharing="compress-s4"), "shares them"),
        (RecurrentGenerator(loaded, max_loops=8), "max_loops"),
    ):
        config = GenerationConfig.from_options(max_new_tokens=4, speculative="pipeline")
        with pytest.raises(RequestError, match=needle):
            list(stream_recurrent(made, PROMPT, config))
    plans = graph_plan(PRESETS["tiny-huginn"], OpSet.STOCK, verify_width=None, draft_depth=None)
    assert GraphKind.RECURRENT_CYCLE not in {p.kind for p in plans}  # stock graphs: no row addressing


class Repeat:
    """Drafts the last token again: a point-mass proposal that the rule keeps or replaces."""

    def propose(self, context, k):
        return [context[-1]]


def exact_second_token(gen, params: dict, kl_exit) -> dict[int, float]:
    """The second token's exact marginal under plain sampling at r = 4, Σ_t1 p(t1) p(t2 | t1),
    from plain steps' rows (at their KL exits where ``kl_exit`` is given)."""
    from loopcast.ort_runtime.decoding.sampling import SamplingParams, probabilities

    processed = SamplingParams(**params, seed=0)
    gen.rewind(0)
    gen.configure(4, None)
    p1 = probabilities(gen.step(PROMPT, kl_exit=kl_exit).logits[-1], processed, gen.tokens)
    exact: dict[int, float] = {}
    for t1 in map(int, p1.nonzero()[0]):
        gen.rewind(len(PROMPT))
        p2 = probabilities(gen.step([t1], kl_exit=kl_exit).logits[-1], processed, gen.tokens)
        for t2 in map(int, p2.nonzero()[0]):
            exact[t2] = exact.get(t2, 0.0) + float(p1[t1] * p2[t2])
    return exact


@pytest.mark.parametrize("kl", [None, 0.3])
def test_sampled_lanes_keep_plain_samplings_distribution(gen, kl):
    """The second token (the first lane leaving the coda, its successor's draft checked by the
    rejection rule) over many seeds against its exact marginal under plain sampling, at the same
    exit policy. A rule that always kept the draft, or always took the argmax, would put mass
    on one token; with the KL exit, one that drew from the lane's step-r row would follow the
    other marginal."""
    from loopcast.ort_runtime.decoding.sampling import SamplingParams

    from loopcast.kl_exit import KLExit

    params = dict(temperature=1.0, top_k=3)
    exact = exact_second_token(gen, params, None if kl is None else KLExit(kl))
    if kl is not None:  # the exits move the marginal far enough for the check to tell them apart
        other = exact_second_token(gen, params, None)
        assert 0.5 * sum(abs(exact.get(t, 0.0) - other.get(t, 0.0)) for t in set(exact) | set(other)) > 0.3
    runs, counts, verified = 400, {}, 0
    for seed in range(runs):
        tokens, stats, _ = run(
            gen,
            PROMPT,
            3,  # the lane at the second token's position gets a successor only if a third follows
            loops=4,
            speculative="pipeline",
            gate="always",
            proposer=Repeat(),
            sampling=SamplingParams(**params, seed=seed),
            kl_threshold=kl,
        )
        counts[tokens[1]] = counts.get(tokens[1], 0) + 1
        verified += stats.proposed
    assert verified == runs  # every second token was a leaving lane whose successor was checked
    support = set(exact) | set(counts)
    tv = 0.5 * sum(abs(counts.get(t, 0) / runs - exact.get(t, 0.0)) for t in support)
    assert tv < 0.12, (tv, counts, exact)


def test_sampled_pipeline_replays_for_a_seed(gen):
    from loopcast.ort_runtime.decoding.sampling import SamplingParams

    options = dict(
        loops=4, speculative="pipeline", gate="always", sampling=SamplingParams(temperature=0.8, seed=3)
    )
    a, stats, _ = run(gen, PROMPT, 24, **options)
    b, _, _ = run(gen, PROMPT, 24, **options)
    assert a == b and len(a) == 24
    assert stats.cycles > 0 and stats.proposed > 0


def kv_below(gen, n: int) -> dict:
    """Every KV slot's keys and values at positions < n (host copies)."""
    return {slot: [np.array(buffer.pull()[..., :n, :]) for buffer in pair] for slot, pair in gen.kv.items()}


def check_kl_pipeline(gen, options: dict, spoil=()):
    """The pipeline with oracle drafts (``spoil``: positions drafted wrong) against plain decoding
    at the same KL exit: tokens, each token's exit and every KV slot below n; returns plain's
    tokens and stats and the pipeline's stats."""
    want, want_stats, n_left = run(gen, PROMPT, 16, **options)
    want_kv = kv_below(gen, n_left)
    oracle = Oracle(PROMPT + want, spoil)
    spec = dict(speculative="pipeline", gate="always", proposer=oracle)
    got, stats, n_got = run(gen, PROMPT, 16, **spec, **options)
    assert got == want and n_got == n_left
    assert stats.exit_histogram == want_stats.exit_histogram and stats.kv_policy == "full"
    got_kv = kv_below(gen, n_got)
    for slot, pair in want_kv.items():
        for w, g in zip(pair, got_kv[slot], strict=True):
            assert np.array_equal(w, g), slot
    return want, want_stats, stats


@pytest.mark.parametrize(
    "loops, kl, min_loops", [(1, 0.3, None), (4, 0.3, None), (32, 0.15, None), (32, 0.3, 3), (8, 0.3, 8)]
)
@pytest.mark.parametrize("spoil", [(), range(0, 99, 3)], ids=["none", "every-third"])
def test_kl_exit_lanes_equal_plain(gen, loops, kl, min_loops, spoil):
    """With the KL exit (kv_policy full) the leaving lane takes the coda after each checked step
    until its exit: the same tokens as plain decoding at the same exit policy, each read at the
    same core step, and every KV slot below n as plain leaves it (the coda slots hold each
    position's exit-step KV, the core slots every step's)."""
    options = dict(loops=loops, kl_threshold=kl, min_loops=min_loops, state_seed=5)
    want, want_stats, stats = check_kl_pipeline(gen, options, spoil)
    if loops > 1 and (min_loops or 1) < loops:  # the case has teeth: tokens exit at several depths
        assert min(want_stats.exit_histogram) < loops and len(want_stats.exit_histogram) > 1
    assert stats.strategy == "pipeline" and stats.rounds > 0
    # prompt lookup's own drafts, and the default gate: still plain's tokens
    for gate in ("always", "auto"):
        got, _, _ = run(gen, PROMPT, 16, speculative="pipeline", gate=gate, **options)
        assert got == want, gate


def test_kl_exit_pipeline_refuses_last_exited(gen):
    config = GenerationConfig.from_options(
        max_new_tokens=4, speculative="pipeline", kl_threshold=0.3, kv_policy="last-exited"
    )
    with pytest.raises(RequestError, match="kv_policy 'full'"):
        list(stream_recurrent(gen, PROMPT, config))
