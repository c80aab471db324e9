"""Graph kinds (docs/architecture.md §3) as compositions of the blocks:

    prefill     = embed → prelude → loops 0..R-1 → coda → last row → head     (dynamic rows)
    decode      = embed → prelude → loops 0..R-1 → coda → head                (1 row)
    verify      = embed → prelude → loops 0..R-1 → coda → head                (W rows)
    draft       = embed → prelude → loops 0..d-1 → coda → head, + hidden at depth d   (1 row)
    verify_tail = hidden at depth d → loops d..R-1 → coda → head              (W rows)
    cycle, cycle_run: the pipeline's (graphs/cycles.py)
    prelude, core_step, coda: the recurrent-depth family's (graphs/recurrent.py)
    recurrent_cycle: its pipeline's (graphs/recurrent_cycles.py)
    tree_draft  = draft, row-addressed (RowAttention: own position, masked key range)
                  + top-2 probabilities and ids                                (1 row)
    tree_tail   = verify_tail, row-addressed                                   (W rows)
    prefill@k, decode@k, verify@k = prefill, decode, verify stopped after loop k-1 (static depth:
                  loops 0..k-1, the loop-norm, the head; the deeper loops' KV is not written)
    exits       = embed → loop 0 → … → loop R-1, the head and the exit gate on every loop's
                  normed state                                                (1 row, R outputs)
    loop_embed, loop_step, exit_head: the exit gate's loop-skipping path (graphs/loop_steps.py)

Loops are unrolled: no Loop/If/Scan, which would block CUDA-graph capture.
"""

from __future__ import annotations

import onnx_ir as ir
from loopcast.graphs import blocks
from loopcast.graphs.builder import GraphBuilder
from loopcast.graphs.cycles import build_cycle, build_cycle_run
from loopcast.graphs.loop_steps import build_loop_step_kind
from loopcast.graphs.ops import op_set_builders
from loopcast.graphs.recurrent import build_recurrent_kind
from loopcast.graphs.recurrent_cycles import build_recurrent_cycle

from loopcast.config import ModelConfig
from loopcast.manifest import LOGIT_START, GraphSpec
from loopcast.vocab import (
    BATCH_KINDS,
    LOOP_STEP_KINDS,
    RECURRENT_KINDS,
    TREE_KINDS,
    GraphKind,
    GraphPlan,
    OpSet,
    graph_plan,
)

KindPlan = GraphPlan  # one graph's kind, rows and loops (loopcast/vocab.py)


def plan_kinds(
    config: ModelConfig,
    verify_width: int,
    draft_depth: int | None,
    *,
    op_set: OpSet | str = OpSet.STOCK,
    tree: bool = False,
    exit_depths: tuple[int, ...] = (),
) -> list[GraphPlan]:
    """The single-sequence kinds of ``graph_plan`` (this module builds them; the batched kinds
    are graphs/batched.py's)."""
    plans = graph_plan(
        config,
        op_set,
        verify_width=verify_width,
        draft_depth=draft_depth,
        tree=tree,
        exit_depths=exit_depths,
    )
    return [plan for plan in plans if plan.kind not in BATCH_KINDS]


def build_kind(
    plan: GraphPlan,
    config: ModelConfig,
    dtype: ir.DataType,
    max_length: int,
    b: GraphBuilder,
    *,
    op_set: OpSet | str = OpSet.STOCK,
) -> tuple[ir.Model, GraphSpec]:
    if plan.kind == GraphKind.CYCLE:
        return build_cycle(config, dtype, max_length, b, op_set=op_set)
    if plan.kind == GraphKind.CYCLE_RUN:
        return build_cycle_run(config, dtype, max_length, b, op_set=op_set)
    if plan.kind == GraphKind.EXITS:
        return _build_exits(plan, config, dtype, max_length, b, op_set)
    if plan.kind in LOOP_STEP_KINDS:
        return build_loop_step_kind(plan, config, dtype, max_length, b, op_set=op_set)
    if plan.kind == GraphKind.RECURRENT_CYCLE:
        return build_recurrent_cycle(config, dtype, max_length, b, op_set=op_set)
    if plan.kind in RECURRENT_KINDS:
        return build_recurrent_kind(plan, config, dtype, max_length, b, op_set=op_set)
    rows: int | str = plan.rows if plan.rows is not None else "num_rows"
    if plan.first_loop == 0:
        token_ids = b.input("input_ids_BS", ir.DataType.INT64, [1, rows])
    else:
        hidden_in = b.input("hidden_BSH", dtype, [1, rows, config.hidden_size])
    tree = plan.kind in TREE_KINDS
    ops = op_set_builders(op_set)
    if tree and not ops.op_set.loopcast_attention:
        raise ValueError("the tree kinds need the loopcast attention op (RowAttention)")
    step = blocks.StepInputs(
        seqlens_k=None if tree else b.input("seqlens_k", ir.DataType.INT32, [1]),
        total_sequence_length=None if tree else b.input("total_sequence_length", ir.DataType.INT32, []),
        cos_cache=b.weight("rotary.cos_SD2"),
        sin_cache=b.weight("rotary.sin_SD2"),
    )
    ctx = blocks.BlockContext(
        config, dtype, max_length, step, ops, rows=_tree_addresses(b, plan.rows) if tree else None
    )
    x = blocks.embed(b, token_ids) if plan.first_loop == 0 else hidden_in
    sites = blocks.layer_sites(config, plan.first_loop, plan.last_loop, prelude=plan.first_loop == 0)
    x, depth_state = ops.stack(b, x, sites, ctx)
    out_rows: int | str = rows
    if plan.kind == GraphKind.PREFILL:
        # Only the last row's next token is needed; slicing first keeps the head at one row.
        # ``logit_start`` = -k (default -1) asks for the last k rows instead: the CPU runs decode
        # and verify on this graph's session, so one session holds the packed weights
        # (ort_runtime/loading/artifact.py, "Weights"). Slice reads its starts on the host, so
        # they come straight from the input: a node computing them would run on the CPU, and ORT
        # refuses to capture a CUDA graph with a CPU node in it (captured prefill chunks).
        x = b.op(
            "Slice",
            [
                x,
                b.overridable_i64(LOGIT_START, [-1]),
                b.const_i64("last_end", [2**62]),
                b.const_i64("rows_axis", [1]),
            ],
            path="/prefill/last_rows",
            out="last_rows_BKH",
        )
        out_rows = "logit_rows"
    logits = blocks.lm_head(b, x, ctx)
    blocks.greedy_outputs(b, logits, out_rows, config.vocab_size, with_gap=plan.kind == GraphKind.DRAFT)
    if plan.kind in (GraphKind.DRAFT, GraphKind.TREE_DRAFT):
        b.output(depth_state, dtype, [1, rows, config.hidden_size], "hidden_BSH_out")
    if plan.kind == GraphKind.TREE_DRAFT:
        _top2_probabilities(b, logits, rows)
    model = b.build(plan.key, __doc__.split("\n\n")[0])
    spec = b.spec(plan.kind, graph_file(plan), plan.rows, plan.first_loop, plan.last_loop)
    return model, spec


def _build_exits(
    plan: GraphPlan, config: ModelConfig, dtype: ir.DataType, max_length: int, b: GraphBuilder, op_set
) -> tuple[ir.Model, GraphSpec]:
    """One row through every loop; each loop's normed state goes to the head and the gate:

        ids ─ embed ─ loop 0 ─▶ s0 ─ loop 1 ─▶ s1 … ─ loop R-1 ─▶ s_{R-1}
                                 └──────── Concat [1, R, H] ─┬─ head ─ ArgMax ─▶ next_token_ids [1, R]
                                                             └─ gate (MatMul + bias) ─▶ exit_gates [1, R]

    Each loop is its own stack call, which opens with the norm a verify_tail graph opens with, so
    every state carries the bits of the decode graph's (graphs/blocks.py decoder_stack).
    """
    R = config.num_loops
    ops = op_set_builders(op_set)
    token_ids = b.input("input_ids_BS", ir.DataType.INT64, [1, 1])
    step = blocks.StepInputs(
        seqlens_k=b.input("seqlens_k", ir.DataType.INT32, [1]),
        total_sequence_length=b.input("total_sequence_length", ir.DataType.INT32, []),
        cos_cache=b.weight("rotary.cos_SD2"),
        sin_cache=b.weight("rotary.sin_SD2"),
    )
    ctx = blocks.BlockContext(config, dtype, max_length, step, ops)
    x = blocks.embed(b, token_ids)
    states = []
    for loop in range(R):
        x, state = ops.stack(b, x, blocks.layer_sites(config, loop, loop + 1, prelude=False), ctx)
        states.append(state)
    states_BRH = b.op("Concat", states, path="/exits/states", out="exit_states_BRH", axis=1)
    logits = blocks.lm_head(b, states_BRH, ctx)
    blocks.greedy_outputs(b, logits, R, config.vocab_size)
    gate = b.op(
        "MatMul",
        [states_BRH, b.weight("early_exit_gate.weight_T")],
        path="/exits/gate",
        out="exit_gate_BR1_nobias",
    )
    gate = b.op("Add", [gate, b.weight("early_exit_gate.bias")], path="/exits/gate/bias", out="exit_gate_BR1")
    if dtype != ir.DataType.FLOAT:
        gate = b.op("Cast", [gate], path="/exits/gate/cast", out="exit_gate_f32_BR1", to=ir.DataType.FLOAT)
    gate = b.op(
        "Squeeze", [gate, b.const_i64("gate_axis", [-1])], path="/exits/gate/squeeze", out="exit_gates_BR"
    )
    b.output(gate, ir.DataType.FLOAT, [1, R])
    model = b.build(plan.key, __doc__.split("\n\n")[0])
    spec = b.spec(plan.kind, graph_file(plan), plan.rows, plan.first_loop, plan.last_loop)
    return model, spec


def graph_file(plan: GraphPlan) -> str:
    """The ONNX file of a planned graph: ``decode.onnx``, ``decode_depth2.onnx`` (static depth 2)."""
    return f"{plan.kind}.onnx" if plan.depth is None else f"{plan.kind}_depth{plan.depth}.onnx"


def _tree_addresses(b: GraphBuilder, rows: int) -> blocks.RowAddresses:
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
    return blocks.RowAddresses(positions, masked, rows)


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
