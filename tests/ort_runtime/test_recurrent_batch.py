"""Batched recurrent-depth (Huginn) decoding: prelude_batch, core_step_batch and coda_batch
(``export --max-batch``) under the batching engine and the server, fp32 on the CPU.

Every row of a batched step is the one-sequence step of its request bit for bit (logits equal),
whatever the other rows' depths, seeds and states; the engine gives each request the tokens it
gets alone, with requests joining, leaving and queueing, sampled or greedy, up to the KV
capacity; what it does not serve is refused by name."""

from __future__ import annotations

import json

import numpy as np
import pytest

from loopcast.errors import ArtifactError, RequestError

pytest.importorskip("torch")

from loopcast.ort_runtime.api import load  # noqa: E402
from loopcast.ort_runtime.batching.engine import BatchingEngine, BatchRequest  # noqa: E402
from loopcast.ort_runtime.binding.recurrent_batch_generator import RecurrentBatchGenerator  # noqa: E402
from loopcast.ort_runtime.binding.recurrent_generator import RecurrentGenerator  # noqa: E402
from loopcast.ort_runtime.decoding.sampling import SamplingParams  # noqa: E402
from loopcast.ort_runtime.loading.describe import describe_artifact  # noqa: E402

from tests.artifacts import huginn as tiny_huginn  # noqa: E402

MAX_LENGTH = 48
SLOTS = 4


@pytest.fixture(scope="module")
def batched():
    _, art = tiny_huginn(MAX_LENGTH, max_batch=SLOTS)
    return load(art)


def alone(model, prompt, n, *, loops=None, state_seed=None, sampling=None, stop_ids=(), kl_threshold=None):
    """The request alone: the one-sequence engine's plain tokens (no stop ids unless given)."""
    config = model.generation_config(None, loops=loops, state_seed=state_seed, kl_threshold=kl_threshold)
    return list(model.stream_ids(prompt, n, config=config, stop_ids=stop_ids, sampling=sampling))


def test_the_batched_kinds_are_in_the_manifest_and_inspect(batched):
    manifest = json.loads((batched.loaded.path / "manifest.json").read_text())
    graphs = manifest["graphs"]
    assert {"prelude_batch", "core_step_batch", "coda_batch"} <= set(graphs)
    assert manifest["max_batch"] == SLOTS
    assert all(graphs[k]["rows"] is None for k in ("prelude_batch", "core_step_batch", "coda_batch"))
    assert graphs["core_step_batch"]["kv_slots"] == graphs["core_step"]["kv_slots"]  # step 0's names
    assert "active_B" in graphs["core_step_batch"]["inputs"]
    text = describe_artifact(batched.loaded.path)
    assert "core_step_batch" in text and "up to r times, each sequence at its own r" in text
    assert f"max batch       {SLOTS} sequences" in text


def test_batched_rows_are_one_sequence_rows_bit_for_bit(batched):
    check_batched_rows(batched.loaded)


def check_batched_rows(loaded) -> None:
    """Slots at depths 4, 32 and 1 (seeded and zero states) with a free slot between them, and a
    prompt prefilled in two chunks while the others decode: every row's logits equal its
    request's one-sequence step's, at every step (tests/ort_runtime/test_recurrent_cuda.py runs
    it on CUDA)."""
    gen = RecurrentBatchGenerator(loaded)
    requests = {  # slot -> (prompt, loops, seed)
        0: ([3, 17, 42, 8], 4, None),
        2: ([5, 6, 7], 32, 5),
        3: ([9, 9, 1, 2, 3], 1, 2),
    }
    singles, pending = {}, {}
    for slot, (prompt, loops, seed) in requests.items():
        gen.begin(slot, 0, {"loops": loops, "state_seed": seed})
        token, logits = gen.prefill(slot, prompt, want_logits=True)
        single = singles[slot] = RecurrentGenerator(loaded, loops=loops, state_seed=seed)
        out = single.step(prompt)
        assert token == int(out.next_ids[-1]) and np.array_equal(logits, out.logits[-1])
        pending[slot] = token
    late_prompt, late_single = [11, 12, 13, 14, 15, 16], RecurrentGenerator(loaded, loops=8, state_seed=1)
    gen.begin(1, 0, {"loops": 8, "state_seed": 1})
    gen.prefill(1, late_prompt[:4])  # slot 1 is mid-prompt: a dummy row at its length
    for step in range(6):
        if step == 2:  # its last chunk, then it decodes with the others
            token, _ = gen.prefill(1, late_prompt[4:], start=4)
            out = late_single.step(late_prompt)
            assert token == int(out.next_ids[-1])
            singles[1], pending[1] = late_single, token
        out = gen.decode(dict(pending), want_logits=True)
        for slot, token in pending.items():
            want = singles[slot].step([token])
            diff = float(np.abs(out.logits[slot] - want.logits[-1]).max())
            assert np.array_equal(out.logits[slot], want.logits[-1]), (
                f"step {step} slot {slot}: max |diff| {diff}"
            )
            assert out.next_ids[slot] == int(want.next_ids[-1]), (step, slot)
        pending = dict(out.next_ids)
    assert gen.lengths[:SLOTS] == [s.n for s in (singles[0], singles[1], singles[2], singles[3])]


def serve_cases(engine, model, cases, want):
    """Submit every (prompt, max tokens, options, mode) case to the started ``engine``, wait,
    shut it down, and check each request's tokens against ``want`` (naming the first token that
    differs); returns the completions."""
    try:
        done = []
        for prompt, n, options, mode in cases:
            stop_ids = options.pop("stop_ids", ())
            config = model.generation_config(None, **options)
            done.append(
                engine.submit(BatchRequest(prompt, n, stop_ids=stop_ids, speculative=mode, config=config))
            )
        got = [completion.result(timeout=120) for completion in done]
    finally:
        engine.shutdown()
    for g, w in zip(got, want, strict=True):
        first = next((i for i, (a, b) in enumerate(zip(g, w)) if a != b), None)
        assert g == w, f"first differing token at {first}"
    return done


def test_verify_rows_are_one_sequence_rows_bit_for_bit(batched):
    check_verify_rows(batched.loaded)


@pytest.mark.parametrize("ops", ["stock", "loopcast"])
def test_every_op_set_gives_one_sequence_rows(ops):
    """The batched kinds of the stock ops and of the row-invariant loopcast op set (their tied
    heads are built differently) give the one-sequence rows in decode steps, and the loopcast
    ones in verify steps (stock attention takes several rows a sequence only alone)."""
    _, art = tiny_huginn(MAX_LENGTH, ops=ops, max_batch=SLOTS)
    loaded = load(art).loaded
    check_batched_rows(loaded)
    gen = RecurrentBatchGenerator(loaded)
    if ops == "stock":
        assert gen.verify_width is None
        with pytest.raises(RequestError, match="loopcast attention"):
            gen.verify({0: [1, 2]})
        assert BatchingEngine(gen).speculation is None  # prompt lookup: plain rows, said per request
    else:
        check_verify_rows(loaded)


def check_verify_rows(loaded) -> None:
    """A verify step over three slots at depths 4, 32 and 1 with 4, 2 and 0 drafts (the call's
    rows are the most given: the others' padded): each given row's logits are its request's
    one-row step's at that position; committing some rows (``advance``) and decoding on gives
    the one-sequence rows still."""
    gen = RecurrentBatchGenerator(loaded)
    requests = {0: ([3, 17, 42, 8], 4, None), 1: ([5, 6, 7], 32, 5), 3: ([9, 9, 1], 1, 2)}
    drafts = {0: 4, 1: 2, 3: 0}
    given, singles, want = {}, {}, {}
    for slot, (prompt, loops, seed) in requests.items():
        gen.begin(slot, 0, {"loops": loops, "state_seed": seed})
        first, _ = gen.prefill(slot, prompt)
        single = singles[slot] = RecurrentGenerator(loaded, loops=loops, state_seed=seed)
        single.step(prompt)
        rows, token = [], first  # the plain continuation: one-row steps
        for _ in range(drafts[slot] + 1):
            out = single.step([token])
            rows.append(out.logits[-1])
            token = int(out.next_ids[-1])
        given[slot] = [first] + [int(np.argmax(r)) for r in rows[:-1]]  # drafts that all hit
        want[slot] = rows
        single.rewind(len(prompt))
    targets, logits = gen.verify(given, want_logits=True)
    for slot in requests:
        assert len(targets[slot]) == len(given[slot])
        for i, row in enumerate(want[slot]):
            assert np.array_equal(logits[slot][i], row), (slot, i)
    # commit 2 rows of slot 0, all of slot 1, 1 of slot 3; then a decode step at the new lengths
    for slot, count in {0: 2, 1: 3, 3: 1}.items():
        gen.advance(slot, count)
        singles[slot].step(given[slot][:count])
    pending = {
        slot: given[slot][count] if count < len(given[slot]) else targets[slot][-1]
        for slot, count in {0: 2, 1: 3, 3: 1}.items()
    }
    out = gen.decode(pending, want_logits=True)
    for slot, token in pending.items():
        assert np.array_equal(out.logits[slot], singles[slot].step([token]).logits[-1]), slot
    with pytest.raises(RequestError, match="verify takes 1..5 rows"):
        gen.verify({0: [1] * 6})


def test_prompt_lookup_in_the_batch_gives_plain_tokens(batched):
    """Prompt-lookup requests verified in the batch (every step with drafts verified: the always
    gate), beside plain ones, at their own depths and seeds, one stopping on a stop id that a
    verify step proposes and one at the KV capacity: each request's tokens are its plain tokens
    alone, at the first step they could differ."""
    from loopcast.ort_runtime.batching.batch_gate import AlwaysBatchGate

    model = batched
    loop = [5, 9, 11, 5, 9, 11, 5, 9]  # repeats itself: prompt lookup has n-grams to draft from
    cases = [
        (loop, 14, dict(loops=4), "prompt-lookup"),
        (loop[:5], 12, dict(loops=32, state_seed=3), "prompt-lookup"),
        ([3, 17, 42, 8], 10, dict(loops=1), "none"),
        (loop * 5, 20, dict(loops=8), "prompt-lookup"),  # 40 tokens: the capacity after 9 more
    ]
    want = [alone(model, p, n, **o) for p, n, o, _ in cases]
    stop = want[0][6]  # a stop id inside the first request's continuation
    cases.append((loop, 14, dict(loops=4, stop_ids=(stop,)), "prompt-lookup"))
    want.append(alone(model, loop, 14, loops=4, stop_ids=(stop,)))
    engine = BatchingEngine(RecurrentBatchGenerator(model.loaded), gate=AlwaysBatchGate()).start()
    done = serve_cases(engine, model, cases, want)
    assert done[-1].finish_reason == "eos" and done[-2].finish_reason == "length"
    assert engine.stats["verify_steps"] > 0 and engine.stats["accepted"] > 0
    assert all(c.speculative == "prompt-lookup" for c, case in zip(done, cases) if case[3] != "none")


@pytest.mark.parametrize("spoil", [None, 3, 1])
def test_self_speculation_in_the_batch_gives_plain_tokens(batched, spoil):
    """Self-speculating requests (drafts at fewer core steps, verified in the batch at their own
    r), beside prompt-lookup and plain ones, every round taken (the always gate); ``spoil``: every
    spoil-th drafted token replaced by a wrong one (forced rejections; 1: every draft). One
    request stops on a stop id its drafts run into, one reaches the KV capacity. Each request's
    tokens are its plain tokens alone, at the first step they could differ."""
    from loopcast.ort_runtime.batching.batch_gate import AlwaysBatchGate

    model = batched
    cases = [
        ([3, 17, 42, 8], 14, dict(loops=8), "self"),  # draft_loops 2 (a quarter)
        ([5, 6, 7], 12, dict(loops=32, state_seed=3, draft_loops=4), "self"),
        ([5, 9, 11, 5, 9, 11], 10, dict(loops=4), "prompt-lookup"),
        (list(range(3, 43)), 20, dict(loops=4, draft_loops=3), "self"),  # the capacity after 9 more
    ]
    want = [alone(model, p, n, loops=o["loops"], state_seed=o.get("state_seed")) for p, n, o, _ in cases]
    stop = want[0][5]
    cases.append(([3, 17, 42, 8], 14, dict(loops=8, stop_ids=(stop,)), "self"))
    want.append(alone(model, [3, 17, 42, 8], 14, loops=8, stop_ids=(stop,)))
    seen = [0]

    def perturb(sequence, token):
        seen[0] += 1
        return (token + 1) % model.loaded.config.vocab_size if spoil and seen[0] % spoil == 0 else token

    engine = BatchingEngine(
        RecurrentBatchGenerator(model.loaded), gate=AlwaysBatchGate(), self_perturb=perturb
    )
    assert engine.self_speculation == "on"
    engine.start()
    done = serve_cases(engine, model, cases, want)
    assert done[-1].finish_reason == "eos" and done[-2].finish_reason == "length"
    assert engine.stats["self_rounds"] > 0 and engine.stats["proposed"] > 0
    if spoil is None:
        assert done[1].accepted > 0  # r = 32 drafted at 4 core steps: the drafts hit
    if spoil == 1:
        assert all(c.accepted == 0 for c, case in zip(done, cases) if case[3] == "self")
    assert all(c.speculative == case[3] for c, case in zip(done, cases))


def test_kl_exit_rows_are_one_sequence_rows_bit_for_bit(batched):
    """Decode steps with KL-exit rows (full and last-exited, their own thresholds and min_loops)
    beside plain rows at other depths: every row's logits equal its request's one-sequence step
    with the same exit, and the rows exit where alone they do (the skipped steps' KV filled by
    each policy, so the later steps agree too)."""
    from loopcast.kl_exit import KLExit

    loaded = batched.loaded
    gen = RecurrentBatchGenerator(loaded)
    requests = {  # slot -> (prompt, loops, seed, KL exit)
        0: ([3, 17, 42, 8], 32, 7, KLExit(0.3, 1, "full")),
        1: ([5, 6, 7], 4, None, None),
        2: ([9, 1, 2], 32, None, KLExit(0.05, 3, "last-exited")),
        3: ([11, 12], 8, 2, KLExit(1e9, 2, "full")),  # exits at its min_loops
    }
    singles, pending, exits = {}, {}, []
    for slot, (prompt, loops, seed, kl) in requests.items():
        options = {"loops": loops, "state_seed": seed}
        if kl is not None:
            options |= {"kl_threshold": kl.threshold, "min_loops": kl.min_loops, "kv_policy": kl.kv_policy}
        gen.begin(slot, 0, options)
        token, logits = gen.prefill(slot, prompt, want_logits=True)
        single = singles[slot] = RecurrentGenerator(loaded, loops=loops, state_seed=seed)
        out = single.step(prompt, kl_exit=kl)
        assert token == int(out.next_ids[-1]) and np.array_equal(logits, out.logits[-1]), slot
        pending[slot] = token
    for step in range(6):
        out = gen.decode(dict(pending), want_logits=True)
        for slot, token in pending.items():
            want = singles[slot].step([token], kl_exit=requests[slot][3])
            exits.append((slot, want.exit_loops))
            assert np.array_equal(out.logits[slot], want.logits[-1]), f"step {step} slot {slot}"
        pending = dict(out.next_ids)
    early = {slot for slot, e in exits if e < requests[slot][1]}
    assert {0, 2, 3} <= early  # every KL row exited before its r at least once


def test_kl_exit_verify_rows_are_one_sequence_rows_bit_for_bit(batched):
    check_kl_verify_rows(batched.loaded)


def check_kl_verify_rows(loaded) -> None:
    """A verify step over KL-exit slots (their own thresholds, min_loops and r, one with
    min_loops = r) beside a plain one: each given row's logits are the one-sequence verify's with
    the same KL exit (each row's coda after each checked step until its exit, rows in order), the
    rows exit where alone they do, and after committing some rows the next decode step's rows
    agree too (the coda KV holds each committed row's exit)."""
    from loopcast.kl_exit import KLExit

    gen = RecurrentBatchGenerator(loaded)
    requests = {  # slot -> (prompt, loops, seed, KL exit, rows given)
        0: ([3, 17, 42, 8], 32, 7, KLExit(0.3, 1, "full"), 5),
        1: ([5, 6, 7], 4, None, None, 3),
        2: ([9, 1, 2], 32, None, KLExit(0.15, 3, "full"), 4),
        3: ([11, 12], 8, 2, KLExit(0.3, 8, "full"), 2),  # min_loops = r: only step r is checked
    }
    given, singles, want, want_exits = {}, {}, {}, {}
    for slot, (prompt, loops, seed, kl, m) in requests.items():
        options = {"loops": loops, "state_seed": seed, "speculative": "prompt-lookup"}
        if kl is not None:
            options |= {"kl_threshold": kl.threshold, "min_loops": kl.min_loops, "kv_policy": kl.kv_policy}
        gen.begin(slot, 0, options)
        first, _ = gen.prefill(slot, prompt)
        single = singles[slot] = RecurrentGenerator(loaded, loops=loops, state_seed=seed)
        single.step(prompt, kl_exit=kl)
        given[slot] = [first, *[(first + 3 * i) % loaded.config.vocab_size for i in range(1, m)]]
        out = single.verify(given[slot], kl) if kl is not None else single.step(given[slot])
        want[slot], want_exits[slot] = out.logits, out.row_exits
        single.rewind(len(prompt))
    targets, logits = gen.verify(given, want_logits=True)
    for slot in requests:
        for i, row in enumerate(want[slot]):
            assert np.array_equal(logits[slot][i], row), (slot, i)
    assert {e for s in (0, 2) for e in want_exits[s]} - {32}  # rows exit early: the check has teeth
    commit = {0: 3, 1: 3, 2: 1, 3: 2}
    for slot, count in commit.items():
        gen.advance(slot, count)
        kl = requests[slot][3]  # the accepted rows alone: a verify of them (each row its own exit)
        singles[slot].verify(given[slot][:count], kl) if kl else singles[slot].step(given[slot][:count])
    pending = {s: targets[s][c - 1] for s, c in commit.items()}
    out = gen.decode(pending, want_logits=True)
    for slot, token in pending.items():
        alone_step = singles[slot].step([token], kl_exit=requests[slot][3])
        assert np.array_equal(out.logits[slot], alone_step.logits[-1]), slot


def test_kl_exit_requests_speculate_in_the_batch(batched):
    """KL-exit requests with prompt lookup and self-speculation in the batch (every round taken,
    some drafts forced wrong) beside plain and plain KL ones: each request's tokens and the
    step each token left at are its own alone."""
    from loopcast.ort_runtime.batching.batch_gate import AlwaysBatchGate

    model = batched
    loop = [5, 9, 11, 5, 9, 11, 5, 9]
    cases = [
        (loop, 12, dict(loops=32, kl_threshold=0.3), "prompt-lookup"),
        ([3, 17, 42, 8], 10, dict(loops=8, kl_threshold=0.15, min_loops=2, state_seed=3), "self"),
        ([9, 1, 2], 10, dict(loops=4), "prompt-lookup"),
        (loop[:5], 10, dict(loops=32, kl_threshold=0.3, state_seed=1), "none"),
    ]
    want, depth = [], []
    for prompt, n, options, _ in cases:
        alone_run = model.generate(prompt, n, config=model.generation_config(None, **options), stop_ids=())
        want.append(alone_run.tokens)
        depth.append({k: getattr(alone_run.stats, k) for k in ("exit_histogram", "mean_loops", "kv_policy")})
    seen = [0]

    def perturb(sequence, token):
        seen[0] += 1
        return (token + 1) % model.loaded.config.vocab_size if seen[0] % 3 == 0 else token

    engine = BatchingEngine(
        RecurrentBatchGenerator(model.loaded), gate=AlwaysBatchGate(), self_perturb=perturb
    ).start()
    done = serve_cases(engine, model, [(p, n, dict(o), m) for p, n, o, m in cases], want)
    assert [c.depth for c in done] == depth
    stats = (engine.stats, [(c.speculative, c.proposed, c.accepted) for c in done])
    # prompt lookup's drafts verified in the rounds beside self's, some of the drafts rejected
    assert engine.stats["self_rounds"] > 0, stats
    assert done[0].proposed > 0 and 0 < done[1].accepted < done[1].proposed, stats


def test_kl_exit_requests_in_the_batch_get_their_tokens_alone(batched):
    """KL-exit requests (both KV policies) beside plain ones through the engine, a prompt longer
    than the prefill chunk among them (its rows leave together: prefilled in one call), greedy
    and sampled: each request's tokens are its tokens alone."""
    model = batched
    sampled = SamplingParams(temperature=0.8, seed=5)
    cases = [
        (list(range(3, 23)), 10, dict(loops=32, kl_threshold=0.3, state_seed=1)),  # 20 > the chunk
        ([5, 6, 7], 12, dict(loops=8, kl_threshold=0.05, min_loops=3, kv_policy="last-exited")),
        ([9, 1, 2], 12, dict(loops=4)),
        ([11, 12], 9, dict(loops=32, kl_threshold=0.3, kv_policy="last-exited", sampling=sampled)),
        ([4, 4, 4], 8, dict(loops=32, state_seed=2)),
    ]
    want, depth = [], []
    for prompt, n, options in cases:
        config = model.generation_config(None, **{k: v for k, v in options.items() if k != "sampling"})
        alone = model.generate(prompt, n, config=config, stop_ids=(), sampling=options.get("sampling"))
        want.append(alone.tokens)
        depth.append({k: getattr(alone.stats, k) for k in ("exit_histogram", "mean_loops", "kv_policy")})
    assert any(len(d["exit_histogram"]) > 1 for d in depth)  # the exits vary token by token
    engine = BatchingEngine(RecurrentBatchGenerator(model.loaded), prefill_chunk=8).start()
    try:
        done = []
        for prompt, n, options in cases:
            sampling = options.get("sampling")
            config = model.generation_config(None, **{k: v for k, v in options.items() if k != "sampling"})
            done.append(engine.submit(BatchRequest(prompt, n, sampling=sampling, config=config)))
        assert [c.result(timeout=120) for c in done] == want
        assert [c.depth for c in done] == depth  # each token's exit, as the one-request engine reports
    finally:
        engine.shutdown()


def test_the_engine_gives_every_request_its_tokens_alone(batched):
    """Seven requests through four slots (three wait, then join as others finish): mixed depths
    and seeds, one sampled with a seed, one running into the KV capacity ("length" inside the
    batch); each gets the tokens it gets alone."""
    model = batched
    sampled = SamplingParams(temperature=0.8, top_p=0.9, seed=11)
    cases = [
        ([3, 17, 42, 8], 12, dict(loops=4)),
        ([5, 6, 7], 10, dict(loops=8, state_seed=3)),
        ([9] * 6, 15, dict(loops=1)),
        ([11, 12], 9, dict(loops=32, state_seed=7)),
        ([1, 2, 3, 4, 5], 7, dict(loops=2, state_seed=1)),
        ([20, 21], 11, dict(sampling=sampled, loops=4, state_seed=2)),
        (list(range(3, 43)), 20, dict(loops=4)),  # 40 prompt tokens: capacity after 9 more
    ]
    want = [alone(model, prompt, n, **options) for prompt, n, options in cases]  # before the engine runs
    engine = BatchingEngine(RecurrentBatchGenerator(model.loaded)).start()
    try:
        completions = []
        for prompt, n, options in cases:
            sampling = options.pop("sampling", None)
            config = model.generation_config(None, **options)
            completions.append(engine.submit(BatchRequest(prompt, n, sampling=sampling, config=config)))
        assert [completion.result(timeout=120) for completion in completions] == want
        assert completions[-1].finish_reason == "length" and len(completions[-1].tokens) == 9
        assert engine.peak_batch == SLOTS and engine.stats["decode_steps"] > 0
        assert engine.prefix_caching.startswith("off (a recurrent-depth prefix")
    finally:
        engine.shutdown()


def test_what_the_batched_engine_does_not_serve_is_refused_by_name(batched):
    model = batched
    engine = BatchingEngine(RecurrentBatchGenerator(model.loaded)).start()
    try:
        assert engine.speculative_modes == ("none", "prompt-lookup", "self")
        for options, mode, parameter in (
            (dict(kl_threshold=0.3, kv_policy="last-exited"), "prompt-lookup", "kv_policy"),
            (dict(loops=33), "none", "loops"),
            (dict(draft_loops=2), "none", "draft_loops"),  # goes with self
            (dict(loops=4, draft_loops=4), "self", "draft_loops"),  # fewer core steps than loops
            (dict(loops=1), "self", "loops"),  # nothing to draft with
        ):
            config = model.generation_config(None, **options)
            with pytest.raises(RequestError, match=parameter) as info:
                engine.submit(BatchRequest([3, 4], 4, speculative=mode, config=config))
            assert info.value.parameter == parameter
        with pytest.raises(RequestError, match="speculative") as info:
            engine.submit(BatchRequest([3, 4], 4, speculative="pipeline"))
        with pytest.raises(RequestError, match="num_draft_tokens must be in 1..4"):
            config = model.generation_config(None, num_draft_tokens=5)
            engine.submit(BatchRequest([3, 4], 4, speculative="prompt-lookup", config=config))
    finally:
        engine.shutdown()
    with pytest.raises(RequestError, match="max_batch must be in 1..4"):
        RecurrentBatchGenerator(model.loaded, SLOTS + 1)
    with pytest.raises(RequestError, match="prefill_rows"):
        RecurrentBatchGenerator(model.loaded, prefill_rows=16)
    small = RecurrentBatchGenerator(model.loaded, max_loops=3)  # KV for 3 core steps only
    with pytest.raises(RequestError, match=r"1\.\.3 \(max_loops\)"):
        small.begin(0, 0, {"loops": 4})


def test_an_artifact_without_the_batched_kinds_is_named():
    _, art = tiny_huginn(MAX_LENGTH)
    with pytest.raises(ArtifactError, match="export with --max-batch"):
        RecurrentBatchGenerator(load(art).loaded)


def test_the_server_batches_a_recurrent_artifact(batched):
    """``loopcast serve`` on a Huginn artifact exported with --max-batch runs the batching engine;
    concurrent requests with their own loops and state_seed get their tokens alone."""
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    httpx = pytest.importorskip("httpx")
    from concurrent.futures import ThreadPoolExecutor

    from loopcast.serve.state import ServeOptions, open_serving

    from tests.serve.helpers import running_server

    model = batched
    state = open_serving(model.loaded.path, ServeOptions(model_name="h"))
    cases = [([3, 17, 42, 8], {"loops": 32, "state_seed": 4}), ([5, 6, 7], {"loops": 2}), ([9, 8], {})] * 2
    cases.append(([9, 8, 7], {"loops": 32, "kl_threshold": 0.3}))
    with running_server(state) as url:
        assert httpx.get(f"{url}/health", timeout=10).json()["mode"].startswith("batched (up to 4")

        def post(case):
            prompt, extra = case
            body = {"model": "h", "prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
            r = httpx.post(
                f"{url}/v1/completions", json={**body, **extra, "return_token_ids": True}, timeout=60
            )
            return r.status_code, r.json()

        with ThreadPoolExecutor(len(cases)) as pool:
            answers = list(pool.map(post, cases))
        bad = httpx.post(
            f"{url}/v1/completions",
            json={
                "model": "h",
                "prompt": [3],
                "max_tokens": 2,
                "kl_threshold": 0.2,
                "kv_policy": "last-exited",
                "speculative": "prompt-lookup",
            },
            timeout=60,
        )
    for (prompt, extra), (status, body) in zip(cases, answers, strict=True):
        assert status == 200, body
        assert body["choices"][0]["token_ids"] == alone(model, prompt, 6, **extra)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "kv_policy"


def test_the_server_shares_kv_one_request_at_a_time(batched):
    """``serve --kv-sharing``: the one-request engine's generators share their core slots (the
    release's lookup); the batching engine keeps a slot per (step, layer) and refuses it by name."""
    from loopcast.serve.state import ServeOptions, open_serving

    path = batched.loaded.path
    with pytest.raises(RequestError, match="--sequential"):
        open_serving(path, ServeOptions(kv_sharing="compress-s4"))
    with pytest.raises(RequestError, match="kv_sharing must be None"):
        open_serving(path, ServeOptions(kv_sharing="latest-m4", sequential=True))
    state = open_serving(path, ServeOptions(kv_sharing="compress-s4", sequential=True))
    try:
        want = load(path, kv_sharing="compress-s4").generate([3, 17, 42, 8], 6, loops=8, stop_ids=()).tokens
        config = state.model.generation_config(None, loops=8, stop_ids=())
        done = state.engine.submit(BatchRequest([3, 17, 42, 8], 6, config=config)).result(timeout=60)
        assert done == want != alone(batched, [3, 17, 42, 8], 6, loops=8)
    finally:
        state.close()
