"""Ouro's exit gate through the pipeline (ort_runtime/decoding/exit_lanes.py), KV policy ``full``:
the tokens of the torch reference with the same options (exporter/reference_depth.py), equal to
plain gated ``full``, on tiny checkpoints with R = 2, 3, 4 and the demo (CPU fp32).

Beyond the final tokens, every cycle is checked against a teacher-forced serial reference at the
first affected cycle: a lane on the true path must give, at each depth, the loop steps' head
argmax and gate logit (bit for bit) at its position. Forced gates (every token exits at loop 1;
never before the last; a sign gate that alternates; clamps at min and max loops), forced draft
rejections (all, alternating), EOS, the length limit and the KV capacity with lanes in flight.
"""

from __future__ import annotations

import numpy as np
import pytest
from loopcast.exporter.reference_depth import depth_generate
from loopcast.ort_runtime import load
from loopcast.ort_runtime.decoding.exit_lanes import ExitGateLanes
from loopcast.ort_runtime.decoding.generation_config import GenerationConfig
from loopcast.ort_runtime.decoding.pipeline import ExitDrafts, PipelineCycles
from loopcast.ort_runtime.decoding.sampling import SamplingParams
from loopcast.ort_runtime.decoding.speculate import GenerationStats, stream

from loopcast.errors import RequestError
from tests.artifacts import artifact, reference, require_exact_cpu_artifacts
from tests.ort_runtime.test_exit_gate import PROMPT, _forced

LOOPED = ["ouro-r2-gqa", "ouro-r3", "ouro-r4-1layer"]  # R = 2, 3, 4


@pytest.fixture(scope="module", autouse=True)
def _exact_artifacts():
    require_exact_cpu_artifacts()


@pytest.fixture(scope="module")
def demo():
    return load(artifact("demo"))


def run(gen, prompt, n, *, hook=None, trace=True, stop_ids=(), **options):
    """A fresh generation on ``gen`` through the engine, traced (and drafts through ``hook``)."""
    gen.rewind(0)
    config = GenerationConfig.from_options(max_new_tokens=n, stop_ids=tuple(stop_ids), **options)
    parts = {}
    spec = config.speculation
    if spec.mode == "pipeline":
        parts["verifier"] = (
            ExitGateLanes(spec.pipeline_exit, trace=trace)
            if config.gated
            else PipelineCycles(spec.pipeline_exit, trace=trace, device_lanes=spec.pipeline_device_lanes)
        )
        if hook is not None:
            parts["proposer"] = ExitDrafts(hook)
    stats = GenerationStats()
    return list(stream(gen, list(prompt), config, stats=stats, **parts)), stats


def loop_reference(gen, sequence: list[int], start: int) -> dict[int, tuple[list[int], list[float]]]:
    """Teacher-forced loop steps on ``sequence``: at each position >= ``start``, each loop's head
    argmax and gate logit (every loop run, as gated ``full`` writes the KV)."""
    gen.rewind(0)
    gen.prefill(sequence[:start])
    steps, out = gen.loop_steps, {}
    for p in range(start, len(sequence)):
        steps.embed(sequence[p], p)
        heads, gates = [], []
        for r in range(steps.num_loops):
            gates.append(steps.loop(r))
            heads.append(steps.head(r))
        out[p] = (heads, gates)
        gen.commit([sequence[p]])
    gen.rewind(0)
    return out


def check_cycles(trace, sequence: list[int], reference: dict) -> int:
    """Every row of every cycle whose lane is on the true path (every token that entered at its
    position and before is the sequence's) against the reference; returns the rows checked."""
    entered: dict[int, int] = {}
    checked = 0
    for c, (positions, ids, token, gates) in enumerate(trace):
        if positions[0] >= 0:
            entered[positions[0]] = token
        for r, p in enumerate(positions):
            if (
                p < 0
                or p not in reference
                or any(entered.get(j, sequence[j]) != sequence[j] for j in range(p + 1))
            ):
                continue
            heads, want_gates = reference[p]
            assert ids[r] == heads[r], f"cycle {c}: head at loop {r}, position {p}"
            assert np.float32(gates[r]) == np.float32(want_gates[r]), (
                f"cycle {c}: gate at loop {r}, position {p}"
            )
            checked += 1
    return checked


@pytest.mark.parametrize("name", LOOPED)
def test_tokens_equal_the_reference_and_plain_gated(name: str) -> None:
    model, ref = load(artifact(name)), reference(name)
    gen, R = model.new_generator(), model.config.num_loops
    depths = set()
    for q in (0.1, 0.3, 0.5, 0.7):
        config = dict(exit_threshold=q)
        plain, plain_stats = run(gen, PROMPT, 24, **config)
        want = depth_generate(ref, PROMPT, GenerationConfig(24, exit_threshold=q, stop_ids=()))
        assert plain == want.tokens, q
        sequence = PROMPT + plain
        forced = loop_reference(gen, sequence, len(PROMPT))
        for exit_depth in range(1, R):
            for gate in ("always", "auto"):
                got, stats = run(
                    gen, PROMPT, 24, speculative="pipeline", gate=gate, pipeline_exit=exit_depth, **config
                )
                assert got == plain, (q, exit_depth, gate)
                assert (
                    stats.exit_histogram == plain_stats.exit_histogram == want.depth_stats()["exit_histogram"]
                )
                assert stats.kv_policy == "full" and gen.n == len(sequence) - 1
                assert stats.strategy == "exit-lanes" and stats.speculative == "pipeline"
                if gate == "always":
                    assert check_cycles(stats.pipeline_trace, sequence, forced) >= len(plain) - 1
        depths |= set(plain_stats.exit_histogram)
    assert len(depths) > 1  # the gate's decisions vary: the test sees more than one exit


def test_demo_equals_the_reference_in_fewer_cycles(demo) -> None:
    """On the demo the lanes equal the reference; where the gate exits early, drafts verified at
    the exit step make the gated pipeline need fewer cycles than the full-depth pipeline (at
    0.25 most tokens run 4 loops, and the count depends on the text's drafts)."""
    ref = reference("demo")
    gen = demo.new_generator()
    ids = demo.encode("def merge(left, right):\n    result = []\n")
    _, full_depth = run(
        gen, ids, 48, trace=False, speculative="pipeline", gate="always", pipeline_device_lanes=False
    )
    for q in (0.1, 0.2, 0.25):
        want = depth_generate(ref, ids, GenerationConfig(48, exit_threshold=q, stop_ids=())).tokens
        got, stats = run(gen, ids, 48, speculative="pipeline", gate="always", exit_threshold=q)
        assert got == want, q
        assert check_cycles(stats.pipeline_trace, ids + got, loop_reference(gen, ids + got, len(ids))) > 0
        if q < 0.25:
            assert stats.cycles < full_depth.cycles, (q, stats.cycles, full_depth.cycles)
        auto = demo.generate(ids, 48, exit_threshold=q, speculative="pipeline", stop_ids=())
        assert auto.tokens == want
        # the default (cost) gate prices the lanes against plain gated rows (GatedRowCosts): it
        # has a price for both and decides, rather than waiting for a decode step that never runs
        reason = auto.stats.gate_report["reason"]
        assert reason.startswith(("engaged", "stood down")), auto.stats.gate_report
        # which way it decides is the measured costs' (timing); engaged, its lanes ran
        assert auto.stats.proposed > 0 or not reason.startswith("engaged"), auto.stats.gate_report


def test_redrafts_from_deeper_heads(demo) -> None:
    """At q = 0.3 every token of this prompt runs the demo's 4 loops, so the tokens are full
    depth's and the lanes' schedule would be the full-depth pipeline's; re-drafting the
    successor from the predecessor's deeper heads (exit_lanes.py) takes fewer cycles."""
    gen = demo.new_generator()
    ids = demo.encode("def merge(left, right):\n    result = []\n")
    full, full_depth = run(gen, ids, 48, speculative="pipeline", gate="always", pipeline_device_lanes=False)
    got, stats = run(gen, ids, 48, speculative="pipeline", gate="always", exit_threshold=0.3)
    assert stats.exit_histogram == {4: 48} and got == full
    assert stats.cycles < full_depth.cycles and stats.accepted > full_depth.accepted
    assert check_cycles(stats.pipeline_trace, ids + got, loop_reference(gen, ids + got, len(ids))) > 0


def _oracle(sequence: list[int], wrong, vocab: int):
    def hook(position: int, draft: int) -> int:
        truth = sequence[position] if position < len(sequence) else draft
        return (truth + 1) % vocab if wrong(position) else truth

    return hook


def test_forced_gates_and_rejections() -> None:
    """Gate biases that force every exit to loop 1 (a token per cycle, no drafts) or to the last
    loop, the clamps, and a sign gate that switches exits token by token, each with drafts forced
    right, wrong, or alternating: the reference's tokens, checked cycle by cycle."""
    cases = [
        (30.0, None, {}, {1: 16}),
        (30.0, None, dict(min_loops=2), {2: 16}),
        (-30.0, None, {}, {3: 16}),
        (-30.0, None, dict(max_loops=2), {2: 16}),
        (0.0, 0, {}, None),
        (0.0, 0, dict(min_loops=2), None),
        (0.0, 0, dict(max_loops=2), None),
    ]
    for bias, sign_of, clamps, histogram in cases:
        model, ref = _forced(bias, sign_of)
        gen, vocab = model.new_generator(), model.config.vocab_size
        options = dict(exit_threshold=0.5, **clamps)
        want = depth_generate(ref, PROMPT, GenerationConfig(16, stop_ids=(), **options))
        sequence = PROMPT + want.tokens
        forced = loop_reference(gen, sequence, len(PROMPT))
        if histogram is not None:
            assert want.depth_stats()["exit_histogram"] == histogram
        for pattern in (lambda p: False, lambda p: True, lambda p: p % 2 == 0):
            hook = _oracle(sequence, pattern, vocab)
            got, stats = run(gen, PROMPT, 16, hook=hook, speculative="pipeline", gate="always", **options)
            assert got == want.tokens, (bias, sign_of, clamps)
            assert stats.exit_histogram == want.depth_stats()["exit_histogram"]
            check_cycles(stats.pipeline_trace, sequence, forced)
        if histogram == {1: 16}:  # every lane exits at loop 1: a token per cycle, nothing drafted
            assert stats.proposed == 0 and stats.cycles == 3 + 14
            # also when the drafting loop is deeper than the exits (the lanes never reach it)
            got, stats = run(
                gen, PROMPT, 16, speculative="pipeline", gate="always", pipeline_exit=2, **options
            )
            assert got == want.tokens and stats.proposed == 0 and stats.cycles == 3 + 14
        if bias == 0.0 and not clamps:
            loops = want.loops[1:]
            assert any(a != b for a, b in zip(loops, loops[1:]))  # the exits switch


def test_eos_and_length_limit_with_lanes_in_flight(demo) -> None:
    gen = demo.new_generator()
    prompt = demo.encode("class Queue:\n    def __init__(self):\n")
    options = dict(exit_threshold=0.2)
    plain, _ = run(gen, prompt, 40, **options)
    hook = _oracle(prompt + plain, lambda p: False, demo.config.vocab_size)  # lanes stay in flight
    eos = plain[9]
    want, want_stats = run(gen, prompt, 40, stop_ids=(eos,), **options)
    n_after = gen.n
    got, stats = run(
        gen, prompt, 40, hook=hook, stop_ids=(eos,), speculative="pipeline", gate="always", **options
    )
    assert got == want and stats.finish_reason == want_stats.finish_reason == "eos"
    assert gen.n == n_after and stats.discarded_lanes > 0
    assert stats.exit_histogram == want_stats.exit_histogram
    for limit in (1, 2, 5, 17):
        got, stats = run(gen, prompt, limit, hook=hook, speculative="pipeline", gate="always", **options)
        assert got == plain[:limit] and stats.finish_reason == "length"
        assert gen.n == len(prompt) + limit - 1 and sum(stats.exit_histogram.values()) == limit
    assert run(gen, prompt, 40, **options)[0] == plain  # the generator is still usable


def test_kv_capacity_with_lanes_in_flight() -> None:
    model = load(artifact("ouro-r4-1layer", max_length=24))
    gen = model.new_generator()
    prompt = [5, 9, 2, 11]
    for q in (0.3, 0.6):
        plain, plain_stats = run(gen, prompt, 100, exit_threshold=q)
        assert plain_stats.finish_reason == "length" and len(prompt) + len(plain) == 24 + 1
        for pattern in (lambda p: False, lambda p: p % 2 == 0):
            hook = _oracle(prompt + plain, pattern, model.config.vocab_size)
            got, stats = run(
                gen, prompt, 100, hook=hook, speculative="pipeline", gate="always", exit_threshold=q
            )
            assert got == plain and stats.finish_reason == "length"
            assert all(p < 24 for positions, *_ in stats.pipeline_trace for p in positions)


def test_refusals() -> None:
    model = load(artifact("ouro-r3"))
    gated = dict(exit_threshold=0.5, speculative="pipeline")
    cases = [
        (dict(gated, kv_policy="last-exited"), "takes kv_policy 'full'"),
        (dict(gated, sampling=SamplingParams(temperature=0.7)), "drop the sampling options"),
        (dict(exit_threshold=0.5, speculative="self"), "other speculative modes"),
    ]
    for options, message in cases:
        with pytest.raises(RequestError, match=message):
            model.generate(PROMPT, max_new_tokens=2, **options)
    gen = model.new_generator()
    with pytest.raises(RequestError, match="ExitGateLanes"):  # a full-depth pipeline for a gated request
        stream_config = GenerationConfig.from_options(max_new_tokens=2, **gated)
        list(stream(gen, PROMPT, stream_config, verifier=PipelineCycles()))
    assert (
        gen.n == 0
        and model.generate(PROMPT, 4, **gated).tokens == model.generate(PROMPT, 4, exit_threshold=0.5).tokens
    )
