"""The batched pipeline cycle (docs/serving.md, "The pipeline in the batch"): the lanes of
several sequences in one pass over the core layers.

    input_ids_BS  ─ embed ─┐
                           Where(row i at depth 0) ─▶ one core loop (row i at loop i % R:
    carried_BWH   ─────────┘  RowAttention on slot (i % R, l), batch entry sequences[i],
                              position positions[i]) ─▶ loop-norm ─▶ head ─▶ next_token_ids_BS,
                              logits_BSV, hidden_BWH_out (every row's normed state)

Rows are grouped by sequence slot, R rows (one lane per depth) per slot: row i = slot·R + depth.
The call's row count is symbolic, so a step over the occupied slots 0..w-1 runs w·R rows (the
``row_buffers`` attribute names the pairs of R·max_batch rows; a call reads its prefix). Which
(loop, layer) slot a row uses is fixed by its index; its sequence and position are data:
``row_address_W2[i]`` = (batch entry, position), position -1 for an unused row (it writes
nothing). A depth-0 row takes its entering token's embedding, a deeper row the state the host
carried from the lane's previous call. A row computes what the one-sequence cycle
(graphs/cycles.py) computes for its lane at that depth and position, bit for bit where rows are
exact (exact_verify): the same embed, core layers, loop-norm and head, and RowAttention rows do
not depend on the other rows of the call.
"""

from __future__ import annotations

import onnx_ir as ir
from loopcast.graphs import blocks
from loopcast.graphs.builder import GraphBuilder
from loopcast.graphs.ops import op_set_builders

from loopcast.config import ModelConfig
from loopcast.manifest import GraphSpec
from loopcast.vocab import GraphKind, OpSet, has_cycle

BATCH = "batch"  # the KV buffers' symbolic batch dimension (ort_runtime/loading/artifact.py BATCH_DIM)


def cycle_batch_lanes(rows: int, num_loops: int) -> int:
    """Lanes per depth P of a cycle_batch graph of ``rows`` = R·P rows."""
    if rows % num_loops:
        raise ValueError(f"cycle_batch rows {rows} must be a multiple of the {num_loops} loops")
    return rows // num_loops


def build_cycle_batch(
    config: ModelConfig,
    dtype: ir.DataType,
    max_length: int,
    b: GraphBuilder,
    *,
    op_set: OpSet | str,
    lanes: int,
) -> tuple[ir.Model, GraphSpec]:
    """``lanes`` = P rows per depth; the graph has W = R·P rows."""
    if not has_cycle(config, op_set):
        raise ValueError(
            "cycle_batch needs a looped model without prelude or coda and the loopcast attention op"
        )
    R, L, H, P = config.num_loops, config.num_layers, config.hidden_size, lanes
    W = R * P  # the most rows a call takes; a call's row count is the symbolic "rows"
    token_ids = b.input("input_ids_BS", ir.DataType.INT64, [1, "rows"])
    carried = b.input("carried_BWH", dtype, [1, "rows", H])
    address = b.input("row_address_W2", ir.DataType.INT32, ["rows", 2])
    columns = []
    for c, name in enumerate(("sequences", "positions")):
        column = b.op(
            "Slice",
            [
                address,
                b.const_i64(f"{name}_start", [c]),
                b.const_i64(f"{name}_end", [c + 1]),
                b.const_i64("columns_axis", [1]),
            ],
            path=f"/rows/{name}_column",
            out=f"{name}_W1",
        )
        columns.append(
            b.op("Reshape", [column, b.const_i64("shape_W", [-1])], path=f"/rows/{name}", out=f"{name}_W")
        )
    sequences, positions = columns
    # which of the call's rows enter at depth 0: the first "rows" of a fixed pattern
    n_rows = b.op("Shape", [address], path="/rows/count", out="rows_1", start=0, end=1)
    entering_pattern = b.const_bool("entering_pattern_W", [i % R == 0 for i in range(W)])
    entering_mask = b.op(
        "Slice",
        [entering_pattern, b.const_i64("pattern_start", [0]), n_rows],
        path="/rows/entering",
        out="entering_W",
    )
    entering_mask = b.op(
        "Unsqueeze",
        [entering_mask, b.const_i64("entering_axes", [0, 2])],
        path="/rows/entering_1W1",
        out="entering_1W1",
    )
    step = blocks.StepInputs(
        seqlens_k=None,
        total_sequence_length=None,
        cos_cache=b.weight("rotary.cos_SD2"),
        sin_cache=b.weight("rotary.sin_SD2"),
    )
    ctx = blocks.BlockContext(
        config,
        dtype,
        max_length,
        step,
        op_set_builders(op_set),
        batch=BATCH,
        batch_rows=-1,  # the head's [1, rows, V]: the call's rows are one batch entry of activations
        rows=blocks.RowAddresses(positions, sequences=sequences),
    )
    entering = blocks.embed(b, token_ids)
    x = b.op("Where", [entering_mask, entering, carried], path="/cycle/lanes", out="lanes_BWH")
    sites = [
        blocks.LayerSite(
            f"layers.{l}",
            tuple(config.core_slot(i % R, l) for i in range(W)),  # row i at loop i % R
            f"/cycle/layer{l}",
            f"cycle.layer{l}",
            ("/cycle/loop_norm", "cycle.normed_BWH") if l == L - 1 else None,
        )
        for l in range(L)
    ]
    x, _ = ctx.ops.stack(b, x, sites, ctx)
    b.output(x, dtype, [1, "rows", H], "hidden_BWH_out")
    blocks.greedy_outputs(b, blocks.lm_head(b, x, ctx), "rows", config.vocab_size)
    model = b.build(
        GraphKind.CYCLE_BATCH, "batched pipeline cycle: lanes of several sequences, row i at loop i % R"
    )
    return model, b.spec(GraphKind.CYCLE_BATCH, f"{GraphKind.CYCLE_BATCH}.onnx", W, 0, R)
