"""A recurrent-depth (Huginn) artifact through the public paths: ``load(...).generate`` with the
same ``loops`` control as Ouro's static depth, the KL exit and the state seed as config
fields, every speculative mode against plain decoding at the same r and exit policy, seeded
sampling, the CLI and the server's one-request engine (tiny-huginn, fp32, CPU)."""

from __future__ import annotations

import json

import pytest

from loopcast.errors import RequestError

torch = pytest.importorskip("torch")

from click.testing import CliRunner  # noqa: E402
from loopcast.cli import main  # noqa: E402
from loopcast.exporter.checkpoint import load_checkpoint  # noqa: E402
from loopcast.exporter.reference_huginn import greedy_generate  # noqa: E402
from loopcast.ort_runtime.api import load  # noqa: E402
from loopcast.ort_runtime.batching.engine import BatchRequest  # noqa: E402
from loopcast.ort_runtime.batching.sequential import SequentialEngine  # noqa: E402
from loopcast.ort_runtime.binding.recurrent_generator import RecurrentGenerator  # noqa: E402
from loopcast.ort_runtime.decoding.families import RecurrentDecoding  # noqa: E402
from loopcast.ort_runtime.decoding.sampling import (  # noqa: E402
    SamplingParams,
    make_rng,
    probabilities,
    sample,
)
from loopcast.ort_runtime.loading.describe import describe_artifact  # noqa: E402

from loopcast.kl_exit import KLExit  # noqa: E402
from tests.artifacts import huginn as tiny_huginn  # noqa: E402

MAX_LENGTH = 48
PROMPT = [3, 17, 42, 8]
# a prompt that repeats itself, so prompt lookup has n-grams to draft from
LOOKUP_PROMPT = [5, 9, 11, 5, 9, 11, 5, 9]


@pytest.fixture(scope="module")
def huginn():
    ckpt, art = tiny_huginn(MAX_LENGTH)
    return ckpt, load(art)


def plain(model, prompt, n, **options):
    return model.generate(prompt, n, stop_ids=(), **options)


def test_the_family_is_chosen_at_load(huginn):
    _, model = huginn
    assert isinstance(model.decoding, RecurrentDecoding)
    assert isinstance(model.new_generator(), RecurrentGenerator)
    with pytest.raises(RequestError, match="must be a RecurrentGenerator"):
        model.generate(PROMPT, 2, generator=object())
    described = describe_artifact(model.loaded.path)
    assert "recurrent depth: 2 prelude + 2 core x r + 2 coda layers, r = 1..32 (default 4)" in described
    assert "per request     --loops r (1..32), --kl-threshold, --state-seed" in described


@pytest.mark.parametrize("loops", [1, 4, 32])
def test_loops_through_the_api_equal_the_reference(huginn, loops):
    ckpt, model = huginn
    result = plain(model, PROMPT, 8, loops=loops, state_seed=7)
    want, _ = greedy_generate(load_checkpoint(ckpt), PROMPT, 8, loops=loops, seed=7, max_length=MAX_LENGTH)
    assert result.tokens == want
    assert result.stats.exit_histogram == {loops: 8} and result.stats.core_calls_per_token == loops
    assert result.stats.core_passes == 7 * loops  # the first token's passes are the prompt's
    assert result.finish_reason == "length"


def test_default_depth_and_zero_state(huginn):
    _, model = huginn
    nothing = plain(model, PROMPT, 0, speculative="prompt-lookup")
    assert nothing.tokens == [] and nothing.finish_reason == "length"
    default = plain(model, PROMPT, 6)
    assert default.tokens == plain(model, PROMPT, 6, loops=model.config.loops_default).tokens
    assert default.stats.mean_loops == model.config.loops_default
    # the zero state is the seedless start: a fresh generator, whatever the pool held before
    assert plain(model, PROMPT, 6).tokens == default.tokens


@pytest.mark.parametrize("loops, kl", [(4, None), (32, None), (32, 0.15), (32, 0.3), (4, 0.3)])
@pytest.mark.parametrize("mode", ["prompt-lookup", "self", "pipeline"])
def test_every_speculative_mode_is_plain(huginn, loops, kl, mode):
    """Same r, same exit policy: the same tokens, and each token read at the same core step,
    speculating every round (gate always) or as the default gate decides."""
    _, model = huginn
    options = dict(loops=loops, kl_threshold=kl, state_seed=5)
    for prompt in (PROMPT, LOOKUP_PROMPT):
        want = plain(model, prompt, 14, **options)
        for gate in ("always", "auto"):
            got = plain(model, prompt, 14, speculative=mode, gate=gate, **options)
            assert got.tokens == want.tokens, (prompt, mode, gate)
            assert got.stats.exit_histogram == want.stats.exit_histogram
            assert got.stats.exact_greedy and got.stats.rounds > 0
            assert got.stats.gate == ("always" if gate == "always" else "hit-density")


def test_the_gate_stops_speculating_on_missing_drafts(huginn):
    """An always-wrong proposer: with the gate always, every step is a round; the default gate
    falls back to plain steps (probing now and then), with plain decoding's tokens either way."""
    _, model = huginn

    class Wrong:
        def propose(self, context, k):
            return [(context[-1] + 1 + i) % 97 for i in range(k)]

    want = plain(model, PROMPT, 40, loops=4)
    always = plain(model, PROMPT, 40, loops=4, proposer=Wrong(), gate="always")
    auto = plain(model, PROMPT, 40, loops=4, proposer=Wrong())
    assert always.tokens == auto.tokens == want.tokens
    assert always.stats.rounds == 39 and always.stats.accepted == 0
    assert auto.stats.rounds < 10 and auto.stats.gate_report["transitions"] >= 1


def test_forced_rejections_and_the_kv_capacity(huginn):
    """A proposer that is always wrong, and shallow self-drafts (rejected often), up to the last
    position the KV holds: the rejected rows' KV past n is rewritten before it is read."""
    _, model = huginn

    class Wrong:
        def __init__(self, vocab):
            self.vocab = vocab

        def propose(self, context, k):
            return [(context[-1] + 1 + i) % self.vocab for i in range(k)]

    prompt = list(range(5, 5 + MAX_LENGTH - 10))
    want = plain(model, prompt, 50, loops=32, state_seed=2)
    assert len(want.tokens) == 11  # the capacity ends it
    wrong = plain(model, prompt, 50, loops=32, state_seed=2, proposer=Wrong(model.config.vocab_size))
    shallow = plain(model, prompt, 50, loops=32, state_seed=2, speculative="self", draft_loops=1)
    for got in (wrong, shallow):
        assert got.tokens == want.tokens and got.finish_reason == "length"
        assert got.stats.accepted < got.stats.proposed
    assert wrong.stats.speculative == "custom"


def test_the_tie_guard_counts_and_its_tolerant_mode_says_so(huginn):
    """Strict by default (the tokens above); the non-default tolerant mode accepts near ties and
    then reports that its tokens are not plain greedy's."""
    from loopcast.ort_runtime.decoding.greedy_accept import TieGuard

    _, model = huginn
    options = dict(loops=32, speculative="self", draft_loops=1, gate="always")
    strict = plain(model, PROMPT, 30, tie_guard=TieGuard(epsilon=0.5), **options)
    tolerant = plain(model, PROMPT, 30, tie_guard=TieGuard(epsilon=0.5, tolerant=True), **options)
    assert strict.tokens == plain(model, PROMPT, 30, loops=32).tokens and strict.stats.exact_greedy
    assert strict.stats.near_tie_rejections > 0
    assert tolerant.stats.tolerant_accepts > 0 and not tolerant.stats.exact_greedy


def test_a_generator_continues_its_prefix(huginn):
    _, model = huginn
    whole = plain(model, PROMPT + [60, 61], 6, loops=4)
    gen = model.new_generator()
    list(model.stream_ids(PROMPT, 1, generator=gen, loops=4, stop_ids=()))  # leaves PROMPT committed
    assert gen.n == len(PROMPT) and gen.tokens == PROMPT
    rest = model.generate([60, 61], 6, generator=gen, loops=4, stop_ids=(), speculative="self")
    assert rest.tokens == whole.tokens


def test_a_continuation_never_reads_steps_its_prefix_did_not_run(huginn):
    _, model = huginn
    gen = model.new_generator()
    list(model.stream_ids(PROMPT, 1, generator=gen, loops=4, stop_ids=()))
    with pytest.raises(RequestError, match=r"loops=8 would read core steps .* hold 4") as info:
        list(model.stream_ids([60], 2, generator=gen, loops=8, stop_ids=()))
    assert info.value.parameter == "loops" and gen.n == len(PROMPT)
    assert len(list(model.stream_ids([60], 2, generator=gen, loops=2, stop_ids=()))) == 2
    gen.rewind(0)  # a reset may run any depth again
    assert len(list(model.stream_ids(PROMPT, 2, generator=gen, loops=32, stop_ids=()))) == 2


def test_seeded_sampling_replays_and_follows_the_plain_loop(huginn):
    _, model = huginn
    sampling = SamplingParams(temperature=0.9, top_p=0.95, seed=11)
    a = plain(model, PROMPT, 10, loops=4, sampling=sampling, kl_threshold=0.3)
    b = plain(model, PROMPT, 10, loops=4, sampling=sampling, kl_threshold=0.3)
    assert a.tokens == b.tokens
    # the same draws by hand: each call's last row through the project's sampling, one stream
    gen, rng, want = RecurrentGenerator(model.loaded, loops=4), make_rng(sampling), []
    out = gen.step(PROMPT, kl_exit=KLExit(0.3))
    while len(want) < 10:
        want.append(sample(probabilities(out.logits[-1], sampling, gen.tokens), rng))
        out = gen.step([want[-1]], kl_exit=KLExit(0.3))
    assert a.tokens == want and min(a.stats.exit_histogram) < 4
    assert plain(model, PROMPT, 10, loops=4, sampling=SamplingParams(temperature=0.9, seed=12)).tokens != (
        a.tokens
    )


class Repeat:
    """Drafts the last token again (a deterministic proposer: the rejection rule's q is one-hot)."""

    def propose(self, context, k):
        return [context[-1]] * k


@pytest.mark.parametrize("mode", ["self", "custom"])
def test_sampled_speculation_keeps_the_distribution(huginn, mode):
    """The second token (drawn in the first speculative round) over many seeds against its exact
    marginal under plain sampling, Σ_t1 p(t1) p(t2 | t1), computed from the generator's rows."""
    _, model = huginn
    params = dict(temperature=1.0, top_k=3)
    gen = RecurrentGenerator(model.loaded, loops=4)
    processed = SamplingParams(**params, seed=0)
    first = gen.step(PROMPT)
    p1 = probabilities(first.logits[-1], processed, gen.tokens)
    exact: dict[int, float] = {}
    for t1 in map(int, p1.nonzero()[0]):
        gen.rewind(len(PROMPT))
        p2 = probabilities(gen.step([t1]).logits[-1], processed, gen.tokens)
        for t2 in map(int, p2.nonzero()[0]):
            exact[t2] = exact.get(t2, 0.0) + float(p1[t1] * p2[t2])
    runs = 400
    options = dict(speculative="self", draft_loops=1) if mode == "self" else dict(proposer=Repeat())
    counts: dict[int, int] = {}
    rounds = 0
    for seed in range(runs):
        got = plain(model, PROMPT, 2, loops=4, sampling=SamplingParams(**params, seed=seed), **options)
        counts[got.tokens[1]] = counts.get(got.tokens[1], 0) + 1
        rounds += got.stats.rounds
    assert rounds == runs  # every second token came from a speculative round
    support = set(exact) | set(counts)
    tv = 0.5 * sum(abs(counts.get(t, 0) / runs - exact.get(t, 0.0)) for t in support)
    assert tv < 0.12, (tv, counts, exact)


@pytest.mark.parametrize(
    "options, needle, parameter",
    [
        (dict(loops=33), r"loops must be an integer in 1\.\.32 \(the artifact's max_recurrence\)", "loops"),
        (
            dict(speculative="pipeline", kl_threshold=0.1, kv_policy="last-exited"),
            "kv_policy 'full'",
            "kv_policy",
        ),
        (dict(speculative="pipeline", num_draft_tokens=2), "one token per lane", "num_draft_tokens"),
        (dict(exit_threshold=0.5), "kl_threshold", "exit_threshold"),
        (
            dict(kl_threshold=0.1, kv_policy="last-exited", speculative="self"),
            "kv_policy 'full'",
            "kv_policy",
        ),
        (dict(speculative="self", loops=4, draft_loops=4), r"draft_loops must be in 1\.\.3", "draft_loops"),
        (dict(speculative="self", loops=1), "loops >= 2", "loops"),
        (dict(draft_loops=2), "goes with speculative='self'", "draft_loops"),
        (dict(min_loops=2), "kl_threshold", "min_loops"),
    ],
)
def test_what_the_family_refuses_is_named(huginn, options, needle, parameter):
    _, model = huginn
    with pytest.raises(RequestError, match=needle) as info:
        model.generate(PROMPT, 4, **options)
    assert info.value.parameter == parameter


def test_the_cli_takes_loops_and_the_draft_depth(huginn):
    _, model = huginn
    path = str(model.loaded.path)
    base = ["generate", path, "--prompt-ids", "3,17,42,8", "--max-new-tokens", "6", "--json"]
    runner = CliRunner()
    plain_run = runner.invoke(main, [*base, "--loops", "8", "--state-seed", "1"])
    spec_run = runner.invoke(
        main, [*base, "--loops", "8", "--state-seed", "1", "--speculative", "self", "--draft-depth", "2"]
    )
    assert plain_run.exit_code == 0 and spec_run.exit_code == 0, (plain_run.output, spec_run.output)
    want = plain(model, PROMPT, 6, loops=8, state_seed=1).tokens
    assert json.loads(plain_run.stdout)["tokens"] == want == json.loads(spec_run.stdout)["tokens"]
    too_deep = runner.invoke(main, [*base, "--loops", "33"])
    assert too_deep.exit_code == 2 and too_deep.stdout == ""
    assert too_deep.stderr.strip().splitlines() == [
        "error: --loops must be an integer in 1..32 (the artifact's max_recurrence), got 33"
    ]
    deep_draft = runner.invoke(main, [*base, "--loops", "4", "--speculative", "self", "--draft-depth", "4"])
    assert deep_draft.exit_code == 2 and "--draft-depth must be in 1..3" in deep_draft.stderr


def test_the_torch_backend_takes_the_same_options(huginn):
    """``--backend torch`` on the checkpoint: the reference at the same r, KL exit and seed."""
    ckpt, model = huginn
    flags = ["--loops", "32", "--kl-threshold", "0.15", "--state-seed", "3"]
    ids = ["--prompt-ids", "3,17,42,8", "--max-new-tokens", "6", "--json"]
    run = CliRunner().invoke(main, ["generate", str(ckpt), "--backend", "torch", *ids, *flags])
    assert run.exit_code == 0, run.output
    want = plain(model, PROMPT, 6, loops=32, kl_threshold=0.15, state_seed=3).tokens
    assert json.loads(run.stdout)["tokens"] == want


def test_kv_sharing_through_load_the_cli_and_the_torch_backend(huginn):
    """``load(..., kv_sharing=)`` and ``--kv-sharing``: every generator of the model shares its
    core slots as the release's lookup does; the tokens are the reference's under the same
    sharing (on the checkpoint, and via ``--backend torch``), not a slot per step's; bad names,
    a looped artifact and the KL exit are refused by name."""
    from loopcast.kv_sharing import parse_sharing

    ckpt, model = huginn
    shared = load(model.loaded.path, kv_sharing="compress-s3")
    got = shared.generate(PROMPT, 8, loops=8, state_seed=3, stop_ids=())
    assert len(shared.new_generator().kv) == 3 + 4  # 3 core slots, then the prelude's and coda's
    reference = load_checkpoint(ckpt, dtype=torch.float32)
    want, _ = greedy_generate(reference, PROMPT, 8, loops=8, seed=3, sharing=parse_sharing("compress-s3"))
    assert got.tokens == want != plain(model, PROMPT, 8, loops=8, state_seed=3).tokens
    base = ["generate", "--prompt-ids", "3,17,42,8", "--max-new-tokens", "8", "--json", "--loops", "8"]
    flags = ["--state-seed", "3", "--kv-sharing", "compress-s3"]
    runner = CliRunner()
    for path, extra in ((str(model.loaded.path), []), (str(ckpt), ["--backend", "torch"])):
        run = runner.invoke(main, [base[0], path, *base[1:], *flags, *extra])
        assert run.exit_code == 0, run.output
        assert json.loads(run.stdout)["tokens"] == want, extra
    bad = runner.invoke(main, [base[0], str(model.loaded.path), *base[1:], "--kv-sharing", "latest-m4"])
    assert bad.exit_code == 2 and bad.stderr.startswith("error: --kv-sharing must be None, 'compress-s<c>'")
    with pytest.raises(RequestError, match="kv_sharing must be None"):
        shared.generate(PROMPT, 4, kl_threshold=0.3)
    with pytest.raises(RequestError, match="speculation needs a KV slot per"):
        shared.generate(PROMPT, 4, speculative="prompt-lookup")
    from tests.artifacts import artifact

    with pytest.raises(RequestError, match="recurrent-depth .*family's; a looped artifact"):
        load(artifact("demo"), kv_sharing="compress-s4")


def test_loopcast_bench_runs_the_batch_invariant_variant(huginn, tmp_path):
    """``loopcast bench --variant batch-invariant`` on a recurrent-depth checkpoint exports the
    row-invariant op set (tests/bench/test_bench.py checks the report's rows)."""
    ckpt, _ = huginn
    out = tmp_path / "r.json"
    work = ["--work-dir", str(tmp_path / "w"), "--out", str(out), "--no-torch", "--no-profile"]
    flags = ["--loops", "4", "--oracle-reject", "0", "--iters", "2", "--new-tokens", "8"]
    flags += ["--kl-threshold", "0.3"]
    run = CliRunner().invoke(
        main,
        ["bench", str(ckpt), "--device", "cpu", "--variant", "batch-invariant", "--alternate-tokens", "0"]
        + flags
        + work,
    )
    assert run.exit_code == 0, run.output
    (report,) = json.loads(out.read_text())["runs"]
    assert report["variant"] == "batch-invariant" and report["loops"] == 4
    assert report["rows_identical"]["max_abs_diff"] == 0.0
    assert all(e["divergent_prompts"] == 0 for e in report["end_to_end"].values())
    rows = report["end_to_end"]  # the KL-exit rows: plain at the exit, the pipeline's against it
    assert rows["plain KL"]["mean_loops"] < 4 and "pipeline KL oracle 100% (x plain KL)" in rows


def test_the_servers_one_request_engine_takes_loops(huginn):
    _, model = huginn
    engine = SequentialEngine(model)
    engine.start()
    try:
        for loops, kl in ((1, None), (32, None), (32, 0.3)):
            config = model.generation_config(None, loops=loops, kl_threshold=kl, state_seed=4)
            done = engine.submit(BatchRequest(PROMPT, 6, config=config)).result(timeout=60)
            assert done == plain(model, PROMPT, 6, loops=loops, kl_threshold=kl, state_seed=4).tokens
    finally:
        engine.shutdown()


@pytest.mark.parametrize(
    "options, parameter",
    [
        (dict(kl_threshold=0.1), "kl_threshold"),
        (dict(state_seed=1), "state_seed"),
        (dict(draft_loops=1), "draft_loops"),
    ],
)
def test_a_looped_artifact_refuses_the_recurrent_options(options, parameter):
    from tests.artifacts import artifact

    model = load(artifact("ouro-r3"))
    assert model.decoding.family == "looped"
    with pytest.raises(RequestError, match=parameter) as info:
        model.generate([1, 2, 3], 2, **options)
    assert info.value.parameter == parameter


def test_the_server_takes_loops_in_the_request_body(huginn):
    """``loopcast serve``'s request fields reach the one-request engine: r, the KL exit and the
    seed per request; above the maximum a 400 naming ``loops``."""
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    httpx = pytest.importorskip("httpx")
    from loopcast.serve.state import ServeOptions, open_serving

    from tests.serve.helpers import running_server

    _, model = huginn
    state = open_serving(model.loaded.path, ServeOptions(model_name="h"))
    # greedy and past any EOS: an unseeded sampled answer (the API's default temperature 1) could
    # end early at random
    body = {"model": "h", "prompt": PROMPT, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    with running_server(state) as url:
        ok = httpx.post(f"{url}/v1/completions", json={**body, "loops": 32, "kl_threshold": 0.3}, timeout=60)
        bad = httpx.post(f"{url}/v1/completions", json={**body, "loops": 33}, timeout=60)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 6
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "loops"
    assert "1..32 (the artifact's max_recurrence)" in bad.json()["error"]["message"]


def test_the_servers_one_request_engine_speculates_on_the_family_modes(huginn):
    """The family declares its modes (prompt lookup, self and, with its recurrent_cycle graph, the
    pipeline), and a speculative request through the one-request engine gives plain decoding's tokens."""
    _, model = huginn
    engine = SequentialEngine(model)
    assert engine.speculative_modes == ("none", "prompt-lookup", "self", "pipeline")
    engine.start()
    try:
        config = model.generation_config(None, loops=8, state_seed=3)
        want = plain(model, PROMPT, 8, loops=8, state_seed=3).tokens
        for mode in ("prompt-lookup", "self", "pipeline"):
            done = engine.submit(BatchRequest(PROMPT, 8, speculative=mode, config=config)).result(timeout=60)
            assert done == want, mode
    finally:
        engine.shutdown()
