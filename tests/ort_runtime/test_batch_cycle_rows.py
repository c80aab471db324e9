"""The batched pipeline cycle (graphs/batched_cycle.py): each row, addressed by (sequence,
position, depth), equals the one-sequence cycle's row of that lane bit for bit (logits, argmax,
normed state, the KV it writes), whatever other rows share the call and however many rows the
call runs; an unused row (position -1) writes no KV (CPU, fp32, loopcast-attention)."""

from __future__ import annotations

import numpy as np
import pytest
from loopcast.ort_runtime import load

from loopcast.manifest import CYCLE, GraphKind
from tests.artifacts import artifact, require_exact_cpu_artifacts

CYCLE_BATCH = GraphKind.CYCLE_BATCH


@pytest.fixture(scope="module", autouse=True)
def _exact_cpu():
    require_exact_cpu_artifacts()


def _rows(R: int, groups: int, P: int) -> dict[int, tuple[int, int]]:
    """Row -> (sequence, position) over ``groups`` row groups of R (row j·R + r at depth r): lanes
    of several sequences at every depth, the last group unused when there are several, a
    sequence's lanes at consecutive positions (the younger lane shallower)."""
    rows = {}
    for j in range(max(groups - 1, 1)):  # group j's lane at depth r: sequence (j + 2r) % P
        for r in range(R):
            rows[j * R + r] = ((j + 2 * r) % P, 6 + 2 * j - r)
    return rows


@pytest.mark.parametrize("name", ["ouro-r3", "ouro-r2-gqa"])
@pytest.mark.parametrize("groups", [None, 2, 1])
def test_cycle_batch_rows_equal_one_sequence_cycle_rows(name, groups):
    """A call of every row the graph takes, and calls of fewer (the occupied slots' rows)."""
    model = load(artifact(name, max_batch=4)).loaded
    cfg, spec = model.config, model.manifest.graphs[CYCLE_BATCH]
    R, H, V = cfg.num_loops, cfg.hidden_size, cfg.vocab_size
    P = spec.rows // R
    n = (groups or P) * R  # the call's rows
    rng = np.random.default_rng(0)
    kv_shape = (P, cfg.num_kv_heads, model.manifest.max_length, cfg.head_dim)
    kv = {
        f"past_{kv}.{s}": rng.standard_normal(kv_shape).astype(np.float32)
        for s in spec.kv_slots
        for kv in ("key", "value")
    }
    rows = _rows(R, groups or P, P)
    tokens = rng.integers(0, V, (1, n)).astype(np.int64)  # read at the depth-0 rows only
    carried = rng.standard_normal((1, n, H)).astype(np.float32)  # read at the deeper rows only
    address = np.full((n, 2), -1, np.int32)
    for i, (seq, pos) in rows.items():
        address[i] = (seq, pos)
    address[:, 0] = np.where(address[:, 0] < 0, 0, address[:, 0])  # unused rows: entry 0, position -1
    names = [o.name for o in model.sessions[CYCLE_BATCH].get_outputs()]
    out = dict(
        zip(
            names,
            model.sessions[CYCLE_BATCH].run(
                None, {"input_ids_BS": tokens, "carried_BWH": carried, "row_address_W2": address, **kv}
            ),
        )
    )
    assert out["logits_BSV"].shape == (1, n, V) and out["hidden_BWH_out"].shape == (1, n, H)
    single = model.sessions[CYCLE]
    single_names = [o.name for o in single.get_outputs()]
    written = np.zeros(kv_shape[:1] + kv_shape[2:3], bool)  # (sequence, position) rows written
    for seq in range(P):
        mine = {i % R: (i, pos) for i, (s, pos) in rows.items() if s == seq}
        assert len(mine) == len({i for i, _ in mine.values()})  # one lane per depth
        lanes = np.full(R + 1, -1, np.int32)
        lane_carried = np.zeros((1, R, H), np.float32)
        lanes[0] = tokens[0, mine[0][0]] if 0 in mine else 0
        for r, (i, pos) in mine.items():
            lanes[1 + r] = pos
            if r > 0:
                lane_carried[0, r - 1] = carried[0, i]
        feeds = {"lanes_W1": lanes, "carried_BWH": lane_carried}
        feeds |= {k: v[seq : seq + 1] for k, v in kv.items() if int(k.split(".")[1]) in single_kv(model)}
        got = dict(zip(single_names, single.run(None, feeds)))
        for r, (i, pos) in mine.items():
            assert np.array_equal(out["logits_BSV"][0, i], got["logits_BSV"][0, r]), (name, seq, r)
            assert out["next_token_ids_BS"][0, i] == got["next_token_ids_BS"][0, r]
            assert np.array_equal(out["hidden_BWH_out"][0, i], got["carried_BWH_out"][0, r]), (name, seq, r)
            written[seq, pos] = True
            for l in range(cfg.num_layers):
                slot = cfg.core_slot(r, l)
                for kv_name in ("key", "value"):
                    batched = out[f"present_{kv_name}.{slot}"][seq, :, pos]
                    assert np.array_equal(batched, got[f"present_{kv_name}.{slot}"][0, :, pos])
                    assert not np.array_equal(batched, kv[f"past_{kv_name}.{slot}"][seq, :, pos])
    # every row no lane wrote is the past buffer's (unused rows and other sequences write nothing)
    for s in spec.kv_slots:
        r = s // cfg.num_layers
        lane_rows = {(seq, pos) for i, (seq, pos) in rows.items() if i % R == r}
        for kv_name in ("key", "value"):
            changed = np.any(out[f"present_{kv_name}.{s}"] != kv[f"past_{kv_name}.{s}"], axis=(1, 3))
            assert {tuple(x) for x in np.argwhere(changed)} == lane_rows, (name, s)


def single_kv(model) -> set[int]:
    return set(model.manifest.graphs[CYCLE].kv_slots)


def test_cycle_batch_refuses_a_sequence_outside_the_buffers():
    model = load(artifact("ouro-r3", max_batch=4)).loaded
    cfg, spec = model.config, model.manifest.graphs[CYCLE_BATCH]
    W, H = spec.rows, cfg.hidden_size
    kv_shape = (2, cfg.num_kv_heads, model.manifest.max_length, cfg.head_dim)
    kv = {f"past_{k}.{s}": np.zeros(kv_shape, np.float32) for s in spec.kv_slots for k in ("key", "value")}
    address = np.full((W, 2), -1, np.int32)
    address[0] = (3, 1)  # entry 3 of two-entry buffers
    feeds = {
        "input_ids_BS": np.zeros((1, W), np.int64),
        "carried_BWH": np.zeros((1, W, H), np.float32),
        "row_address_W2": address,
        **kv,
    }
    with pytest.raises(Exception, match="outside the 2 sequences"):
        model.sessions[CYCLE_BATCH].run(None, feeds)
