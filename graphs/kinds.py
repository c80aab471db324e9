"""Graph kinds (docs/architecture.md §3) as compositions of the blocks:

    prefill     = embed → prelude → loops 0..R-1 → coda → last row → head     (dynamic rows)
    decode      = embed → prelude → loops 0..R-1 → coda → head                (1 row)
    verify      = embed → prelude → loops 0..R-1 → coda → head                (W rows)
    draft       = embed → prelude → loops 0..d-1 → coda → head, + hidden at depth d   (1 row)
    verify_tail = hidden at depth d → loops d..R-1 → coda → head              (W rows)

Loops are unrolled: no Loop/If/Scan, which would block CUDA-graph capture.
"""

from __future__ import annotations

from dataclasses import dataclass

import onnx_ir as ir

from loopcast.config import ModelConfig
from loopcast.graphs import blocks
from loopcast.graphs.builder import GraphBuilder
from loopcast.manifest import DECODE, DRAFT, PREFILL, VERIFY, VERIFY_TAIL, GraphSpec


@dataclass(frozen=True)
class KindPlan:
    kind: str
    rows: int | None          # None: dynamic
    first_loop: int
    last_loop: int


def plan_kinds(config: ModelConfig, verify_width: int, draft_depth: int | None) -> list[KindPlan]:
    R = config.num_loops
    plans = [KindPlan(PREFILL, None, 0, R), KindPlan(DECODE, 1, 0, R), KindPlan(VERIFY, verify_width, 0, R)]
    if draft_depth is not None:
        plans += [KindPlan(DRAFT, 1, 0, draft_depth), KindPlan(VERIFY_TAIL, verify_width, draft_depth, R)]
    return plans


def build_kind(plan: KindPlan, config: ModelConfig, dtype: ir.DataType, max_length: int,
               b: GraphBuilder, *, op_set: str = "stock") -> tuple[ir.Model, GraphSpec]:
    rows: int | str = plan.rows if plan.rows is not None else "num_rows"
    if plan.first_loop == 0:
        token_ids = b.input("input_ids_BS", ir.DataType.INT64, [1, rows])
    else:
        hidden_in = b.input("hidden_BSH", dtype, [1, rows, config.hidden_size])
    step = blocks.StepInputs(
        seqlens_k=b.input("seqlens_k", ir.DataType.INT32, [1]),
        total_sequence_length=b.input("total_sequence_length", ir.DataType.INT32, []),
        cos_cache=b.weight("rotary.cos_SD2"),
        sin_cache=b.weight("rotary.sin_SD2"),
    )
    batch_invariant = op_set == "loopcast"
    ctx = blocks.BlockContext(config, dtype, max_length, step, batch_invariant,
                              loopcast_attention=op_set == "loopcast-attention")
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
    if plan.kind == PREFILL:
        # Only the last row's next token is needed; slicing first keeps the head at one row.
        x = b.op("Slice", [x, b.const_i64("last_start", [-1]), b.const_i64("last_end", [2**62]),
                           b.const_i64("rows_axis", [1])], path="/prefill/last_row", out="last_row_B1H")
    logits = blocks.lm_head(b, x, ctx)
    out_rows = 1 if plan.kind == PREFILL else rows
    blocks.greedy_outputs(b, logits, out_rows, config.vocab_size, with_gap=plan.kind == DRAFT)
    if plan.kind == DRAFT:
        b.output(depth_state, dtype, [1, rows, config.hidden_size], "hidden_BSH_out")
    model = b.build(plan.kind, __doc__.split("\n\n")[0])
    slots = sorted(int(v.name.split(".")[1]) for v in b.inputs if v.name.startswith("past_key."))
    spec = GraphSpec(kind=plan.kind, file=f"{plan.kind}.onnx", rows=plan.rows,
                     first_loop=plan.first_loop, last_loop=plan.last_loop, kv_slots=slots,
                     inputs=[v.name for v in b.inputs], outputs=[v.name for v in b.outputs])
    return model, spec
