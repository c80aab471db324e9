"""The pipeline's graphs (docs/architecture.md §3, §5 "Pipeline cycle"): one cycle per call, or
a run of K cycles with the lane schedule on the device between them.

    cycle      = [embed(token) | carried rows 0..R-2] → one core loop, row r at depth r
                 (RowAttention on slot (r, l) at row r's position) → loop-norm → head   (R rows)
                 [+ each row's exit-gate logit, where the model has Ouro's gate: the exit
                 gate's lanes (ort_runtime/decoding/exit_lanes.py) decide on it]
    cycle_run  = K × (cycle → ArgMax → LaneStep), the lanes' state passed from one LaneStep to the
                 next cycle; out: the last carried rows, each cycle's record and the last state

A lane's row in either graph computes exactly what the decode step computes at that depth and
position: the loop boundary is where draft and verify_tail already split the decode graph, with
the same ops on each side, and RowAttention rows are the one-row attention call bit for bit.
"""

from __future__ import annotations

import onnx_ir as ir
from loopcast.graphs import blocks
from loopcast.graphs.builder import LOOPCAST_DOMAIN, GraphBuilder
from loopcast.graphs.loop_steps import exit_gate_logit
from loopcast.graphs.ops import op_set_builders

from loopcast.config import ModelConfig
from loopcast.manifest import GraphSpec, lane_log_length, lane_state_length
from loopcast.vocab import GraphKind, OpSet, has_cycle

# Cycles per cycle_run call: the host's per-call work (one input copy, one launch, one log pull)
# is spread over this many cycles; a generation that stops mid-run wastes at most K - 1 cycles.
CYCLE_RUN_LENGTH = 8


def _cycle_body(
    b: GraphBuilder, ctx: blocks.BlockContext, entering_BS: ir.Value, carried_BWH: ir.Value
) -> tuple[ir.Value, ir.Value]:
    """One cycle: row 0 embeds the entering token, rows 1..R-1 continue the lanes carried out of
    rows 0..R-2 of the previous cycle. Returns (carried_BWH_out, logits_BSV)."""
    config = ctx.config
    R, L = config.num_loops, config.num_layers
    entering = blocks.embed(b, entering_BS)
    continuing = b.op(
        "Slice",
        [
            carried_BWH,
            b.const_i64("rows_start", [0]),
            b.const_i64("rows_end", [R - 1]),
            b.const_i64("rows_axis", [1]),
        ],
        path="/cycle/shift",
        out="continuing_BRm1H",
    )
    x = b.op("Concat", [entering, continuing], path="/cycle/lanes", out="lanes_BWH", axis=1)
    sites = [
        blocks.LayerSite(
            f"layers.{l}",
            tuple(config.core_slot(r, l) for r in range(R)),  # row r at loop r
            f"/cycle/layer{l}",
            f"cycle.layer{l}",
            ("/cycle/loop_norm", "cycle.normed_BWH") if l == L - 1 else None,
        )
        for l in range(L)
    ]
    x, _ = ctx.ops.stack(b, x, sites, ctx)
    return x, blocks.lm_head(b, x, ctx)


def _context(
    config: ModelConfig,
    dtype: ir.DataType,
    max_length: int,
    b: GraphBuilder,
    op_set: OpSet | str,
    positions_W: ir.Value,
    *,
    kv_in_place: bool,
) -> blocks.BlockContext:
    if not has_cycle(config, op_set):
        raise ValueError(
            "the cycle graphs need a looped model without prelude or coda and the loopcast attention op"
        )
    step = blocks.StepInputs(
        seqlens_k=None,
        total_sequence_length=None,
        cos_cache=b.weight("rotary.cos_SD2"),
        sin_cache=b.weight("rotary.sin_SD2"),
    )
    return blocks.BlockContext(
        config,
        dtype,
        max_length,
        step,
        op_set_builders(op_set),
        rows=blocks.RowAddresses(positions_W, kv_in_place=kv_in_place),
    )


def _spec(kind: GraphKind, b: GraphBuilder, R: int) -> GraphSpec:
    return b.spec(kind, f"{kind}.onnx", R, 0, R)


def build_cycle(
    config: ModelConfig, dtype: ir.DataType, max_length: int, b: GraphBuilder, *, op_set: OpSet | str
) -> tuple[ir.Model, GraphSpec]:
    """One cycle per call. ``lanes_W1`` = [entering token, position of row 0, ..., position of
    row R-1] (-1: no lane at that depth), one copy to the device per cycle; the host binds one
    cycle's ``carried_BWH_out`` as the next one's ``carried_BWH``. Every row leaves through the
    loop-norm and the head, so row 0 gives the depth-1 draft and row R-1 the full-depth token."""
    R, H = config.num_loops, config.hidden_size
    lanes = b.input("lanes_W1", ir.DataType.INT32, [R + 1])
    carried = b.input("carried_BWH", dtype, [1, R, H])
    token = b.op(
        "Slice",
        [lanes, b.const_i64("token_start", [0]), b.const_i64("token_end", [1])],
        path="/cycle/token",
        out="entering_1",
    )
    token_ids = b.op(
        "Reshape", [token, b.const_i64("shape_11", [1, 1])], path="/cycle/token_shape", out="entering_BS"
    )
    positions = b.op(
        "Slice",
        [lanes, b.const_i64("positions_start", [1]), b.const_i64("positions_end", [R + 1])],
        path="/cycle/positions",
        out="positions_W",
    )
    ctx = _context(config, dtype, max_length, b, op_set, positions, kv_in_place=False)
    x, logits = _cycle_body(b, ctx, token_ids, carried)
    b.output(x, dtype, [1, R, H], "carried_BWH_out")
    blocks.greedy_outputs(b, logits, R, config.vocab_size)
    if config.has_exit_gate:
        _row_gates(b, x, dtype, R)
    return b.build(GraphKind.CYCLE, "pipeline cycle: one pass over the core layers, row r at loop r"), _spec(
        GraphKind.CYCLE, b, R
    )


def _row_gates(b: GraphBuilder, x_BWH: ir.Value, dtype: ir.DataType, R: int) -> None:
    """Each row's exit-gate logit of its normed state, ``exit_gates_BR`` [1, R] in fp32. Row by
    row on a [1, 1, H] slice, with loop_step's ops and shapes, so a lane's gate at depth r has
    the bits of loop_step's gate at loop r (the gated lanes must decide as the loop steps do):

        x ─ Slice row r ─ MatMul(gate) ─ Add(bias) ─ (Cast) ─┐ × R ─ Concat ─ Reshape ─▶ exit_gates_BR
    """
    gates = []
    for r in range(R):
        row = b.op(
            "Slice",
            [
                x_BWH,
                b.const_i64(f"gate_row{r}_start", [r]),
                b.const_i64(f"gate_row{r}_end", [r + 1]),
                b.const_i64("rows_axis", [1]),
            ],
            path=f"/cycle/gate/row{r}",
            out=f"gate_row{r}_BSH",
        )
        gates.append(exit_gate_logit(b, row, dtype, f"/cycle/gate/row{r}/matmul", f"gate_row{r}"))
    gate = b.op("Concat", gates, path="/cycle/gate/rows", out="gates_BR1", axis=1)
    shape = b.const_i64("gates_shape", [1, R])
    gate = b.op("Reshape", [gate, shape], path="/cycle/gate/flat", out="exit_gates_BR")
    b.output(gate, ir.DataType.FLOAT, [1, R])


def build_cycle_run(
    config: ModelConfig,
    dtype: ir.DataType,
    max_length: int,
    b: GraphBuilder,
    *,
    op_set: OpSet | str,
    cycles: int = CYCLE_RUN_LENGTH,
) -> tuple[ir.Model, GraphSpec]:
    """K cycles in one call, greedy: after each cycle ``loopcast.LaneStep`` (custom_ops/src/lane_step.h)
    applies the lane schedule of ort_runtime/decoding/pipeline.py to the rows' argmax on the device and
    gives the next cycle its positions and entering token, so the host copies one state in and
    one log out per K cycles. Every cycle's RowAttention writes into the bound KV buffers
    themselves (``kv_in_place``): a cycle reads what earlier cycles of the call wrote.

    ``lane_state_N`` = [positions of rows 0..R-1, their tokens, limit, exit depth];
    ``lane_log_N`` = K records of 2R+8 (lane_step.h), then the state after the last cycle."""
    R, H = config.num_loops, config.hidden_size
    state = b.input("lane_state_N", ir.DataType.INT32, [lane_state_length(R)])
    carried = b.input("carried_BWH", dtype, [1, R, H])
    positions = b.op(
        "Slice",
        [state, b.const_i64("positions_start", [0]), b.const_i64("positions_end", [R])],
        path="/run/positions",
        out="positions_W",
    )
    token = b.op(
        "Slice",
        [state, b.const_i64("token_start", [R]), b.const_i64("token_end", [R + 1])],
        path="/run/token",
        out="entering_1",
    )
    entering = b.op(
        "Reshape", [token, b.const_i64("shape_11", [1, 1])], path="/run/token_shape", out="entering_BS"
    )
    records = []
    for c in range(cycles):
        b.scope = f"c{c}"
        ctx = _context(config, dtype, max_length, b, op_set, positions, kv_in_place=True)
        carried, logits = _cycle_body(b, ctx, entering, carried)
        ids = b.op("ArgMax", [logits], path="/sample/argmax", out="next_token_ids_BS", axis=-1, keepdims=0)
        state, positions, entering, record = b.op_multi(
            "LaneStep",
            [state, ids],
            path="/lane_step",
            domain=LOOPCAST_DOMAIN,
            outs=["lane_state_N", "positions_W", "entering_BS", "lane_record_N"],
        )
        records.append(record)
    b.scope = ""
    b.output(carried, dtype, [1, R, H], "carried_BWH_out")
    log = b.op("Concat", [*records, state], path="/run/log", out="lane_log_N", axis=0)
    b.output(log, ir.DataType.INT32, [lane_log_length(R, cycles)])
    return (
        b.build(GraphKind.CYCLE_RUN, f"pipeline cycle run: {cycles} cycles, the lane schedule on the device"),
        _spec(GraphKind.CYCLE_RUN, b, R),
    )
