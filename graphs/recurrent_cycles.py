"""The recurrent-depth pipeline's graph (docs/architecture.md §3, §5 "Pipeline cycle"): one call
serves a lane at every core step, with the entering lane's prelude and the leaving lane's coda.

A lane is one token on its way through prelude → r core steps → coda. Row k of the call holds
the lane at core step k (R rows, R = max_recurrence; rows at steps >= r, or without a lane, are
inactive: position -1):

    lanes_N = [entering token, leaving row, position of row 0, ..., position of row R-1]

    entering token ─ embed·√H ─ prelude (row 0's position) ─▶ e ─┐
    state_0_BSH (the entering row's initial state) ───────────────┴─ Concat ─▶ [s_0, e] ──┐
    carried_BW2H rows 0..R-2 ([s_k, e] of the lanes that ran step k-1 last call) ─────────┴─ Concat
        ─▶ injected_BW2H ─ adapter ─ core blocks (row k: slot (k, l) at its position) ─▶ states_BWH
    states_BWH ─ Concat(e of each row) ─▶ carried_BW2H_out (bound as the next call's carried_BW2H)
    states_BWH[leaving row] ─ coda (the leaving row's position) ─ head ─▶ next_token_ids_BS, logits_BSV

The carried rows hold each lane's state together with its own prelude output, so the injection
travels with its lane. A lane's rows compute what the one-row prelude, core_step and coda calls
compute at its position: the same blocks (graphs/recurrent.py), and RowAttention rows are the
one-row attention call bit for bit.
"""

from __future__ import annotations

import onnx_ir as ir
from loopcast.graphs import blocks
from loopcast.graphs.builder import GraphBuilder
from loopcast.graphs.ops import op_set_builders
from loopcast.graphs.recurrent import coda_blocks, core_step_blocks, prelude_blocks

from loopcast.config import ModelConfig
from loopcast.manifest import RECURRENT_LANE_HEADER as LANE_HEADER
from loopcast.manifest import GraphSpec
from loopcast.vocab import GraphKind, OpSet, has_recurrent_cycle


def _rows_context(
    config: ModelConfig, dtype: ir.DataType, max_length: int, b: GraphBuilder, op_set, positions: ir.Value
) -> blocks.BlockContext:
    step = blocks.StepInputs(
        seqlens_k=None,
        total_sequence_length=None,
        cos_cache=b.weight("rotary.cos_SD2"),
        sin_cache=b.weight("rotary.sin_SD2"),
    )
    return blocks.BlockContext(
        config, dtype, max_length, step, op_set_builders(op_set), rows=blocks.RowAddresses(positions)
    )


def _slice(b: GraphBuilder, x: ir.Value, start: int, end: int, axis: int, name: str) -> ir.Value:
    return b.op(
        "Slice",
        [
            x,
            b.const_i64(f"{name}_start", [start]),
            b.const_i64(f"{name}_end", [end]),
            b.const_i64(f"{name}_axis", [axis]),
        ],
        path=f"/cycle/{name}",
        out=name,
    )


def build_recurrent_cycle(
    config: ModelConfig, dtype: ir.DataType, max_length: int, b: GraphBuilder, *, op_set: OpSet | str
) -> tuple[ir.Model, GraphSpec]:
    """One pipeline cycle of a recurrent-depth model (the module docstring's diagram)."""
    if not has_recurrent_cycle(config, op_set):
        raise ValueError("recurrent_cycle needs a recurrent-depth model and the loopcast attention op")
    R, H = config.num_loops, config.hidden_size
    lanes = b.input("lanes_N", ir.DataType.INT32, [LANE_HEADER + R])
    state_0 = b.input("state_0_BSH", dtype, [1, 1, H])
    carried = b.input("carried_BW2H", dtype, [1, R, 2 * H])
    token = _slice(b, lanes, 0, 1, 0, "entering_1")
    leaving = _slice(b, lanes, 1, 2, 0, "leaving_row_1")
    positions = _slice(b, lanes, LANE_HEADER, LANE_HEADER + R, 0, "positions_W")
    first = _slice(b, positions, 0, 1, 0, "entering_position_1")
    last = b.op(
        "Gather", [positions, leaving], path="/cycle/leaving_position", out="leaving_position_1", axis=0
    )

    # entering: the prelude of row 0's token at row 0's position
    ids = b.op(
        "Reshape", [token, b.const_i64("shape_11", [1, 1])], path="/cycle/token_shape", out="entering_BS"
    )
    embedded = prelude_blocks(b, ids, _rows_context(config, dtype, max_length, b, op_set, first))
    entering = b.op("Concat", [state_0, embedded], path="/cycle/enter", out="entering_B12H", axis=-1)
    continuing = _slice(b, carried, 0, R - 1, 1, "continuing_BRm12H")
    injected = b.op("Concat", [entering, continuing], path="/cycle/lanes", out="injected_BW2H", axis=1)

    # every lane one core step: row k at step k's slots
    core = _rows_context(config, dtype, max_length, b, op_set, positions)
    slots = [tuple(config.core_slot(k, l) for k in range(R)) for l in range(config.num_layers)]
    states = core_step_blocks(b, injected, slots, core)
    injections = _slice(b, injected, H, 2 * H, 2, "injections_BWH")
    out = b.op("Concat", [states, injections], path="/cycle/carry", out="carried_BW2H_out", axis=-1)
    b.output(out, dtype, [1, R, 2 * H])

    # leaving: the coda of the leaving row's state at its position
    leaving_state = b.op("Gather", [states, leaving], path="/cycle/leaving", out="leaving_B1H", axis=1)
    logits = coda_blocks(b, leaving_state, _rows_context(config, dtype, max_length, b, op_set, last))
    blocks.greedy_outputs(b, logits, 1, config.vocab_size)
    kind = GraphKind.RECURRENT_CYCLE
    model = b.build(kind, "recurrent-depth pipeline cycle: prelude in, one core step per row, coda out")
    return model, b.spec(kind, f"{kind}.onnx", R, 0, R)
