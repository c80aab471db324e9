"""Batched self-speculation kinds (graphs/batched.py draft_batch and verify_tail_batch,
ort_runtime/binding/batch_generator.py draft/verify_tail): each row equals the one-sequence
draft or verify_tail row of the same sequence and position bit for bit (logits and depth-d
states), whatever other sequences share the call (CPU, fp32, loopcast-attention)."""

from __future__ import annotations

import numpy as np
import pytest
from loopcast.ort_runtime import load
from loopcast.ort_runtime.binding.batch_generator import BatchGenerator

from loopcast.errors import RequestError
from loopcast.manifest import DRAFT_BATCH, VERIFY_TAIL_BATCH
from tests.artifacts import artifact, require_exact_cpu_artifacts

PROMPTS = {0: [1, 2, 3, 4], 2: [5, 6, 7], 3: [9, 10, 11, 12, 13, 14], 5: [40, 41, 42]}
DRAFTS = {0: 3, 2: 0, 3: 4, 5: 1}  # drafts per slot: the chains end at different calls


@pytest.fixture(scope="module", autouse=True)
def _exact_cpu():
    require_exact_cpu_artifacts()


def _single_round(model, prompt: list[int], k: int):
    """One self-speculation round of one sequence: draft rows n..n+k then verify_tail."""
    gen = model.new_generator()
    token = gen.prefill(prompt)
    n, hidden, rows = gen.n, [], []
    for i in range(k + 1):
        out = gen.run("draft", n + i, tokens=[token], want_logits=True)
        rows.append(out.logits[0].copy())
        hidden.append(out.hidden[0].copy())
        token = int(out.next_ids[0])
    tail = gen.run("verify_tail", n, hidden=np.stack(hidden), want_logits=True)
    return rows, hidden, tail.logits[: k + 1].copy()


@pytest.mark.parametrize("name", ["ouro-r3", "ouro-r2-gqa"])
def test_draft_and_tail_rows_equal_single_sequence_rows(name):
    model = load(artifact(name, max_batch=8))
    assert {DRAFT_BATCH, VERIFY_TAIL_BATCH} <= set(model.loaded.manifest.graphs)
    bg = BatchGenerator(model.loaded)
    token = {s: bg.prefill(s, p)[0] for s, p in PROMPTS.items()}
    hidden = {s: [] for s in PROMPTS}
    K = max(DRAFTS.values())
    for i in range(K + 1):
        # every slot of the round has a row in every call: one whose chain ended writes a row past
        # its drafts (position n + i, never committed by this round)
        out = bg.draft(token, {s: i for s in PROMPTS}, want_logits=True)
        for s in PROMPTS:
            if i <= DRAFTS[s]:
                hidden[s].append(out.hidden[s])
                single_rows, single_hidden, _ = _single_round(model, PROMPTS[s], DRAFTS[s])
                assert np.array_equal(out.logits[s], single_rows[i]), (name, s, i)
                assert np.array_equal(out.hidden[s], single_hidden[i]), (name, s, i)
            token[s] = out.next_ids[s]
    targets, logits = bg.verify_tail({s: np.stack(h) for s, h in hidden.items()}, want_logits=True)
    for s in PROMPTS:
        _, _, single_tail = _single_round(model, PROMPTS[s], DRAFTS[s])
        assert np.array_equal(logits[s], single_tail), (name, s)
        assert targets[s] == [int(t) for t in single_tail.argmax(-1)]


def test_tail_width_and_room_are_checked():
    model = load(artifact("ouro-r3", max_batch=2))
    bg = BatchGenerator(model.loaded)
    bg.prefill(0, [1, 2, 3])
    H = model.loaded.config.hidden_size
    with pytest.raises(RequestError, match="1..5 rows"):
        bg.verify_tail({0: np.zeros((6, H), np.float32)})
    with pytest.raises(RequestError, match="room"):
        bg.draft({0: 1}, {0: bg.max_length})
