"""A recurrent-depth (Huginn) artifact through the runtime: prelude → r core steps → coda with r
chosen per generator, against the torch reference and the independent numpy forward (fp32, CPU)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from loopcast.errors import ExportError, RequestError
from loopcast.kl_exit import KLExit
from loopcast.kv_sharing import parse_sharing
from loopcast.presets import PRESETS
from loopcast.recurrent_state import initial_state

torch = pytest.importorskip("torch")

from loopcast.exporter.checkpoint import load_checkpoint  # noqa: E402
from loopcast.exporter.export import ExportOptions, export_checkpoint  # noqa: E402
from loopcast.exporter.reference import KVCache  # noqa: E402
from loopcast.exporter.reference_huginn import greedy_generate  # noqa: E402
from loopcast.ort_runtime.binding.recurrent_generator import RecurrentGenerator  # noqa: E402
from loopcast.ort_runtime.decoding.generation_config import GenerationConfig  # noqa: E402
from loopcast.ort_runtime.decoding.recurrent_stream import stream_recurrent  # noqa: E402
from loopcast.ort_runtime.decoding.sampling import SamplingParams, make_rng, probabilities, sample  # noqa: E402
from loopcast.ort_runtime.decoding.stats import GenerationStats  # noqa: E402
from loopcast.ort_runtime.loading.artifact import open_artifact  # noqa: E402
from loopcast.ort_runtime.loading.describe import describe_artifact  # noqa: E402

from tests.artifacts import huginn as tiny_huginn  # noqa: E402
from tests.huginn_numpy import HuginnNumpy  # noqa: E402

TINY = PRESETS["tiny-huginn"]
PROMPT = [3, 17, 42, 8]
MAX_LENGTH = 48


def run(gen, prompt, n, **options):
    """The family's decoding loop on ``gen`` from a reset: (tokens, stats), no stop ids."""
    gen.rewind(0)
    stats = GenerationStats()
    config = GenerationConfig.from_options(max_new_tokens=n, stop_ids=(), **options)
    return list(stream_recurrent(gen, prompt, config, stats=stats)), stats


def self_draft(gen, prompt, n, *, draft_loops, num_drafts=4, allow_inexact=False):
    return run(
        gen,
        prompt,
        n,
        loops=gen.loops,
        state_seed=gen.state_seed,
        speculative="self",
        draft_loops=draft_loops,
        num_draft_tokens=num_drafts,
        allow_inexact=allow_inexact,
    )


@pytest.fixture(scope="module")
def huginn():
    ckpt, art = tiny_huginn(MAX_LENGTH)  # shared with tests/ort_runtime/test_recurrent_api.py
    return ckpt, open_artifact(art), load_checkpoint(ckpt)


def test_manifest_knows_the_family(huginn):
    _, loaded, _ = huginn
    manifest = json.loads((loaded.path / "manifest.json").read_text())
    assert manifest["model"]["model_type"] == "huginn_raven"
    assert set(manifest["graphs"]) == {"prelude", "core_step", "coda", "recurrent_cycle"}
    assert manifest["graphs"]["recurrent_cycle"]["rows"] == 32  # a row per core step up to the maximum
    assert manifest["graphs"]["recurrent_cycle"]["kv_slots"] == list(range(32 * 2 + 2 + 2))
    assert manifest["graphs"]["core_step"]["kv_slots"] == [0, 1]  # step 0's names, rebound per step
    assert manifest["kv_layout"]["slots"] == 32 * 2 + 2 + 2
    assert manifest["verify_width"] is None and manifest["draft_depth"] is None
    assert "core_step    core_step.onnx    rows dynamic  runs r = 1..32 times (default 4)" in (
        describe_artifact(loaded.path)
    )


@pytest.mark.parametrize("loops", [1, 4, 32])
@pytest.mark.parametrize("seed", [None, 7])
def test_plain_greedy_matches_the_reference(huginn, loops, seed):
    ckpt, loaded, model = huginn
    tokens, logits = RecurrentGenerator(loaded, loops=loops, state_seed=seed).greedy(PROMPT, 8)
    want_tokens, want_logits = greedy_generate(
        model, PROMPT, 8, loops=loops, seed=seed, max_length=MAX_LENGTH
    )
    assert tokens == want_tokens
    for got, want in zip(logits, want_logits):
        np.testing.assert_allclose(got, want.numpy(), atol=1e-4, rtol=0)
    # the numpy forward recomputes the whole sequence; its rows are the runtime's steps
    sequence = PROMPT + tokens[:-1]
    state0 = initial_state(TINY.hidden_size, TINY.state_std, np.arange(len(sequence)), seed)
    rows = HuginnNumpy(ckpt).logits(sequence, loops, state0)[len(PROMPT) - 1 :]
    np.testing.assert_allclose(np.stack(logits), rows, atol=1e-4, rtol=0)


def test_loops_per_call_and_rewind(huginn):
    """A call may run another depth; rewinding and recomputing at the generator's depth gives
    the plain tokens back (a shallower call's stale deep KV is rewritten before it is read)."""
    _, loaded, _ = huginn
    plain, _ = RecurrentGenerator(loaded, loops=4, state_seed=1).greedy(PROMPT, 6)
    g = RecurrentGenerator(loaded, loops=4, state_seed=1)
    first = int(g.step(PROMPT).next_ids[-1])
    g.step([first], loops=2)  # a shallow look at the next position
    g.rewind(len(PROMPT))
    tokens = [first]
    while len(tokens) < 6:
        tokens.append(int(g.step([tokens[-1]]).next_ids[-1]))
    assert tokens == plain


def test_loops_and_seed_are_checked(huginn):
    _, loaded, _ = huginn
    for bad in (0, 33, 2.0):
        with pytest.raises(RequestError, match="loops"):
            RecurrentGenerator(loaded, loops=bad)
    with pytest.raises(RequestError, match="state_seed"):
        RecurrentGenerator(loaded, state_seed=-1)
    assert RecurrentGenerator(loaded).loops == TINY.loops_default
    small = RecurrentGenerator(loaded, max_loops=3)  # KV for 3 steps only: 3 x 2 core slots + 4
    assert len(small.kv) == 10 and small.loops == 3
    with pytest.raises(RequestError, match=r"1\.\.3 \(max_loops\)"):
        small.step(PROMPT, loops=4)


def test_other_kinds_options_are_refused(huginn, tmp_path):
    ckpt, _, _ = huginn
    with pytest.raises(ExportError, match="--draft-depth"):
        export_checkpoint(ckpt, tmp_path / "x", ExportOptions(max_length=MAX_LENGTH, draft_depth=1))
    with pytest.raises(ExportError, match="--max-batch must be in"):
        export_checkpoint(ckpt, tmp_path / "x", ExportOptions(max_length=MAX_LENGTH, max_batch=0))


def test_graphs_are_unrolled_and_rotate_halves(huginn):
    """No control flow; the attention rotates halves (the exporter reorders q/k so that they are
    the release's pairs: the parity tests above check the result against pair rotation)."""
    import onnx

    _, loaded, _ = huginn
    for kind in ("prelude", "core_step", "coda"):
        graph = onnx.load(loaded.path / f"{kind}.onnx", load_external_data=False).graph
        ops = {node.op_type for node in graph.node}
        assert not ops & {"Loop", "If", "Scan"}
        attention = [
            node for node in graph.node if node.op_type in ("GroupQueryAttention", "BatchInvariantAttention")
        ]
        assert attention and all(
            next(a.i for a in node.attribute if a.name == "rotary_interleaved") == 0 for node in attention
        )


@pytest.mark.parametrize("loops, draft_loops, num_drafts", [(4, 1, 3), (32, 1, 4), (32, 8, 4), (32, 24, 2)])
@pytest.mark.parametrize("seed", [None, 7])
def test_self_draft_gives_plain_greedy(huginn, loops, draft_loops, num_drafts, seed):
    _, loaded, _ = huginn
    plain, _ = RecurrentGenerator(loaded, loops=loops, state_seed=seed).greedy(PROMPT, 12)
    assert loaded.manifest.op_set == "loopcast-attention" and loaded.exact_verify  # measured at export
    tokens, stats = self_draft(
        RecurrentGenerator(loaded, loops=loops, state_seed=seed),
        PROMPT,
        12,
        draft_loops=draft_loops,
        num_drafts=num_drafts,
    )
    assert tokens == plain
    assert stats.rounds > 0 and stats.proposed >= stats.accepted
    assert stats.exact_greedy  # verify rows are decode rows bit for bit: exact by construction


def test_self_draft_rejects_and_reaches_the_capacity(huginn):
    """Shallow drafts are rejected (the rows past the accepted ones are rewritten next round),
    and rounds shrink at the KV capacity: the tokens stay plain greedy's to the last position."""
    _, loaded, _ = huginn
    prompt = list(range(5, 5 + MAX_LENGTH - 10))
    plain, _ = RecurrentGenerator(loaded, loops=32, state_seed=2).greedy(prompt, 50)
    tokens, stats = self_draft(
        RecurrentGenerator(loaded, loops=32, state_seed=2),
        prompt,
        50,
        draft_loops=1,
        num_drafts=4,
    )
    assert tokens == plain and len(tokens) == 11
    assert stats.accepted < stats.proposed


def test_self_draft_is_refused_where_rows_are_not_exact(huginn, tmp_path):
    """The stock attention's M-row rows differ from its one-row rows (measured at export):
    self-speculation runs there only with allow_inexact, and then says it is not exact."""
    ckpt, loaded, _ = huginn
    export_checkpoint(ckpt, tmp_path / "stock", ExportOptions(max_length=MAX_LENGTH, ops="stock"))
    stock = open_artifact(tmp_path / "stock")
    assert not stock.exact_verify
    with pytest.raises(RequestError, match="allow_inexact"):
        self_draft(RecurrentGenerator(stock, loops=4), PROMPT, 4, draft_loops=2)
    plain, _ = RecurrentGenerator(stock, loops=4).greedy(PROMPT, 6)
    tokens, stats = self_draft(
        RecurrentGenerator(stock, loops=4), PROMPT, 6, draft_loops=2, allow_inexact=True
    )
    assert tokens == plain and not stats.exact_greedy  # equal here; not promised
    generator = RecurrentGenerator(loaded, loops=4)
    for bad in (0, 4):
        with pytest.raises(RequestError, match="draft_loops"):
            self_draft(generator, PROMPT, 4, draft_loops=bad, allow_inexact=True)


# This random model's step-to-step KL settles around 0.1-0.35 (it never goes below 0.09), so
# these thresholds exit at different steps for different tokens.
@pytest.mark.parametrize("threshold", [0.15, 0.3])
@pytest.mark.parametrize("kv_policy", ["full", "last-exited"])
def test_kl_exit_matches_the_reference(huginn, threshold, kv_policy):
    _, loaded, model = huginn
    rule = KLExit(threshold, kv_policy=kv_policy)
    exits, want_exits = [], []
    tokens, logits = RecurrentGenerator(loaded, loops=32, state_seed=7).greedy(
        PROMPT, 10, kl_exit=rule, exits=exits
    )
    want, want_logits = greedy_generate(
        model, PROMPT, 10, loops=32, seed=7, max_length=MAX_LENGTH, kl_exit=rule, exits=want_exits
    )
    assert tokens == want and exits == want_exits
    assert min(exits) < 32 and len(set(exits)) > 1  # exits happen, at different steps
    for got, ref in zip(logits, want_logits):
        np.testing.assert_allclose(got, ref.numpy(), atol=1e-4, rtol=0)


@pytest.mark.parametrize("loops, kl", [(1, None), (4, None), (32, None), (32, 0.15), (32, 0.3), (4, 0.3)])
def test_verify_rows_are_one_row_steps(huginn, loops, kl):
    """verify(tokens) at r equals the same tokens as one-row steps bit for bit (loopcast
    attention: exact_verify), the KL exit's per-row exits included, and the reference within
    1e-4: what makes every speculative mode plain decoding."""
    _, loaded, model = huginn
    rule = None if kl is None else KLExit(kl)
    tokens, _ = RecurrentGenerator(loaded, loops=loops, state_seed=3).greedy(PROMPT, 6, kl_exit=rule)
    one = RecurrentGenerator(loaded, loops=loops, state_seed=3)
    one.step(PROMPT, kl_exit=rule)
    rows = [one.step([t], kl_exit=rule) for t in tokens]
    many = RecurrentGenerator(loaded, loops=loops, state_seed=3)
    many.step(PROMPT, kl_exit=rule)
    out = many.verify(tokens, rule)
    np.testing.assert_array_equal(out.logits, np.stack([r.logits[-1] for r in rows]))
    if kl is not None:
        assert list(out.row_exits) == [r.exit_loops for r in rows] and min(out.row_exits) < loops
    want_exits: list[int] = []
    _, want = greedy_generate(
        model, PROMPT, 7, loops=loops, seed=3, max_length=MAX_LENGTH, kl_exit=rule, exits=want_exits
    )
    np.testing.assert_allclose(out.logits, np.stack([w.numpy() for w in want[1:]]), atol=1e-4, rtol=0)


def test_kl_exit_kv_policies(huginn):
    """full: the skipped steps still run, so the core slots hold a plain run's KV bit for bit;
    last-exited: each skipped step's slots hold the exit step's K/V of the same layer."""
    _, loaded, _ = huginn
    cfg, m = loaded.config, len(PROMPT)
    plain = RecurrentGenerator(loaded, loops=8)
    plain.step(PROMPT)
    for policy in ("full", "last-exited"):
        g = RecurrentGenerator(loaded, loops=8)
        e = g.step(PROMPT, kl_exit=KLExit(0.5, kv_policy=policy)).exit_loops
        assert e < 8
        for k in range(8):
            for l in range(cfg.num_layers):
                got = g.kv[cfg.core_slot(k, l)][0].host[:, :, :m]
                if policy == "full" or k < e:
                    want = plain.kv[cfg.core_slot(k, l)][0].host[:, :, :m]
                else:
                    want = g.kv[cfg.core_slot(e - 1, l)][0].host[:, :, :m]
                np.testing.assert_array_equal(got, want)
    with pytest.raises(ValueError, match="kv_policy"):
        KLExit(kv_policy="skip")
    with pytest.raises(ValueError, match="exit_threshold"):
        KLExit(-1.0)


def test_kl_exit_never_below_zero_is_plain(huginn):
    _, loaded, _ = huginn
    plain, _ = RecurrentGenerator(loaded, loops=4).greedy(PROMPT, 6)
    exits = []
    tokens, _ = RecurrentGenerator(loaded, loops=4).greedy(PROMPT, 6, kl_exit=KLExit(0.0), exits=exits)
    assert tokens == plain and exits == [4] * 6


@pytest.mark.parametrize("sharing", ["compress-s2", "compress-s3", "compress-r2"])
def test_kv_sharing_matches_the_reference(huginn, sharing):
    """The release's compress-* lookups: fewer core slots (compress-s2: one per layer), tokens
    and logits as the reference's under the same sharing, and not those of a slot per step."""
    _, loaded, model = huginn
    g = RecurrentGenerator(loaded, loops=8, state_seed=3, kv_sharing=sharing)
    tokens, logits = g.greedy(PROMPT, 8)
    want, want_logits = greedy_generate(
        model, PROMPT, 8, loops=8, seed=3, max_length=MAX_LENGTH, sharing=parse_sharing(sharing)
    )
    assert tokens == want
    for got, ref in zip(logits, want_logits):
        np.testing.assert_allclose(got, ref.numpy(), atol=1e-4, rtol=0)
    cfg = loaded.config
    # core slots for the artifact's 32 steps x 2 layers, plus 2 prelude and 2 coda
    assert len(g.kv) == {"compress-s2": 2, "compress-s3": 3, "compress-r2": 32}[sharing] + 4
    _, plain_logits = RecurrentGenerator(loaded, loops=8, state_seed=3).greedy(PROMPT, 8)
    assert np.abs(np.stack(plain_logits[1:]) - np.stack(logits[1:])).max() > 1e-3
    assert cfg.num_kv_slots == 68
    with pytest.raises(RequestError, match="kv_sharing"):
        RecurrentGenerator(loaded, kv_sharing="latest-m4")
    with pytest.raises(RequestError, match="kv_sharing"):
        g.step([1], kl_exit=KLExit())


def test_sampled_decoding_follows_the_reference_distribution(huginn):
    """Sampling draws from the project's processed distribution of each row: replaying the
    reference's rows (teacher-forced on the sampled tokens) with the same seed gives the same
    tokens; temperature 0 is greedy; a seed fixes the tokens."""
    _, loaded, model = huginn
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=5)
    g = RecurrentGenerator(loaded, loops=4, state_seed=7)
    tokens, stats = run(g, PROMPT, 10, sampling=params, loops=4, state_seed=7)
    again, _ = run(g, PROMPT, 10, sampling=params, loops=4, state_seed=7)
    assert tokens == again and stats.exit_histogram == {4: 10} and stats.core_calls_per_token == 4
    cache = KVCache(loaded.config, MAX_LENGTH)
    rng, context, replay = make_rng(params), list(PROMPT), []
    with torch.no_grad():
        out = model(torch.tensor([PROMPT]), loops=4, cache=cache, seed=7)
        for token in tokens:
            replay.append(sample(probabilities(out.logits[0, -1].numpy(), params, context), rng))
            context.append(token)
            out = model(torch.tensor([[token]]), loops=4, start=len(context) - 1, cache=cache, seed=7)
    assert replay == tokens
    greedy, _ = RecurrentGenerator(loaded, loops=4, state_seed=7).greedy(PROMPT, 10)
    assert run(g, PROMPT, 10, sampling=SamplingParams(temperature=0.0), loops=4, state_seed=7)[0] == greedy
    exits = run(g, PROMPT, 10, sampling=params, loops=4, kl_threshold=0.3)[1].exit_histogram
    assert max(exits) <= 4 and min(exits) < 4
