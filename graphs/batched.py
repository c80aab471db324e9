"""Batched kinds (docs/serving.md): one call steps several sequences.

    decode_batch = embed → prelude → loops 0..R-1 → coda → head      ([B, 1] rows, B symbolic)
    verify_batch = embed → prelude → loops 0..R-1 → coda → head      ([B, W] rows: pending + drafts)
    draft_batch  = embed → prelude → loops 0..d-1 → coda → head, + hidden at depth d   ([B, 1] rows)
    verify_tail_batch = hidden at depth d → loops d..R-1 → coda → head             ([B, W] rows)

Batch entry b is sequence slot b: its row reads and writes batch entry b of every per-(loop,
layer) KV buffer ``[B, H_kv, S_max, D]`` at its own position ``seqlens_k[b]`` (both attention
ops take per-entry lengths), so the sequences share the weights' loads and nothing else. A
row's arithmetic is the single-sequence decode row's: the attention op computes each (entry,
head) on its own, and the norms, the MatMuls (MLAS on the CPU, measured row-invariant by the
exporter's exactness check) and the argmax work per row; tests/ort_runtime/test_batch_decode.py
checks batched greedy against single-sequence greedy token for token. A verify_batch entry is
the verify graph's W rows of its sequence (positions n_b..n_b+W-1, ``seqlens_k[b] = n_b+W-1``).
draft_batch and verify_tail_batch are the draft and verify_tail graphs (graphs/kinds.py) the same
way: the self-speculation round of several sequences (ort_runtime/batching/self_round.py), a
row addressed by its sequence (batch entry), its position (``seqlens_k[b]``) and the depths of its
kind, built from the same stack call as the one-sequence kind so that each row carries its bits.

B is symbolic so that a runtime can run only the occupied prefix of its slots; the manifest's
``max_batch`` is the number of slots a runtime allocates.
"""

from __future__ import annotations

import onnx_ir as ir
from loopcast.graphs import blocks
from loopcast.graphs.batched_cycle import build_cycle_batch, cycle_batch_lanes
from loopcast.graphs.builder import GraphBuilder
from loopcast.graphs.ops import op_set_builders
from loopcast.graphs.recurrent import build_recurrent_kind

from loopcast.config import ModelConfig
from loopcast.manifest import GraphSpec
from loopcast.vocab import BATCH_KINDS, RECURRENT_BATCH_KINDS, GraphKind, GraphPlan, OpSet

BATCH = "batch"  # the symbolic batch dimension (ort_runtime/loading/artifact.py BATCH_DIM)


def build_batched_kind(
    kind: GraphKind | str,
    config: ModelConfig,
    dtype: ir.DataType,
    max_length: int,
    b: GraphBuilder,
    *,
    op_set: OpSet | str = OpSet.STOCK,
    rows: int = 1,
    loops: tuple[int, int] | None = None,
) -> tuple[ir.Model, GraphSpec]:
    """``loops``: the (first, last) loops the kind runs (default all; draft_batch 0..d,
    verify_tail_batch d..R)."""
    if kind not in BATCH_KINDS:
        raise ValueError(f"unknown batched kind {kind!r}")
    R = config.num_loops
    if kind in RECURRENT_BATCH_KINDS:  # prelude_batch, core_step_batch, coda_batch
        first, last = loops or (0, R)
        plan = GraphPlan(GraphKind(kind), rows, first, last)
        return build_recurrent_kind(plan, config, dtype, max_length, b, op_set=op_set)
    if kind == GraphKind.CYCLE_BATCH:
        lanes = cycle_batch_lanes(rows, R)
        return build_cycle_batch(config, dtype, max_length, b, op_set=op_set, lanes=lanes)
    first, last = loops or (0, R)
    if first == 0:
        token_ids = b.input("input_ids_BS", ir.DataType.INT64, [BATCH, rows])
    else:
        hidden_in = b.input("hidden_BSH", dtype, [BATCH, rows, config.hidden_size])
    step = blocks.StepInputs(
        # per sequence: seqlens_k[b] = n_b + rows - 1 (its rows sit at positions n_b..);
        # total_sequence_length = max_b n_b + rows (GroupQueryAttention's bound over the batch)
        seqlens_k=b.input("seqlens_k", ir.DataType.INT32, [BATCH]),
        total_sequence_length=b.input("total_sequence_length", ir.DataType.INT32, []),
        cos_cache=b.weight("rotary.cos_SD2"),
        sin_cache=b.weight("rotary.sin_SD2"),
    )
    ops = op_set_builders(op_set)
    ctx = blocks.BlockContext(config, dtype, max_length, step, ops, batch=BATCH, batch_rows=rows)
    x = blocks.embed(b, token_ids) if first == 0 else hidden_in
    x, depth_state = ops.stack(b, x, blocks.layer_sites(config, first, last, prelude=first == 0), ctx)
    logits = blocks.lm_head(b, x, ctx)
    blocks.greedy_outputs(b, logits, rows, config.vocab_size, batch=BATCH)
    if kind == GraphKind.DRAFT_BATCH:
        b.output(depth_state, dtype, [BATCH, rows, config.hidden_size], "hidden_BSH_out")
    model = b.build(kind, __doc__.split("\n\n")[0])
    spec = b.spec(GraphKind(kind), f"{kind}.onnx", rows, first, last)
    return model, spec
