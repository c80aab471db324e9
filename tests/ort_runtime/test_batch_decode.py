"""Batched decode (graphs/batched.py, ort_runtime/binding/batch_generator.py): a decode_batch row is the
single-sequence decode row, bit for bit, on the CPU in fp32 with the loopcast-attention op set
(the default), so batched greedy equals single-sequence greedy token for token."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from loopcast.ort_runtime import load
from loopcast.ort_runtime.binding.batch_generator import BatchGenerator

from loopcast.errors import ArtifactError, RequestError
from loopcast.manifest import DECODE_BATCH, Manifest
from tests.artifacts import artifact, require_exact_cpu_artifacts

PROMPTS = [[1, 2, 3, 4], [5, 6, 7], [9, 10, 11, 12, 13, 14], [3], [40, 41, 42, 43, 44, 45, 46, 47, 48]]


@pytest.fixture(scope="module", autouse=True)
def _exact_cpu():
    require_exact_cpu_artifacts()


def _run_batched(bg: BatchGenerator, prompts: list[list[int]], new: int, *, logits: bool = False):
    """Greedy for every prompt at once (slot i = prompt i); returns tokens (and per-step logits)."""
    pending, out, rows = {}, {i: [] for i in range(len(prompts))}, {i: [] for i in range(len(prompts))}
    for i, p in enumerate(prompts):
        pending[i], _ = bg.prefill(i, p)
        out[i].append(pending[i])
    for _ in range(new - 1):
        step = bg.decode(pending, want_logits=logits)
        for s, t in step.next_ids.items():
            out[s].append(t)
            pending[s] = t
            if logits:
                rows[s].append(step.logits[s])
    return out, rows


@pytest.mark.parametrize(
    "name, pad",
    [(n, None) for n in ("ouro-r3", "ouro-r2-gqa", "llama-tied-gqa", "llama-untied")] + [("ouro-r2-gqa", 32)],
)
def test_batched_greedy_equals_single_sequence(name, pad):
    """(pad: heads of 16 stored as 32, exporter/head_padding.py; the batch's KV entries too)"""
    model = load(artifact(name, max_batch=8, pad_heads_to=pad))
    assert model.loaded.manifest.op_set == "loopcast-attention"
    bg = BatchGenerator(model.loaded)
    assert bg.kv_arrays(0, 0)[0].shape[-1] == (pad or 16)
    got, rows = _run_batched(bg, PROMPTS, 12, logits=True)
    for i, prompt in enumerate(PROMPTS):
        assert got[i] == list(model.stream_ids(prompt, 12, stop_ids=())), (name, i)
        # and the logits rows bit for bit: the single-sequence decode row of the same position
        gen = model.new_generator()
        pending = gen.prefill(prompt)
        for step, row in enumerate(rows[i]):
            single = gen.run("decode", gen.n, tokens=[pending]).logits[0]
            gen.commit([pending])
            pending = int(single.argmax())
            assert np.array_equal(single, row), (name, i, step)


def test_rows_do_not_depend_on_the_batch():
    """The same prompt in slot 0 alone, and in slot 6 with six other sequences, gives the same tokens;
    free slots inside the prefix (dummy rows) change nothing."""
    model = load(artifact("ouro-r3", max_batch=8))
    alone, _ = _run_batched(BatchGenerator(model.loaded), [PROMPTS[2]], 10)
    crowd = [PROMPTS[i % len(PROMPTS)] for i in range(6)] + [PROMPTS[2]]
    bg = BatchGenerator(model.loaded)
    together, _ = _run_batched(bg, crowd, 10)
    assert together[6] == alone[0]
    # a sparse batch: only slots 1 and 5 (slots 0, 2-4 run dummy rows)
    bg2 = BatchGenerator(model.loaded)
    pending = {1: bg2.prefill(1, PROMPTS[0])[0], 5: bg2.prefill(5, PROMPTS[2])[0]}
    seq = {1: [pending[1]], 5: [pending[5]]}
    for _ in range(9):
        for s, t in bg2.decode(pending).next_ids.items():
            seq[s].append(t)
            pending[s] = t
    assert seq[5] == alone[0]
    assert seq[1] == list(model.stream_ids(PROMPTS[0], 10, stop_ids=()))


def test_prefill_writes_only_its_slot():
    model = load(artifact("ouro-r3", max_batch=4))
    bg = BatchGenerator(model.loaded)
    bg.prefill(1, PROMPTS[0])
    before = [bg.kv_arrays(0, s)[0].copy() for s in range(4)]
    bg.prefill(2, PROMPTS[2])
    after = [bg.kv_arrays(0, s)[0] for s in range(4)]
    for s in (0, 1, 3):
        assert np.array_equal(before[s], after[s])
    assert not np.array_equal(before[2], after[2])
    assert bg.lengths == [0, len(PROMPTS[0]), len(PROMPTS[2]), 0]


def test_warm_up_writes_idle_kv_entries_and_leaves_held_ones():
    """On the CPU warm_up writes the KV entries of the slots that hold nothing (their pages, or
    a slot's first prefill faults them in: a stall on the batch) and no slot that holds KV, a
    prefix kept by release, or lanes; tokens after it are those without it."""
    model = load(artifact("ouro-r3", max_batch=4))
    bg = BatchGenerator(model.loaded)
    bg.prefill(1, PROMPTS[0])
    bg.prefill(3, PROMPTS[2])
    bg.release(3, keep=len(PROMPTS[2]))
    for kv_slot in range(model.config.num_kv_slots):  # idle slots' entries: not zero before
        for buf in bg._kv[kv_slot]:
            buf.host[0] = 7.0
            buf.host[2] = 7.0
    held = [bg.kv_arrays(0, s)[0].copy() for s in (1, 3)]
    bg.warm_up()
    assert [np.array_equal(a, bg.kv_arrays(0, s)[0]) for a, s in zip(held, (1, 3))] == [True, True]
    for s in (0, 2):
        key, value = bg.kv_arrays(model.config.num_kv_slots - 1, s)
        assert not key.any() and not value.any()
    fresh = BatchGenerator(model.loaded)
    fresh.prefill(1, PROMPTS[0])
    want = fresh.decode({1: 5}).next_ids
    assert bg.decode({1: 5}).next_ids == want


def test_batched_kinds_in_the_manifest(tmp_path):
    path = artifact("ouro-r3", max_batch=4)
    manifest = Manifest.read(path)
    assert manifest.max_batch == 4 and DECODE_BATCH in manifest.graphs
    assert manifest.graphs["verify_batch"].rows == manifest.verify_width
    # no max_batch but a decode_batch graph, and the other way round: both refused
    for drop in ("max_batch", "graph"):
        broken = tmp_path / drop
        shutil.copytree(path, broken)
        raw = json.loads((broken / "manifest.json").read_text())
        if drop == "max_batch":
            raw["max_batch"] = None
        else:
            del raw["graphs"][DECODE_BATCH]
        (broken / "manifest.json").write_text(json.dumps(raw))
        with pytest.raises(ArtifactError, match="decode_batch"):
            Manifest.read(broken)


def test_errors():
    plain = load(artifact("ouro-r3"))
    assert plain.loaded.manifest.max_batch is None
    with pytest.raises(ArtifactError, match="--max-batch"):
        BatchGenerator(plain.loaded)
    model = load(artifact("ouro-r3", max_batch=4))
    with pytest.raises(RequestError, match="max_batch must be in 1..4"):
        BatchGenerator(model.loaded, max_batch=5)
    bg = BatchGenerator(model.loaded, max_batch=2)
    with pytest.raises(RequestError, match="slot 2"):
        bg.prefill(2, [1])
    with pytest.raises(RequestError, match="prefilled"):
        bg.decode({0: 1})
    with pytest.raises(RequestError, match="vocabulary"):
        bg.prefill(0, [10**6])


@pytest.mark.parametrize("name", ["ouro-r3", "llama-tied-gqa"])
def test_verify_batch_rows_equal_decode_rows(name):
    """verify_batch rows (pending + drafts, per slot) are the single-sequence decode rows bit for bit,
    for full, partial (padded) and draft-less slots in one step; advance commits what is accepted."""
    model = load(artifact(name, max_batch=4))
    bg = BatchGenerator(model.loaded)
    W = bg.verify_width
    assert W == 5
    prompts = {0: PROMPTS[0], 2: PROMPTS[2], 3: PROMPTS[4]}
    greedy = {s: list(model.stream_ids(p, W + 2, stop_ids=())) for s, p in prompts.items()}
    rows = {0: greedy[0][:W], 2: greedy[2][:3], 3: greedy[3][:1]}
    for slot, prompt in prompts.items():
        assert bg.prefill(slot, prompt)[0] == greedy[slot][0]
    targets, logits = bg.verify(rows, want_logits=True)
    for slot, ids in rows.items():
        assert targets[slot] == greedy[slot][1 : len(ids) + 1]
        gen = model.new_generator()
        gen.prefill(prompts[slot])
        for i, token in enumerate(ids):
            single = gen.run("decode", gen.n, tokens=[token]).logits[0]
            gen.commit([token])
            assert np.array_equal(single, logits[slot][i]), (name, slot, i)
    for slot, ids in rows.items():
        bg.advance(slot, len(ids))
    step = bg.decode({s: greedy[s][len(rows[s])] for s in rows})
    assert step.next_ids == {s: greedy[s][len(rows[s]) + 1] for s in rows}


class _CaptureStandIn:
    """A CPU session standing in for a capture session: accepts and ignores ``gpu_graph_id``
    (as tests/ort_runtime/test_graph_slots.py), or fails where ORT would capture."""

    def __init__(self, session, fail: bool) -> None:
        self._session, self.fail, self.graph_ids = session, fail, []

    def __getattr__(self, name):
        return getattr(self._session, name)

    def run_with_iobinding(self, binding, run_options=None):
        if run_options is not None:
            if self.fail:
                raise RuntimeError("CUDA failure 901: operation not permitted when stream is capturing")
            self.graph_ids.append(run_options.get_run_config_entry("gpu_graph_id"))
        return self._session.run_with_iobinding(binding, run_options)


def captured_stand_ins(loaded, fail: bool = False):
    """``loaded`` whose capture sessions are stand-ins (``_CaptureStandIn``, made on first use),
    and the dict of those made, by kind."""
    import dataclasses

    stand_ins: dict[str, _CaptureStandIn] = {}

    def factory(kind, capture):
        stand_ins[kind] = _CaptureStandIn(loaded.sessions[kind], fail)
        return stand_ins[kind]

    fake = dataclasses.replace(
        loaded, _session_factory=factory, _captured={}, _graph_ids={}, graph_fallbacks={}
    )
    return fake, stand_ins


@pytest.mark.parametrize("fail", [False, True])
def test_graph_ids_per_width_and_fallback(fail):
    """cuda_graphs: every (kind, width) binding runs under its own graph id; a capture failure on
    a first run falls back to the eager session for the kind, with the same tokens."""
    model = load(artifact("ouro-r3", max_batch=4))
    fake, stand_ins = captured_stand_ins(model.loaded, fail)
    bg = BatchGenerator(fake, cuda_graphs="always")
    assert bg.captured == {DECODE_BATCH, "verify_batch", "draft_batch", "verify_tail_batch"}
    got, _ = _run_batched(bg, PROMPTS[:3], 8)  # 7 decode steps at width 3
    pending = {0: got[0][-1]}
    for s in (1, 2):
        bg.release(s)
    bg.decode(pending)  # width 1: another graph id
    for i, prompt in enumerate(PROMPTS[:3]):
        assert got[i] == list(model.stream_ids(prompt, 8, stop_ids=()))
    if fail:
        assert DECODE_BATCH not in bg.captured and "901" in bg.graph_fallbacks[DECODE_BATCH]
        assert stand_ins[DECODE_BATCH].graph_ids == []
    else:
        ids = stand_ins[DECODE_BATCH].graph_ids
        assert len(set(ids)) == 2 and len(ids) == 8  # widths 3 and 1, one id each
