"""LaneStep (CPU): the pipeline's greedy lane schedule between two cycles of a cycle run
(custom_ops/src/lane_step.h). The generation tests check it cycle by cycle against the host
scheduler (tests/ort_runtime/test_cycle_run.py); these pin its cases and its refusals."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from onnx import TensorProto, helper

from tests.custom_ops.ops_models import OPSETS, session

OUTS = ["state_out", "positions", "entering", "record"]


def lane_model(R: int) -> bytes:
    vi = helper.make_tensor_value_info
    node = helper.make_node("LaneStep", ["state", "ids"], OUTS, domain="loopcast")
    graph = helper.make_graph(
        [node],
        "g",
        [vi("state", TensorProto.INT32, [None]), vi("ids", TensorProto.INT64, [1, R])],
        [vi(n, TensorProto.INT32, None) for n in OUTS],
    )
    return helper.make_model(graph, ir_version=10, opset_imports=OPSETS).SerializeToString()


def step(sess, positions, tokens, ids, limit=100, exit_depth=1) -> dict:
    state = np.asarray([*positions, *tokens, limit, exit_depth], np.int32)
    out = sess.run(OUTS, {"state": state, "ids": np.asarray([ids], np.int64)})
    R = len(positions)
    record = out[3].tolist()
    return {
        "positions": out[0][:R].tolist(),
        "tokens": out[0][R : 2 * R].tolist(),
        "rows": out[1].tolist(),
        "entering": int(out[2][0, 0]),
        "ran": record[:R],
        "argmax": record[R : 2 * R],
        "record": dict(
            zip(
                [
                    "entering",
                    "position",
                    "committed",
                    "token",
                    "verified",
                    "accepted",
                    "discarded",
                    "drafted",
                ],
                record[2 * R :],
            )
        ),
    }


@pytest.fixture(scope="module")
def r3(library: Path):
    return session(lane_model(3), library)


def test_kept_draft_moves_every_lane_down_and_spawns(r3) -> None:
    got = step(r3, [5, 4, 3], [50, 40, 30], [60, 51, 40])
    assert got["positions"] == got["rows"] == [6, 5, 4] and got["tokens"] == [60, 50, 40]
    assert got["entering"] == 60 and got["ran"] == [5, 4, 3] and got["argmax"] == [60, 51, 40]
    assert got["record"] == {
        "entering": 50,
        "position": 3,
        "committed": 30,
        "token": 40,
        "verified": 1,
        "accepted": 1,
        "discarded": 0,
        "drafted": 1,
    }


def test_rejected_draft_discards_the_younger_lanes(r3) -> None:
    got = step(r3, [5, 4, 3], [50, 40, 30], [60, 51, 41])
    assert got["positions"] == [4, -1, -1] and got["tokens"] == [41, 0, 0] and got["entering"] == 41
    assert (
        got["record"]["accepted"] == 0 and got["record"]["discarded"] == 2 and got["record"]["drafted"] == 0
    )


def test_lone_lane_restarts_and_limit_stops_spawning(r3) -> None:
    got = step(r3, [-1, -1, 7], [0, 0, 70], [1, 2, 80])
    assert got["positions"] == [8, -1, -1] and got["record"]["verified"] == 0
    got = step(r3, [-1, -1, 7], [0, 0, 70], [1, 2, 80], limit=7)  # the token is still given, no lane
    assert got["positions"] == [-1, -1, -1] and got["record"]["token"] == 80
    got = step(r3, [9, 8, -1], [90, 80, 0], [91, 81, 0], limit=9)
    assert (
        got["positions"] == [-1, 9, 8] and got["record"]["position"] == -1 and got["record"]["drafted"] == 0
    )


def test_exit_depth_two_drafts_from_the_second_row(r3) -> None:
    got = step(r3, [-1, 4, 3], [0, 40, 30], [0, 55, 40], exit_depth=2)
    assert got["positions"] == [5, -1, 4] and got["tokens"][0] == 55
    got = step(r3, [-1, 4, 3], [0, 40, 30], [0, 55, 40], exit_depth=7)  # invalid reads as 1: row 0 is empty
    assert got["positions"] == [-1, -1, 4]


def test_bad_state_is_refused(r3) -> None:
    with pytest.raises(Exception, match=r"state must be int32 \[2R\+2\] = \[8\]"):
        r3.run(OUTS, {"state": np.zeros(7, np.int32), "ids": np.zeros((1, 3), np.int64)})
