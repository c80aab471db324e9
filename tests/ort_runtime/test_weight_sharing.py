"""Fewer copies of the weights on the CPU: decode and verify run on prefill's session (one
prepacked copy for the three kinds) with bit-identical rows; ``share_weights=True`` (no prepacking)
is declared inexact where the stock MatMul's one-row path differs from its multi-row path."""

from __future__ import annotations

import numpy as np
import pytest
from loopcast.ort_runtime import load
from loopcast.ort_runtime.binding.generator import Generator
from loopcast.ort_runtime.decoding.exactness import decode_rows
from loopcast.ort_runtime.loading.artifact import open_artifact

from loopcast.errors import ArtifactError, RequestError
from loopcast.manifest import DECODE, PREFILL, VERIFY
from tests.artifacts import artifact, require_exact_cpu_artifacts


def _decode_logits(model, prompt: list[int], steps: int) -> list[np.ndarray]:
    """Feed the prompt one token at a time through decode, then decode greedily: every row."""
    gen, rows, token = Generator(model), [], prompt[0]
    for i in range(len(prompt) + steps):
        out = gen.run(DECODE, gen.n, tokens=[token])
        rows.append(out.logits[0].copy())
        gen.commit([token])
        token = prompt[i + 1] if i + 1 < len(prompt) else int(out.next_ids[0])
    return rows


@pytest.mark.parametrize(
    "name,kw",
    [("demo", {}), ("llama-untied", {}), ("ouro-r3", {"ops": "stock"}), ("ouro-r2-gqa", {"draft_depth": 1})],
)
def test_decode_and_verify_on_prefill_session_are_bit_identical(name, kw) -> None:
    path = artifact(name, **kw)
    shared = open_artifact(path, "cpu")
    own = open_artifact(path, "cpu", kinds=(DECODE, VERIFY))  # no prefill: each kind its own session
    depths = shared.manifest.exit_depths  # static-depth graphs share their own prefill@k's session
    hosted = {f"{kind}@{k}": f"prefill@{k}" for k in depths for kind in ("decode", "verify")}
    assert shared.shared_sessions == {DECODE: PREFILL, VERIFY: PREFILL, **hosted}
    assert shared.sessions[DECODE] is shared.sessions[PREFILL] is shared.sessions[VERIFY]
    assert len({id(s) for s in shared.sessions.values()}) == len(shared.sessions) - 2 - 2 * len(depths)
    assert own.shared_sessions == {} and own.sessions[DECODE] is not own.sessions[VERIFY]
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    decoded = _decode_logits(shared, prompt, 12)
    for a, b in zip(decoded, _decode_logits(own, prompt, 12), strict=True):
        assert np.array_equal(a, b)
    # verify on prefill's session (prefill fed logit_start = -W) == verify's own graph, and == the
    # decode rows where the artifact declares exact verify (not the stock attention op)
    width = shared.manifest.graphs[VERIFY].rows
    fed = prompt + [int(np.argmax(r)) for r in decoded[len(prompt) - 1 : -1]]
    verified = []
    for model in (shared, own):
        gen, rows = Generator(model), []
        gen.run(DECODE, 0, tokens=[fed[0]])
        gen.commit([fed[0]])
        for start in range(1, len(fed) - width + 1, width):
            out = gen.run(VERIFY, start, tokens=fed[start : start + width])
            assert out.logits.shape[0] == width
            rows += [out.logits[i].copy() for i in range(width)]
            gen.commit(fed[start : start + width])
        verified.append(rows)
    assert all(np.array_equal(a, b) for a, b in zip(*verified, strict=True))
    if shared.exact_verify:
        assert all(np.array_equal(a, b) for a, b in zip(verified[0], decoded[1:], strict=False))


def test_verify_keeps_its_session_on_request() -> None:
    """``share_sessions=("decode",)`` is the layout before verify moved onto prefill's session."""
    model = open_artifact(artifact("demo"), "cpu", share_sessions=(DECODE,))
    assert (
        model.shared_sessions == {DECODE: PREFILL} and model.sessions[VERIFY] is not model.sessions[PREFILL]
    )


def test_generation_unchanged_by_shared_decode() -> None:
    """Plain greedy through the public API equals a run on the decode graph's own session."""
    path = artifact("demo")
    model = open_artifact(path, "cpu", kinds=(DECODE, VERIFY))
    rows = _decode_logits(model, [5, 6, 7], 16)
    greedy = [int(np.argmax(r)) for r in rows[2:]]
    tokens = load(path).generate([5, 6, 7], 16, stop_ids=(), speculative="none").tokens
    assert tokens == greedy[:16]


def test_cuda_keeps_one_session_per_kind() -> None:
    """The sharing is a CPU decision: CUDA captures decode as a graph of its own."""
    from loopcast.ort_runtime.loading.artifact import _cpu_shared_sessions

    from loopcast.manifest import Manifest

    manifest = Manifest.read(artifact("demo"))
    assert _cpu_shared_sessions(manifest, [PREFILL, DECODE, VERIFY]) == {DECODE: PREFILL, VERIFY: PREFILL}
    assert _cpu_shared_sessions(manifest, [DECODE, VERIFY]) == {}


def test_share_weights_declares_stock_matmul_inexact_on_cpu() -> None:
    """Without prepacking MLAS runs M=1 on its GEMV kernel and M=W on GEMM: measured here, the
    rows differ, so speculation is refused unless allowed, and tokens stay plain greedy."""
    require_exact_cpu_artifacts()
    path = artifact("demo")
    plain = load(path)
    shared = load(path, share_weights=True)
    assert plain.loaded.exact_verify and not shared.loaded.exact_verify
    gen = Generator(shared.loaded)
    fed, rows = decode_rows(gen, [5, 6, 7, 8], 5)
    gen.rewind(4)
    out = gen.run(VERIFY, gen.n, tokens=fed)
    assert not all(np.array_equal(out.logits[i], rows[i]) for i in range(5))  # the reason for the declaration
    with pytest.raises(RequestError, match="not exact"):
        shared.generate([5, 6, 7, 5, 6, 7], 8, speculative="prompt-lookup", gate="always")
    assert (
        shared.generate([5, 6, 7], 12, stop_ids=(), speculative="none").tokens
        == plain.generate([5, 6, 7], 12, stop_ids=(), speculative="none").tokens
    )


def test_share_weights_keeps_loopcast_matmul_exact() -> None:
    """The loopcast MatMul never prepacks: its artifacts stay exact with share_weights."""
    require_exact_cpu_artifacts()
    shared = load(artifact("ouro-r3", batch_invariant=True), share_weights=True)
    assert shared.loaded.exact_verify


def test_loopcast_ops_share_one_copy_of_the_weights() -> None:
    """Nothing prepacks in the loopcast op set: every session gets the same weight values
    (ort_runtime/loading/shared_weights.py), and the rows are those of sessions holding their own."""
    path = artifact("ouro-r3", batch_invariant=True)
    shared = open_artifact(path, "cpu")
    own = open_artifact(path, "cpu", shared_initializers=False)
    assert shared.shared_weights is not None and own.shared_weights is None
    assert shared.shared_weights.nbytes > 0.9 * (path / "weights.safetensors").stat().st_size
    prompt = [3, 1, 4, 1, 5, 9]
    for a, b in zip(_decode_logits(shared, prompt, 10), _decode_logits(own, prompt, 10), strict=True):
        assert np.array_equal(a, b)
    tokens = {
        mode: load(path).generate(prompt, 16, stop_ids=(), speculative=mode, gate="always").tokens
        for mode in ("none", "self", "prompt-lookup")
    }
    assert tokens["self"] == tokens["none"] == tokens["prompt-lookup"]


def test_stock_matmul_keeps_its_prepacked_sessions() -> None:
    """A prepacking MatMul would keep the shared mapping besides its packed copy: not shared."""
    assert open_artifact(artifact("demo"), "cpu").shared_weights is None


def test_a_graph_disagreeing_with_the_weights_file_is_refused(tmp_path) -> None:
    """A shared value must be what ORT would have loaded: a graph that declares a stored weight
    with another shape (a kernel would read outside the value) is refused, naming the weight."""
    import hashlib
    import json
    import shutil

    import onnx

    from loopcast.errors import ArtifactError

    path = tmp_path / "art"
    shutil.copytree(artifact("ouro-r3", batch_invariant=True), path)
    model = onnx.load(str(path / "prefill.onnx"), load_external_data=False)
    tensor = next(t for t in model.graph.initializer if len(t.dims) == 2 and t.dims[0] != t.dims[1])
    tensor.dims[:] = [tensor.dims[1], tensor.dims[0]]
    onnx.save(model, str(path / "prefill.onnx"))
    data = (path / "prefill.onnx").read_bytes()
    raw = json.loads((path / "manifest.json").read_text())
    raw["files"]["prefill.onnx"] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (path / "manifest.json").write_text(json.dumps(raw))
    with pytest.raises(ArtifactError, match=f"initializer {tensor.name} is FLOAT"):
        open_artifact(path, "cpu")


def _rewrite_prefill(path, edit) -> None:
    """Apply ``edit`` to the copied artifact's prefill graph and re-sign it in the manifest."""
    import hashlib
    import json

    import onnx

    model = onnx.load(str(path / "prefill.onnx"), load_external_data=False)
    edit(model)
    onnx.save(model, str(path / "prefill.onnx"))
    data = (path / "prefill.onnx").read_bytes()
    raw = json.loads((path / "manifest.json").read_text())
    raw["files"]["prefill.onnx"] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (path / "manifest.json").write_text(json.dumps(raw))


def test_prefill_slices_its_rows_straight_from_the_input() -> None:
    """Slice reads its starts on the host: taken from the overridable input itself, no node
    computes them, so no CPU node keeps CUDA from capturing prefill (captured prefill chunks)."""
    import onnx

    from loopcast.manifest import LOGIT_START

    model = onnx.load(str(artifact("demo") / "prefill.onnx"), load_external_data=False)
    (node,) = [n for n in model.graph.node if n.op_type == "Slice"]
    assert node.input[1] == LOGIT_START
    assert LOGIT_START in {v.name for v in model.graph.input}
    (start,) = [i for i in model.graph.initializer if i.name == LOGIT_START]
    assert onnx.numpy_helper.to_array(start).tolist() == [-1]
    assert not any(n.op_type == "Neg" for n in model.graph.node)


def test_a_prefill_graph_of_the_older_logit_rows_form_still_serves_verify(tmp_path) -> None:
    """Artifacts exported before ``logit_start`` take a positive ``logit_rows`` (negated in the
    graph): verify on their prefill session is still verify's own rows."""
    import shutil

    from onnx import helper, numpy_helper

    from loopcast.manifest import LOGIT_ROWS, LOGIT_START

    path = tmp_path / "art"
    shutil.copytree(artifact("demo"), path)

    def older(model) -> None:  # logit_rows [1] -> Neg -> the Slice's start, as exports made it
        graph = model.graph
        for init in graph.initializer:
            if init.name == LOGIT_START:
                init.CopyFrom(numpy_helper.from_array(np.array([1], np.int64), LOGIT_ROWS))
        for value in graph.input:
            if value.name == LOGIT_START:
                value.name = LOGIT_ROWS
        neg = helper.make_node("Neg", [LOGIT_ROWS], [LOGIT_START], name="/prefill/logit_start")
        graph.node.insert(0, neg)

    _rewrite_prefill(path, older)
    shared = open_artifact(path, "cpu")
    own = open_artifact(artifact("demo"), "cpu", kinds=(DECODE, VERIFY))
    assert shared.sessions[VERIFY] is shared.sessions[PREFILL]
    assert LOGIT_ROWS in {v.name for v in shared.sessions[PREFILL].get_overridable_initializers()}
    width = shared.manifest.graphs[VERIFY].rows
    fed = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3][: width + 1]
    rows = []
    for model in (shared, own):
        gen = Generator(model)
        gen.run(DECODE, 0, tokens=[fed[0]])
        gen.commit([fed[0]])
        rows.append(gen.run(VERIFY, 1, tokens=fed[1 : 1 + width]).logits.copy())
    assert rows[0].shape[0] == width and np.array_equal(rows[0], rows[1])


def test_a_prefill_graph_without_logit_start_is_refused(tmp_path) -> None:
    """A prefill graph without the overridable ``logit_start`` (or the older ``logit_rows``)
    cannot serve verify on its session: one error that says to re-export."""
    import shutil

    from loopcast.manifest import LOGIT_START

    path = tmp_path / "art"
    shutil.copytree(artifact("demo"), path)

    def without(model) -> None:
        inputs = [v for v in model.graph.input if v.name != LOGIT_START]
        assert len(inputs) == len(model.graph.input) - 1
        del model.graph.input[:]
        model.graph.input.extend(inputs)

    _rewrite_prefill(path, without)
    with pytest.raises(ArtifactError, match="takes no logit_start input.*re-export"):
        load(path)


def test_speculative_kinds_get_their_cpu_session_on_first_use() -> None:
    """Each CPU session of the stock MatMul prepacks its own copy of the weights: draft,
    verify_tail and the cycle wait until a speculative generation asks for them, and the tokens
    do not change (ort_runtime/loading/session_table.py)."""
    from concurrent.futures import ThreadPoolExecutor

    from loopcast.ort_runtime.api import LoopcastModel

    from loopcast.manifest import CYCLE, CYCLE_RUN, DRAFT, VERIFY_TAIL

    path = artifact("demo")
    lazy = open_artifact(path, "cpu")
    speculative = [k for k in (DRAFT, VERIFY_TAIL, CYCLE, CYCLE_RUN) if k in lazy.manifest.graphs]
    assert DRAFT in speculative and VERIFY_TAIL in speculative
    assert all(lazy.has(k) and lazy.sessions.pending(k) for k in speculative)
    assert set(lazy.sessions.made()) == {PREFILL, DECODE, VERIFY}
    model = LoopcastModel(lazy)
    prompt = model.encode("def add(a, b):")
    plain = model.generate(prompt, 24, stop_ids=()).tokens
    assert model.generate(prompt, 24, stop_ids=(), speculative="prompt-lookup", gate="always").tokens == plain
    assert all(lazy.sessions.pending(k) for k in speculative)  # plain and prompt lookup: one packed copy
    with ThreadPoolExecutor(4) as pool:  # first use from several threads: one session
        outs = list(
            pool.map(
                lambda _: model.generate(prompt, 24, stop_ids=(), speculative="self", gate="always").tokens,
                range(4),
            )
        )
    assert outs == [plain] * 4
    assert not lazy.sessions.pending(DRAFT) and lazy.sessions[DRAFT] is lazy.sessions[DRAFT]
    eager = open_artifact(path, "cpu", defer_sessions=False)
    assert set(eager.sessions.made()) == set(eager.manifest.graphs)


def test_sessions_are_not_deferred_where_the_weights_are_shared() -> None:
    """share_weights=True (no prepacking): one mapping serves every session, nothing to defer."""
    model = open_artifact(artifact("demo"), "cpu", share_weights=True)
    assert set(model.sessions.made()) == set(model.manifest.graphs)


def test_first_run_of_a_binding_is_not_timed() -> None:
    """A kind's first run on a generator (after its binding and, when deferred, its session were
    made inside that step) is not a steady one: the cost gate's timers skip it, or one session
    creation would price every speculative round (the CPU demo's host factor read 3.6)."""
    from loopcast.manifest import DRAFT

    model = open_artifact(artifact("demo"), "cpu")
    assert model.sessions.pending(DRAFT)
    gen = Generator(model)
    gen.prefill([3, 1, 4, 1, 5])
    for kind, tokens in ((DECODE, [9]), (DRAFT, [9])):
        gen.run(kind, gen.n, tokens=tokens)
        assert (gen.clock.runs(kind), gen.clock.steady(kind)) == (1, 0)
        gen.run(kind, gen.n, tokens=tokens)
        assert (gen.clock.runs(kind), gen.clock.steady(kind)) == (2, 1)
    assert not model.sessions.pending(DRAFT)


@pytest.mark.parametrize("name,kw", [("demo", {}), ("ouro-r2-gqa", {"draft_depth": 1})])
def test_verify_on_prefill_session_runs_only_the_rows_used(name, kw) -> None:
    """A round of m < W rows runs m rows (the KV past them untouched) whose logits are the W-row
    call's first m rows bit for bit; each count's steady runs are timed apart for the gate."""
    from loopcast.ort_runtime.binding.step_clock import rows_timer
    from loopcast.ort_runtime.decoding.gates import StepCosts

    model = open_artifact(artifact(name, **kw), "cpu")
    own = open_artifact(artifact(name, **kw), "cpu", share_sessions=(DECODE,))  # verify's own session
    width = model.manifest.graphs[VERIFY].rows
    gen, fixed = Generator(model), Generator(own)
    assert gen.variable_rows(VERIFY) and not fixed.variable_rows(VERIFY) and not gen.variable_rows(DECODE)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    fed = [7, 8, 9, 10, 11, 12, 13, 14][:width]
    gen.prefill(prompt)
    full = gen.run(VERIFY, gen.n, tokens=fed).logits.copy()
    slot = model.config.num_kv_slots - 1
    for m in (1, 2, width - 1, 2, width):
        key_before = gen.kv_arrays(slot)[0].copy()
        key_before[..., gen.n : gen.n + m, :] = 0
        for _ in range(2):  # the second run of a count is steady
            out = gen.run(VERIFY, gen.n, tokens=fed[:m])
        assert out.logits.shape[0] == m == len(out.next_ids)
        assert np.array_equal(out.logits, full[:m])
        key_after = gen.kv_arrays(slot)[0].copy()
        key_after[..., gen.n : gen.n + m, :] = 0
        assert np.array_equal(key_before, key_after)  # nothing written past the m rows
        assert gen.clock.mean(rows_timer(VERIFY, m)) is not None
        expected = [int(np.argmax(r)) for r in full[:m]]
        assert out.next_ids.tolist() == expected
    fixed.prefill(prompt)
    assert np.array_equal(fixed.run(VERIFY, fixed.n, tokens=fed[:2]).logits[:2], full[:2])
    assert StepCosts(fixed, 0.25).rows_cost(VERIFY, 3) is None  # fixed width: priced by its mean


def test_rows_cost_interpolates_the_measured_counts() -> None:
    """The gate's price of m verify rows: measured counts as measured, the line between them,
    past the largest its cost per row after the first; nothing before any count is timed."""
    from loopcast.ort_runtime.binding.step_clock import rows_timer
    from loopcast.ort_runtime.decoding.gates import StepCosts

    model = open_artifact(artifact("demo"), "cpu")
    gen = Generator(model)
    costs = StepCosts(gen, 0.25)
    gen.clock.add(gen.resolve(DECODE), 1.0)
    assert costs.rows_cost(VERIFY, 3) is None
    gen.clock.add(rows_timer(VERIFY, 2), 1.5)
    assert costs.rows_cost(VERIFY, 2) == 1.5
    assert costs.rows_cost(VERIFY, 4) == pytest.approx(2.5)  # 0.5 a row past the first
    gen.clock.add(rows_timer(VERIFY, 4), 1.7)
    assert costs.rows_cost(VERIFY, 3) == pytest.approx(1.6)
    assert costs.rows_cost(VERIFY, 5) == pytest.approx(1.7 + 0.7 / 3)
