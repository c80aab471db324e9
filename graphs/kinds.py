"""Graph kinds (docs/architecture.md §3) as compositions of the blocks:

    prefill     = embed → prelude → loops 0..R-1 → coda → last row → head     (dynamic rows)
    decode      = embed → prelude → loops 0..R-1 → coda → head                (1 row)
    verify      = embed → prelude → loops 0..R-1 → coda → head                (W rows)
    draft       = embed → prelude → loops 0..d-1 → coda → head, + hidden at depth d   (1 row)
    verify_tail = hidden at depth d → loops d..R-1 → coda → head              (W rows)
    cycle, cycle_run: the pipeline's (graphs/cycles.py)
    tree_draft  = draft, row-addressed (RowAttention: own position, masked key range)
                  + top-2 probabilities and ids                                (1 row)
    tree_tail   = verify_tail, row-addressed                                   (W rows)

Loops are unrolled: no Loop/If/Scan, which would block CUDA-graph capture.
"""

from __future__ import annotations

from dataclasses import dataclass

import onnx_ir as ir
from loopcast.graphs import blocks
from loopcast.graphs.builder import GraphBuilder
from loopcast.graphs.cycles import build_cycle, build_cycle_run

from loopcast.config import ModelConfig
from loopcast.manifest import (
    CYCLE,
    CYCLE_RUN,
    DECODE,
    DRAFT,
    LOGIT_ROWS,
    PREFILL,
    TREE_DRAFT,
    TREE_KINDS,
    TREE_TAIL,
    VERIFY,
    VERIFY_TAIL,
    GraphSpec,
    has_cycle,
)


@dataclass(frozen=True)
class KindPlan:
    kind: str
    rows: int | None  # None: dynamic
    first_loop: int
    last_loop: int


def plan_kinds(
    config: ModelConfig,
    verify_width: int,
    draft_depth: int | None,
    *,
    op_set: str = "stock",
    tree: bool = False,
) -> list[KindPlan]:
    R = config.num_loops
    plans = [KindPlan(PREFILL, None, 0, R), KindPlan(DECODE, 1, 0, R), KindPlan(VERIFY, verify_width, 0, R)]
    if draft_depth is not None:
        plans += [KindPlan(DRAFT, 1, 0, draft_depth), KindPlan(VERIFY_TAIL, verify_width, draft_depth, R)]
    if tree and draft_depth is not None:
        plans += [KindPlan(TREE_DRAFT, 1, 0, draft_depth), KindPlan(TREE_TAIL, verify_width, draft_depth, R)]
    if has_cycle(config, op_set):
        plans += [KindPlan(CYCLE, R, 0, R), KindPlan(CYCLE_RUN, R, 0, R)]
    return plans


def build_kind(
    plan: KindPlan,
    config: ModelConfig,
    dtype: ir.DataType,
    max_length: int,
    b: GraphBuilder,
    *,
    op_set: str = "stock",
) -> tuple[ir.Model, GraphSpec]:
    if plan.kind == CYCLE:
        return build_cycle(config, dtype, max_length, b, op_set=op_set)
    if plan.kind == CYCLE_RUN:
        return build_cycle_run(config, dtype, max_length, b, op_set=op_set)
    rows: int | str = plan.rows if plan.rows is not None else "num_rows"
    if plan.first_loop == 0:
        token_ids = b.input("input_ids_BS", ir.DataType.INT64, [1, rows])
    else:
        hidden_in = b.input("hidden_BSH", dtype, [1, rows, config.hidden_size])
    tree = plan.kind in TREE_KINDS
    if tree and op_set == "stock":
        raise ValueError("the tree kinds need the loopcast attention op (RowAttention)")
    step = blocks.StepInputs(
        seqlens_k=None if tree else b.input("seqlens_k", ir.DataType.INT32, [1]),
        total_sequence_length=None if tree else b.input("total_sequence_length", ir.DataType.INT32, []),
        cos_cache=b.weight("rotary.cos_SD2"),
        sin_cache=b.weight("rotary.sin_SD2"),
    )
    batch_invariant = op_set == "loopcast"
    ctx = blocks.BlockContext(
        config,
        dtype,
        max_length,
        step,
        batch_invariant,
        loopcast_attention=op_set == "loopcast-attention",
        **(_tree_addresses(b, plan.rows) if tree else {}),
    )
    x = blocks.embed(b, token_ids) if plan.first_loop == 0 else hidden_in
    if batch_invariant:
        sites = blocks.layer_sites(config, plan.first_loop, plan.last_loop, prelude=plan.first_loop == 0)
        x, depth_state = blocks.decoder_stack(b, x, sites, ctx)
    else:
        if plan.first_loop == 0:
            x = blocks.prelude(b, x, ctx)
        for loop in range(plan.first_loop, plan.last_loop):
            x = blocks.core_loop(b, x, loop, ctx)
        depth_state = x
        x = blocks.coda(b, x, ctx)
    out_rows: int | str = rows
    if plan.kind == PREFILL:
        # Only the last row's next token is needed; slicing first keeps the head at one row.
        # ``logit_rows`` (default 1) asks for the last k rows instead: the CPU runs decode and
        # verify on this graph's session, so one session holds the packed weights
        # (ort_runtime/loading/artifact.py, "Weights").
        start = b.op(
            "Neg", [b.overridable_i64(LOGIT_ROWS, [1])], path="/prefill/logit_start", out="logit_start_1"
        )
        x = b.op(
            "Slice",
            [x, start, b.const_i64("last_end", [2**62]), b.const_i64("rows_axis", [1])],
            path="/prefill/last_rows",
            out="last_rows_BKH",
        )
        out_rows = "logit_rows"
    logits = blocks.lm_head(b, x, ctx)
    blocks.greedy_outputs(b, logits, out_rows, config.vocab_size, with_gap=plan.kind == DRAFT)
    if plan.kind in (DRAFT, TREE_DRAFT):
        b.output(depth_state, dtype, [1, rows, config.hidden_size], "hidden_BSH_out")
    if plan.kind == TREE_DRAFT:
        _top2_probabilities(b, logits, rows)
    model = b.build(plan.kind, __doc__.split("\n\n")[0])
    slots = sorted(int(v.name.split(".")[1]) for v in b.inputs if v.name.startswith("past_key."))
    spec = GraphSpec(
        kind=plan.kind,
        file=f"{plan.kind}.onnx",
        rows=plan.rows,
        first_loop=plan.first_loop,
        last_loop=plan.last_loop,
        kv_slots=slots,
        inputs=[v.name for v in b.inputs],
        outputs=[v.name for v in b.outputs],
    )
    return model, spec


def _tree_addresses(b: GraphBuilder, rows: int) -> dict:
    """The tree kinds' per-row addresses from one int32 input (one host-to-device copy per step):
    ``row_address_S3[i]`` = (cache position, masked lo, masked hi) of row i; -1: inactive row.

        row_address_S3 ─┬─ Slice [:, 0] ─ Reshape ─▶ positions_S
                        └─ Slice [:, 1:3] ────────▶ masked_keys_S2
    """
    address = b.input("row_address_S3", ir.DataType.INT32, [rows, 3])
    column = b.op(
        "Slice",
        [
            address,
            b.const_i64("position_start", [0]),
            b.const_i64("position_end", [1]),
            b.const_i64("columns_axis", [1]),
        ],
        path="/rows/position",
        out="positions_S1",
    )
    positions = b.op(
        "Reshape", [column, b.const_i64("shape_S", [rows])], path="/rows/positions", out="positions_S"
    )
    masked = b.op(
        "Slice",
        [
            address,
            b.const_i64("masked_start", [1]),
            b.const_i64("masked_end", [3]),
            b.const_i64("masked_axis", [1]),
        ],
        path="/rows/masked",
        out="masked_keys_S2",
    )
    return {"row_positions": positions, "row_masked": masked, "row_count": rows}


def _top2_probabilities(b: GraphBuilder, logits_BSV: ir.Value, rows: int) -> None:
    """The two most likely tokens and their probabilities under the full softmax (the
    alternate-suffix proposer forks where they are close): logits ─ Softmax ─ TopK(2) ─▶ probs, ids."""
    probs = b.op("Softmax", [logits_BSV], path="/sample/softmax", out="probs_BSV", axis=-1)
    top_probs, top_ids = b.op_multi(
        "TopK",
        [probs, b.const_i64("k2", [2])],
        path="/sample/top2_probs",
        outs=["top2_probs_BS2", "top2_ids_BS2"],
        axis=-1,
    )
    b.output(top_probs, ir.DataType.FLOAT, [1, rows, 2])
    b.output(top_ids, ir.DataType.INT64, [1, rows, 2])
