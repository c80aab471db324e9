"""The speculation engine's contracts: one round loop for every proposer, exactness known and
enforced, gates on by default (ort_runtime/decoding/speculate.py, proposers.py, gates.py)."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
from loopcast.ort_runtime import load
from loopcast.ort_runtime.decoding.proposers import PromptLookupProposer, SelfDraftProposer
from loopcast.ort_runtime.decoding.protocols import CostsBase, VerifierBase, VerifierCaps
from loopcast.ort_runtime.decoding.speculate import GenerationStats

from loopcast.errors import RequestError
from loopcast.manifest import Manifest
from tests.artifacts import artifact, require_exact_cpu_artifacts
from tests.ort_runtime.stream_helpers import engine_stream


class RecordingProposer:
    """A user's proposer through the public protocol: knows the continuation, spoils every
    third draft, and records what the engine tells it."""

    name = "recording"

    def __init__(self, sequence: list[int]) -> None:
        self.sequence = sequence
        self.resets, self.advanced = [], []

    def reset(self, generator) -> None:
        self.resets.append(generator)
        self.advanced = []

    def advance(self, committed: list[int]) -> None:
        self.advanced += committed

    def propose(self, context: list[int], k: int) -> list[int]:
        truth = self.sequence[len(context) : len(context) + k]
        return [t if (len(context) + i) % 3 else (t + 1) % 50 for i, t in enumerate(truth)]


@pytest.fixture(scope="module")
def tiny():
    require_exact_cpu_artifacts()
    return load(artifact("ouro-r3"))


def test_user_proposer_through_the_public_api(tiny) -> None:
    prompt = [5, 9, 2, 7]
    plain = tiny.generate(prompt, 40, stop_ids=())
    proposer = RecordingProposer(prompt + plain.tokens)
    gen = tiny.new_generator()
    out = tiny.generate(
        prompt, 40, stop_ids=(), speculative="custom", proposer=proposer, gate="always", generator=gen
    )
    assert out.tokens == plain.tokens and out.stats.exact_greedy
    assert out.stats.speculative == "custom" and out.stats.strategy == "verify"
    assert 0 < out.stats.accepted < out.stats.proposed  # some drafts spoiled, some right
    assert proposer.resets == [gen]
    # advance hears exactly the committed tokens, in order (pending + accepted drafts per round)
    assert proposer.advanced[: len(out.tokens) - 1] == out.tokens[:-1]


def test_custom_mode_needs_a_proposer_and_a_proposer_must_propose(tiny) -> None:
    with pytest.raises(RequestError, match="'custom' needs a proposer"):
        tiny.generate([1, 2], 4, speculative="custom")
    with pytest.raises(RequestError, match="no propose"):
        tiny.generate([1, 2], 4, speculative="custom", proposer=object())
    with pytest.raises(RequestError, match="takes a proposer that drafts depth-d states"):
        tiny.generate([1, 2], 4, speculative="self", proposer=PromptLookupProposer())
    assert tiny.generate([1, 2], 4).tokens  # still usable


def test_speculation_on_an_inexact_artifact_is_refused_unless_allowed() -> None:
    model = load(artifact("ouro-r3", ops="stock"))
    assert model.loaded.manifest.exact_verify == {"cpu": False, "cuda": False}
    with pytest.raises(RequestError, match=r"not exact.*fetch_deps.sh.*--allow-inexact"):
        model.generate([3, 4, 5], 8, speculative="self")
    plain = model.generate([3, 4, 5], 8)
    assert plain.stats.exact_greedy  # plain decoding needs no exactness
    loose = model.generate([3, 4, 5], 8, speculative="prompt-lookup", allow_inexact=True)
    assert not loose.stats.exact_verify and not loose.stats.exact_greedy


@pytest.mark.parametrize(
    "ops,expected",
    [("loopcast-attention", {"cpu": True, "cuda": False}), ("loopcast", {"cpu": True, "cuda": True})],
)
def test_exactness_is_measured_and_declared(ops: str, expected: dict) -> None:
    require_exact_cpu_artifacts()
    manifest = Manifest.read(artifact("ouro-r2-gqa", ops=ops))
    assert manifest.op_set == ops and manifest.exact_verify == expected


def test_default_fp32_export_is_exact_on_the_cpu() -> None:
    require_exact_cpu_artifacts()
    manifest = Manifest.read(artifact("ouro-r3"))
    assert manifest.op_set == "loopcast-attention" and manifest.exact_verify["cpu"]


class Costs(CostsBase):
    """Fixed step costs (decode 1, draft 0.3, verify_tail 0.9): the gate's decisions then do not
    depend on this machine's timing noise."""

    draft_share = 0.3

    def decode(self) -> float:
        return 1.0

    def mean(self, kind: str) -> float | None:
        return {"decode": 1.0, "draft": 0.3, "verify_tail": 0.9, "verify": 1.2}.get(kind)

    def snapshot_ms(self) -> dict:
        return {}

    def host_factor(self) -> float:
        return 1.0


def test_auto_gate_stands_down_and_bounds_its_probes_when_drafts_always_miss(tiny) -> None:
    prompt = [7, 1, 8, 2]
    plain = tiny.generate(prompt, 200, stop_ids=()).tokens
    vocab = tiny.config.vocab_size
    spec = dict(mode="self", proposer=SelfDraftProposer(lambda i, t: (t + 1) % vocab), costs=Costs())
    stats = GenerationStats()
    gen = tiny.new_generator()
    tokens = list(engine_stream(gen, prompt, len(plain), **spec, stats=stats))
    assert tokens == plain
    report = stats.gate_report
    assert stats.gate == "auto" and report["name"] == "cost" and report["chosen_by"] == "auto"
    assert "stood down" in report["reason"]
    # A failed probe of one draft wastes round_cost(1) - decode = 0.5 decode steps; the probes
    # are spaced so that at most ~2% of the decode time goes to them (plus the first rounds).
    assert report["probes"] <= 6 and stats.rounds <= 10, report
    assert stats.steps["decode"] >= len(plain) - 20


def _stood_down_self(tiny) -> dict:
    vocab = tiny.config.vocab_size
    return dict(mode="self", proposer=SelfDraftProposer(lambda i, t: (t + 1) % vocab), costs=Costs())


def test_stood_down_gate_runs_plain_streaks_that_stop_where_plain_decoding_stops(tiny, monkeypatch) -> None:
    """With the gate down and nothing due, the engine runs plain steps without consulting it
    (``CostGate.plain_streak``), each token emitted as it comes: a stop id, the token budget and
    the KV capacity end the generation at the same token as plain decoding, with the generator
    where plain decoding leaves it."""
    from loopcast.ort_runtime.decoding.gates import CostGate

    streaks = []
    original = CostGate.plain_streak

    def recording(self, step):
        n = original(self, step)
        streaks.append(n)
        return n

    monkeypatch.setattr(CostGate, "plain_streak", recording)
    prompt = [7, 1, 8, 2]
    plain = tiny.generate(prompt, 120, stop_ids=()).tokens
    gen = tiny.new_generator()
    stats = GenerationStats()
    assert list(engine_stream(gen, prompt, 120, **_stood_down_self(tiny), stats=stats)) == plain
    assert max(streaks) > 4 and stats.gate_report["steps_off"] >= 100
    # the gate is asked once per streak, not once per step
    assert len(streaks) + stats.gate_report["rounds_on"] < 60
    for stop in [t for i, t in enumerate(plain) if i > 20 and t not in plain[:i]][:8]:
        first = plain.index(stop)
        gen = tiny.new_generator()
        out = list(engine_stream(gen, prompt, 120, stop_ids=(stop,), **_stood_down_self(tiny)))
        assert out == plain[: first + 1] and gen.n == len(prompt) + first
    for budget in range(1, 40, 3):
        gen = tiny.new_generator()
        assert list(engine_stream(gen, prompt, budget, **_stood_down_self(tiny))) == plain[:budget]
        assert gen.n == len(prompt) + budget - 1
        assert gen.run("decode", gen.n, tokens=[plain[budget - 1]]).next_ids[0] == plain[budget]
    # The KV capacity: a prompt that leaves room for fewer tokens than asked
    room = tiny.loaded.manifest.max_length - 60
    long_prompt = (prompt * 40)[:room]
    want = tiny.generate(long_prompt, 80, stop_ids=()).tokens
    got = list(engine_stream(tiny.new_generator(), long_prompt, 80, **_stood_down_self(tiny)))
    assert got == want and len(got) < 80


def test_auto_gate_engages_when_drafts_are_right(tiny) -> None:
    prompt = [4, 4, 6]
    plain = tiny.generate(prompt, 60, stop_ids=()).tokens
    oracle = RecordingProposer(prompt + plain)
    oracle.propose = lambda context, k: (prompt + plain)[len(context) : len(context) + k]
    spec = dict(mode="custom", proposer=oracle, costs=Costs())
    stats = GenerationStats()
    assert list(engine_stream(tiny.new_generator(), prompt, 60, **spec, stats=stats)) == plain
    assert stats.accepted == stats.proposed and stats.tokens_per_round > 3
    assert stats.gate_report["reason"].startswith("engaged")


def test_auto_gate_prices_the_host_work_of_a_round(tiny) -> None:
    """Right drafts whose rounds cost 6x their steps' timers on the wall (host work per call, as
    on a small model on the GPU) lose to plain decode: the gate must stand down."""
    prompt = [4, 4, 6]
    plain = tiny.generate(prompt, 60, stop_ids=()).tokens

    class HostBound(Costs):
        def host_factor(self) -> float:
            return 6.0

    oracle = RecordingProposer(prompt + plain)
    oracle.propose = lambda context, k: (prompt + plain)[len(context) : len(context) + k]
    stats = GenerationStats()
    spec = dict(mode="custom", proposer=oracle, costs=HostBound())
    assert list(engine_stream(tiny.new_generator(), prompt, 60, **spec, stats=stats)) == plain
    assert stats.gate_report["reason"].startswith("stood down"), stats.gate_report
    assert stats.rounds <= 8


def test_host_factor_follows_the_engine_round_timers(tiny) -> None:
    """StepCosts.host_factor from the engine's timers: rounds that are all steady step time price
    at 1; host work per call raises the factor; plain rounds' own host work lowers it."""
    from loopcast.ort_runtime.decoding.gates import (
        DECODE_ROUND,
        SPEC_ROUND,
        SPEC_ROUND_CALLS,
        SPEC_ROUND_DEVICE,
        StepCosts,
    )

    gen = tiny.new_generator()
    costs = StepCosts(gen, 0.3)
    assert costs.host_factor() == 1.0  # nothing measured yet
    gen.clock.add("decode", 1.0, 10)  # decode 0.1 s
    gen.clock.add(SPEC_ROUND, 3.0, 2)
    gen.clock.add(SPEC_ROUND_DEVICE, 2.0, 0)
    gen.clock.add(SPEC_ROUND_CALLS, 0.0, 10)  # 0.1 s host per call
    assert abs(costs.host_factor() - 1.5 / 2.0) < 1e-9  # plain priced with the same 0.1 s per call
    gen.clock.add(DECODE_ROUND, 1.1, 10)  # plain: 0.11 per 0.1 step
    assert abs(costs.host_factor() - 1.5 / 1.1) < 1e-9
    tokens = list(engine_stream(tiny.new_generator(), [4, 4, 6], 24, mode="self", gate="auto"))
    assert tokens == tiny.generate([4, 4, 6], 24, stop_ids=()).tokens


def test_prompt_lookup_index_matches_a_plain_scan() -> None:
    def scan(seq, k, lo, hi):  # the definition: latest earlier occurrence of the last n tokens
        for n in range(min(hi, len(seq) - 1), lo - 1, -1):
            for start in range(len(seq) - n - 1, -1, -1):
                if seq[start : start + n] == seq[-n:]:
                    return seq[start + n : start + n + k]
        return []

    rng = np.random.default_rng(3)
    proposer = PromptLookupProposer(1, 3)
    for trial in range(30):
        seq = rng.integers(0, 6, int(rng.integers(1, 60))).tolist()
        for end in range(1, len(seq) + 1):  # growing context, then a rewound/different one
            assert proposer.propose(seq[:end], 4).tokens == scan(seq[:end], 4, 1, 3), (trial, end)


def test_prompt_lookup_evidence_is_the_length_of_the_match() -> None:
    proposer = PromptLookupProposer(1, 3)
    # the latest "3 4" follows "1 2 3 4" earlier: the match extends back past the 3-gram limit
    seq = [1, 2, 3, 4, 9, 8, 1, 2, 3, 4]
    got = proposer.propose(seq, 2)
    assert got.tokens == [9, 8] and got.evidence == 4
    assert proposer.propose([5, 6, 7, 5], 3).evidence == 1  # a one-token match
    assert proposer.propose([5, 6, 7], 3).tokens == [] and proposer.propose([5, 6, 7], 3).evidence is None
    long = [7] * 40
    assert proposer.propose(long, 1).evidence == PromptLookupProposer.MAX_EVIDENCE


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "loopcast.cli", *args], capture_output=True, text=True)


def test_cli_reports_the_default_gate_and_refuses_inexact_speculation() -> None:
    require_exact_cpu_artifacts()
    proc = _cli(
        "generate",
        str(artifact("ouro-r3")),
        "--prompt-ids",
        "3,4,5",
        "--max-new-tokens",
        "12",
        "--speculative",
        "self",
        "--json",
    )
    assert proc.returncode == 0, proc.stderr
    stats = json.loads(proc.stdout)["stats"]
    assert stats["gate"] == "auto" and stats["gate_report"]["name"] == "cost" and stats["exact_greedy"]
    stock = str(artifact("ouro-r3", ops="stock"))
    proc = _cli("generate", stock, "--prompt-ids", "3,4,5", "--max-new-tokens", "4", "--speculative", "self")
    assert proc.returncode == 2 and proc.stderr.startswith("error:") and "--allow-inexact" in proc.stderr
    assert proc.stderr.strip().count("\n") == 0 and "Traceback" not in proc.stderr
    proc = _cli(
        "generate",
        stock,
        "--prompt-ids",
        "3,4,5",
        "--max-new-tokens",
        "4",
        "--speculative",
        "self",
        "--allow-inexact",
        "--json",
    )
    assert proc.returncode == 0 and json.loads(proc.stdout)["stats"]["exact_greedy"] is False


def test_probes_that_leave_the_gate_down_space_out_even_when_they_hit() -> None:
    """Drafts accepted at α = 0.6 on a strategy that never pays (a round of one draft costs
    3.3 decode steps): every probe hits, none engages the gate, and the wait between probes
    doubles up to its cap instead of restarting at every hit."""
    from loopcast.ort_runtime.decoding.gates import CostGate

    class Dear(VerifierBase):
        kinds = ("draft", "verify_tail")

        def round_cost(self, costs, k: int) -> float:
            return 3.0 + 0.3 * k

    gate = CostGate(4, Costs(), Dear())
    probes, hits = [], 0
    for step in range(6000):
        if gate.engage(step):
            probes.append(step)
            hits += 1
            gate.observe(1, int(hits % 5 < 3), step=step)  # three of five probes accepted
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert "stood down" in gate.reason and gate.alpha > 0.4
    # the waste per probe shrinks a little as α settles higher; the wait still grows ~8x
    assert max(gaps) >= 8 * gaps[0] and min(gaps[2:]) >= 4 * gaps[0], gaps
    assert len(probes) < 12
    # A continuous strategy (the pipeline: one draft per probe, α remembered over ~50) keeps
    # probing at the base wait while its probes hit.
    Dear.caps = VerifierCaps(alpha_decay=0.98, persistent_lanes=True)
    gate, probes = CostGate(4, Costs(), Dear()), []
    for step in range(6000):
        if gate.engage(step):
            probes.append(step)
            gate.observe(1, int(len(probes) % 5 < 3), step=step)
    assert "stood down" in gate.reason and len(probes) > 30  # against 7 above
