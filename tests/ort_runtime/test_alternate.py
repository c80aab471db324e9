"""The alternate suffix (self-speculation with one fallback branch, tree verify) returns exactly
plain greedy's tokens and leaves exactly plain greedy's KV (CPU fp32).

Branches are forced through the proposer's own hooks against the plain greedy sequence (the
oracle): the branch selected (fully and partially accepted), discarded, a fork where neither
branch is right, no room for the branch (verify width, KV capacity), EOS inside either branch,
the length limit and a consumer that stops early. After a generation the committed KV of every
slot must equal plain decoding's bit for bit: a selected branch's KV was written at scratch
positions and moved into place, so a wrong move or a row that read the other branch shows here.
"""

from __future__ import annotations

import numpy as np
import pytest
from click.testing import CliRunner
from loopcast.cli import main
from loopcast.exporter.export import ExportOptions, export_checkpoint
from loopcast.ort_runtime import load
from loopcast.ort_runtime.binding.generator import Generator
from loopcast.ort_runtime.decoding.greedy_accept import greedy_accept_tree
from loopcast.ort_runtime.decoding.proposers import AlternateDraftProposer, Branch
from loopcast.ort_runtime.decoding.sampling import SamplingParams
from loopcast.ort_runtime.decoding.speculate import GenerationStats

from loopcast.errors import ExportError, RequestError
from tests.artifacts import artifact, checkpoint, require_exact_cpu_artifacts
from tests.ort_runtime.stream_helpers import engine_stream, run_fresh

LOOPED = ["ouro-r2-gqa", "ouro-r3", "ouro-r4-1layer"]


@pytest.fixture(scope="module", autouse=True)
def _exact_artifacts():
    require_exact_cpu_artifacts()


@pytest.fixture(scope="module")
def tree():
    return load(artifact("ouro-r3", tree_verify=True))


def run(
    gen: Generator, prompt: list[int], n: int, *, stop_ids=(), **spec
) -> tuple[list[int], GenerationStats]:
    return run_fresh(gen, prompt, n, stop_ids=stop_ids, **spec)


class Oracle:
    """Hooks that force branches against the plain greedy ``sequence`` (prompt + tokens)."""

    def __init__(
        self,
        sequence: list[int],
        vocab: int,
        primary_right: bool,
        alternate_right: bool,
        continuation_right=None,
    ) -> None:
        self.sequence, self.vocab = sequence, vocab
        self.primary_right, self.alternate_right = primary_right, alternate_right
        self.continuation_right = continuation_right  # branch drafts after its first: None = the model's own

    def truth(self, position: int, fallback: int) -> int:
        return self.sequence[position] if position < len(self.sequence) else fallback

    def wrong(self, position: int, fallback: int, shift: int = 1) -> int:
        return (self.truth(position, fallback) + shift) % self.vocab

    def fork(self, position: int, token: int, top2, gap: float):
        """Fork at every round's first draft row that the sequence covers."""
        if position >= len(self.sequence):
            return None
        primary = self.truth(position, token) if self.primary_right else self.wrong(position, token)
        alternate = self.truth(position, token) if self.alternate_right else self.wrong(position, token, 2)
        return primary, alternate

    def perturb(self, branch: str, position: int, token: int) -> int:
        if branch == "alternate" and self.continuation_right is not None:
            return self.truth(position, token) if self.continuation_right else self.wrong(position, token)
        return token

    def proposer(self) -> AlternateDraftProposer:
        return AlternateDraftProposer(0.5, fork_hook=self.fork, perturb=self.perturb)


def assert_plain_kv(gen: Generator, reference: Generator) -> None:
    assert gen.n == reference.n and gen.tokens == reference.tokens
    for slot in range(gen.model.config.num_kv_slots):
        for got, want in zip(gen.kv_arrays(slot), reference.kv_arrays(slot)):
            assert np.array_equal(got[:, :, : gen.n], want[:, :, : gen.n]), f"slot {slot}"


@pytest.mark.parametrize("name", LOOPED)
def test_every_gap_and_gate_equals_plain(name: str) -> None:
    model = load(artifact(name, tree_verify=True))
    gen = model.new_generator()
    rng = np.random.default_rng(5)
    for prompt in (
        rng.integers(0, model.config.vocab_size, 6).tolist(),
        rng.integers(0, model.config.vocab_size, 3).tolist() * 4,
    ):
        plain, _ = run(gen, prompt, 40)
        for gap in (0.02, 0.3, 1.0):
            for gate in ("always", "auto"):
                got, stats = run(gen, prompt, 40, mode="self", gate=gate, alternate_gap=gap)
                assert got == plain, (gap, gate)
                assert gen.n == len(prompt) + len(plain) - 1
                assert stats.forks == stats.alternate_selected + stats.alternate_discarded + stats.fork_misses
                if gap == 1.0 and gate == "always":  # every draft row is a near tie: every round forks
                    assert stats.forks > 0


@pytest.mark.parametrize(
    "case,primary,alternate,continuation",
    [
        ("selected", False, True, True),  # the branch wins and every branch draft is right
        ("partial", False, True, False),  # the branch wins at the fork, its next draft is wrong
        ("selected-own-drafts", False, True, None),
        ("discarded", True, False, None),
        ("fork-miss", False, False, None),
    ],
)
def test_forced_branches_equal_plain_tokens_and_kv(tree, case, primary, alternate, continuation) -> None:
    gen, reference = tree.new_generator(), tree.new_generator()
    prompt = np.random.default_rng(6).integers(0, tree.config.vocab_size, 7).tolist()
    plain, _ = run(reference, prompt, 40)
    oracle = Oracle(prompt + plain, tree.config.vocab_size, primary, alternate, continuation)
    # k = 2 of width 5: a fork at the first draft row has room for a branch of two rows.
    got, stats = run(
        gen, prompt, 40, mode="self", gate="always", proposer=oracle.proposer(), num_draft_tokens=2
    )
    assert got == plain
    assert_plain_kv(gen, reference)
    assert stats.forks > 0 and stats.fork_skips == 0
    if case == "selected":
        assert stats.alternate_selected == stats.forks and stats.alternate_tokens == 2 * stats.forks
        assert stats.accepted_by_position == [0] * len(stats.accepted_by_position)
    elif case == "partial":
        assert stats.alternate_selected == stats.forks and stats.alternate_tokens == stats.forks
    elif case == "selected-own-drafts":
        assert stats.alternate_selected == stats.forks and stats.alternate_tokens >= stats.forks
    elif case == "discarded":
        assert stats.alternate_selected == 0 and stats.alternate_discarded == stats.forks
    else:
        assert stats.fork_misses == stats.forks and stats.alternate_tokens == 0
    assert stats.tokens_per_round == pytest.approx((stats.accepted + stats.rounds) / stats.rounds)


def test_fork_after_the_first_draft_and_rejection_before_the_fork(tree) -> None:
    """Forks at the second draft row; the primary chain breaks before it every other round, so
    the branch is discarded unread, and wins otherwise."""
    gen, reference = tree.new_generator(), tree.new_generator()
    prompt = np.random.default_rng(7).integers(0, tree.config.vocab_size, 5).tolist()
    plain, _ = run(reference, prompt, 40)
    sequence, vocab = prompt + plain, tree.config.vocab_size
    seen = {"rows": 0}

    def fork(position, token, top2, gap):
        seen["rows"] += 1
        if seen["rows"] % 2 or position >= len(sequence):  # the round's second draft row
            return None
        return (sequence[position] + 1) % vocab, sequence[position]

    def perturb(branch, position, token):
        if branch == "primary" and position < len(sequence):
            # every other round a wrong first draft (rejected before the fork), else the truth
            return (sequence[position] + 3) % vocab if seen["rows"] % 4 == 0 else sequence[position]
        return token

    proposer = AlternateDraftProposer(0.5, fork_hook=fork, perturb=perturb)
    got, stats = run(gen, prompt, 40, mode="self", gate="always", proposer=proposer, num_draft_tokens=3)
    assert got == plain
    assert_plain_kv(gen, reference)
    assert stats.alternate_selected > 0 and stats.alternate_discarded > 0


def test_no_room_for_the_branch_falls_back_to_the_primary_chain(tree) -> None:
    gen = tree.new_generator()
    prompt = np.random.default_rng(8).integers(0, tree.config.vocab_size, 6).tolist()
    plain, _ = run(gen, prompt, 30)
    oracle = Oracle(prompt + plain, tree.config.vocab_size, False, True)
    # k = 4 fills the width of 5: every fork is skipped, counted, and the round stays exact.
    got, stats = run(
        gen, prompt, 30, mode="self", gate="always", proposer=oracle.proposer(), num_draft_tokens=4
    )
    assert got == plain
    # Rounds of 4 drafts skip their fork; only the last rounds, shortened by the length limit, fit one.
    assert stats.fork_skips > 0 and stats.forks + stats.fork_skips == stats.rounds


def test_at_the_kv_capacity() -> None:
    """Up to the last position: tree rounds need only the rows they use, so they run where a
    width-5 verify would not fit; branches that would pass the capacity are skipped."""
    model = load(artifact("ouro-r3", max_length=40, tree_verify=True))
    gen, reference = model.new_generator(), model.new_generator()
    prompt = np.random.default_rng(9).integers(0, model.config.vocab_size, 9).tolist()
    plain, plain_stats = run(reference, prompt, 100)
    assert plain_stats.finish_reason == "length" and reference.n == 40
    oracle = Oracle(prompt + plain, model.config.vocab_size, False, True, True)
    got, stats = run(
        gen, prompt, 100, mode="self", gate="always", proposer=oracle.proposer(), num_draft_tokens=2
    )
    assert got == plain and stats.finish_reason == "length"
    assert_plain_kv(gen, reference)
    assert stats.fork_skips > 0 and stats.alternate_selected > 0
    assert stats.steps["decode"] <= 1  # rounds ran to within one position of the capacity


@pytest.mark.parametrize("inside", ["selected branch", "primary chain", "discarded branch only"])
def test_eos_inside_either_branch(tree, inside: str) -> None:
    gen, reference = tree.new_generator(), tree.new_generator()
    prompt = np.random.default_rng(10).integers(0, tree.config.vocab_size, 6).tolist()
    plain, _ = run(reference, prompt, 40)
    sequence, vocab = prompt + plain, tree.config.vocab_size
    eos = plain[11]
    if inside == "discarded branch only":
        eos = next(t for t in range(vocab) if t not in plain)
        # The primary chain is right; the losing branch drafts nothing but the stop id.
        proposer = AlternateDraftProposer(
            0.5,
            fork_hook=lambda p, t, top2, gap: (
                (sequence[p], eos) if p < len(sequence) and sequence[p] != eos else None
            ),
        )
    else:
        selected = inside == "selected branch"
        proposer = Oracle(sequence, vocab, not selected, selected, True).proposer()
    want, want_stats = run(reference, prompt, 40, stop_ids=(eos,))
    got, stats = run(
        gen, prompt, 40, stop_ids=(eos,), mode="self", gate="always", proposer=proposer, num_draft_tokens=2
    )
    assert got == want and stats.finish_reason == want_stats.finish_reason
    assert_plain_kv(gen, reference)
    assert stats.forks > 0


def test_length_limits(tree) -> None:
    gen, reference = tree.new_generator(), tree.new_generator()
    prompt = np.random.default_rng(11).integers(0, tree.config.vocab_size, 6).tolist()
    plain, _ = run(reference, prompt, 20)
    oracle = Oracle(prompt + plain, tree.config.vocab_size, False, True, True)
    for limit in (1, 2, 3, 4, 7, 13):
        want, _ = run(reference, prompt, limit)
        got, stats = run(
            gen, prompt, limit, mode="self", gate="always", proposer=oracle.proposer(), num_draft_tokens=2
        )
        assert got == plain[:limit] == want and stats.finish_reason == "length"
        assert_plain_kv(gen, reference)


def test_a_consumer_that_stops_early_leaves_plain_state(tree) -> None:
    gen, reference = tree.new_generator(), tree.new_generator()
    prompt = np.random.default_rng(12).integers(0, tree.config.vocab_size, 6).tolist()
    plain, _ = run(reference, prompt, 30)
    oracle = Oracle(prompt + plain, tree.config.vocab_size, False, True, True)
    for stop_after in (1, 2, 5, 8):
        gen.rewind(0)
        tokens = engine_stream(
            gen, prompt, 30, mode="self", num_draft_tokens=2, gate="always", proposer=oracle.proposer()
        )
        got = [t for _, t in zip(range(stop_after), tokens)]
        tokens.close()
        assert got == plain[:stop_after]
        assert gen.n == len(prompt) + stop_after - 1
    # The generator goes on as plain decoding would from there.
    got, _ = run(gen, prompt, 30, mode="self", gate="always", alternate_gap=1.0)
    assert got == plain


def test_tree_accept_rule() -> None:
    branch = Branch(1, [7, 8, 9], np.zeros((3, 4), np.float32))
    # Primary 5, 6, 2 against targets 5, 7, ...: rejected at the fork, where the branch's 7 is right;
    # the branch's 8 is right (branch row 0 says 8), its 9 is not (row 1 says 4): next token 4.
    result = greedy_accept_tree([5, 6, 2], [5, 7, 1, 0], branch, [8, 4, 3])
    assert (result.accepted, result.branch_accepted, result.next_token) == (3, 2, 4)
    all_branch = greedy_accept_tree([5, 6, 2], [5, 7, 1, 0], branch, [8, 9, 3])
    assert (all_branch.accepted, all_branch.branch_accepted, all_branch.next_token) == (4, 3, 3)
    miss = greedy_accept_tree([5, 6, 2], [5, 1, 1, 0], branch, [8, 9, 3])
    assert (miss.accepted, miss.branch_accepted, miss.next_token, miss.fork_miss) == (1, 0, 1, True)
    before = greedy_accept_tree([4, 6, 2], [5, 7, 1, 0], branch, [8, 9, 3])
    assert (before.accepted, before.branch_accepted, before.next_token, before.fork_miss) == (0, 0, 5, False)
    past = greedy_accept_tree([5, 6, 2], [5, 6, 2, 0], branch, [8, 9, 3])
    assert (past.accepted, past.branch_accepted, past.next_token) == (3, 0, 0)


def test_bad_requests_name_the_problem_and_leave_the_generator_usable(tree) -> None:
    gen = tree.new_generator()
    prompt = [1, 2, 3, 4]
    plain, _ = run(gen, prompt, 10)
    for spec, fragment in (
        (dict(mode="self", alternate_gap=0.0), r"in \(0, 1\]"),
        (dict(mode="self", alternate_gap=1.5), r"in \(0, 1\]"),
        (dict(mode="prompt-lookup", alternate_gap=0.1), "speculative='self'"),
        (dict(mode="none", alternate_gap=0.1), "speculative='self'"),
        (dict(mode="pipeline", alternate_gap=0.1), "speculative='self'"),
        (dict(mode="self", alternate_gap=0.1, proposer=AlternateDraftProposer(0.1)), "not both"),
    ):
        with pytest.raises(RequestError, match=fragment):
            run(gen, prompt, 10, **spec)
    with pytest.raises(RequestError, match="greedy-only"):
        gen.rewind(0)
        list(
            engine_stream(
                gen,
                prompt,
                10,
                mode="self",
                alternate_gap=0.1,
                sampling=SamplingParams(temperature=0.8, seed=1),
            )
        )
    plain_gen = load(artifact("ouro-r3")).new_generator()
    with pytest.raises(RequestError, match="--tree-verify"):
        run(plain_gen, prompt, 10, mode="self", alternate_gap=0.1)
    assert run(gen, prompt, 10, mode="self", alternate_gap=0.1)[0] == plain
    assert run(plain_gen, prompt, 10, mode="self")[0] == plain


def test_cli_option_and_errors() -> None:
    art = str(artifact("ouro-r3", tree_verify=True))
    base = ["generate", art, "--prompt-ids", "1,2,3,4", "--max-new-tokens", "12", "--json"]
    plain = CliRunner().invoke(main, base)
    alt = CliRunner().invoke(
        main, base + ["--speculative", "self", "--gate", "always", "--alternate-gap", "1"]
    )
    assert plain.exit_code == alt.exit_code == 0, alt.output
    import json

    got = json.loads(alt.output)
    assert got["tokens"] == json.loads(plain.output)["tokens"] and got["stats"]["forks"] > 0
    bad = CliRunner().invoke(main, base + ["--speculative", "self", "--alternate-gap", "2"])
    lines = bad.output.strip().splitlines()
    assert bad.exit_code == 2 and lines[-1].startswith("error: ") and "(0, 1]" in lines[-1], bad.output
    assert "Traceback" not in bad.output
    sampled = CliRunner().invoke(
        main, base + ["--speculative", "self", "--alternate-gap", "0.1", "--temperature", "1"]
    )
    assert sampled.exit_code == 2 and "greedy-only" in sampled.output


def test_tree_verify_export_needs_a_looped_model_and_the_attention_op(tmp_path) -> None:
    with pytest.raises(ExportError, match="looped model"):
        export_checkpoint(checkpoint("llama-tied-gqa"), tmp_path / "a", ExportOptions(tree_verify=True))
    with pytest.raises(ExportError, match="loopcast attention op"):
        export_checkpoint(checkpoint("ouro-r3"), tmp_path / "b", ExportOptions(ops="stock", tree_verify=True))


def test_manifest_declares_the_tree_kinds_together(tmp_path) -> None:
    import json

    from loopcast.errors import ArtifactError
    from loopcast.manifest_schema import parse_manifest

    raw = json.loads((artifact("ouro-r3", tree_verify=True) / "manifest.json").read_text())
    assert parse_manifest(raw, tmp_path).graphs["tree_tail"].inputs
    lone = {**raw, "graphs": {k: v for k, v in raw["graphs"].items() if k != "tree_tail"}}
    with pytest.raises(ArtifactError, match="without the other"):
        parse_manifest(lone, tmp_path)
    stock = {
        **raw,
        "op_set": "stock",
        "graphs": {k: v for k, v in raw["graphs"].items() if k not in ("cycle", "cycle_run")},
    }
    with pytest.raises(ArtifactError, match="say there is none"):
        parse_manifest(stock, tmp_path)


def test_demo_model_near_ties_and_forced_branches() -> None:
    """The trained demo model: its own near ties fork and sometimes win; forced winning branches
    leave plain greedy's tokens and KV."""
    from loopcast.bench.harness import BENCH_PROMPTS

    demo = load(artifact("demo", tree_verify=True))
    gen, reference = demo.new_generator(), demo.new_generator()
    selected = 0
    for text in BENCH_PROMPTS[:3]:
        prompt = demo.encode(text)
        plain, _ = run(reference, prompt, 48)
        got, stats = run(gen, prompt, 48, mode="self", gate="always", alternate_gap=0.3)
        assert got == plain and stats.forks > 0
        assert_plain_kv(gen, reference)
        selected += stats.alternate_selected
        oracle = Oracle(prompt + plain, demo.config.vocab_size, False, True)
        got, stats = run(
            gen, prompt, 48, mode="self", gate="always", proposer=oracle.proposer(), num_draft_tokens=2
        )
        assert got == plain and stats.alternate_selected == stats.forks > 0
        assert_plain_kv(gen, reference)
    assert selected > 0
