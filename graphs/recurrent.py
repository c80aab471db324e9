"""The recurrent-depth kinds (Huginn/Raven; docs/architecture.md §3): prelude, core_step, coda.

A token's forward is composed by the host, so r is chosen per request without ONNX control flow
(no Loop/If: they block CUDA-graph capture):

    prelude   = embed (·√H) → prelude blocks                          → embedded_BSH
    core_step = adapter([state, embedded]) → core blocks              → state_BSH_out   (× r)
    coda      = ln_f → coda blocks → ln_f → head → argmax             → next_token_ids_BS, logits_BSV

Every kind takes dynamic rows (prefill, decode and verify are the same graphs). The batched
kinds (``prelude_batch``, ``core_step_batch``, ``coda_batch``; ``export --max-batch``) are the
same stacks over ``[B, S]`` rows, one sequence per batch entry, its S rows at its own positions
(``seqlens_k[b]``), as graphs/batched.py's (S = 1 a decode step, the drafts' rows a verify).
``core_step_batch`` passes a sequence's states through unchanged where ``active_B[b]`` is false
(its request runs fewer core steps than the call's longest): a selection, so they keep their
bits. core_step's KV inputs are named for step 0's slots (``past_key.{l}``, l = 0..L-1); the
host binds step k's buffers, slots ``k*L + l``, to them for its k-th call (docs/architecture.md
§2). The prelude and coda bind their own slots.

The attention rotates halves: the exporter reorders each q and k head's dims so that the
halves are the release's adjacent pairs (exporter/recurrent_weights.py), so the stock and the
loopcast attention ops both apply (every op set: ``stock``, ``loopcast-attention``, ``loopcast``).

Each block is Huginn's sandwich, the norms after the residual adds (``OpSetBuilders.add_norm``):

    x ─ n1 ─ attn ─(+x)─ n2 ─▶ x1 ─ n3 ─ mlp ─(+x1)─ n4 ─▶
    stock, loopcast-attention: the add and n2, the add and n4: one SkipSimplifiedLayerNormalization
        each; n1, n3 RMSNormalization
    loopcast: n1 one ResidualRMSNorm without a residual; [+x, n2, n3] and [+x1, n4] one
        ResidualRMSNorm each; the projections BatchInvariantMatMul (q/k bias: an Add after it;
        the MLP's SwiGLU inside the down projection), the tied head read in place
"""

from __future__ import annotations

import onnx_ir as ir
from loopcast.graphs import blocks
from loopcast.graphs.builder import GraphBuilder
from loopcast.graphs.ops import op_set_builders

from loopcast.config import ModelConfig
from loopcast.manifest import GraphSpec
from loopcast.vocab import RECURRENT_BATCH_KINDS, GraphKind, GraphPlan, OpSet

EMBED_SCALE = "embed_scale"  # [1] weight: the embedding multiplier (√H)
ADAPTER = "adapter.weight_T"  # [2H, H]: the injection on [state, embedded]


def sandwich_block(
    b: GraphBuilder,
    x_BSH: ir.Value,
    layer: str,
    slot: int | tuple[int, ...],
    ctx: blocks.BlockContext,
    *,
    path: str,
    prefix: str,
) -> ir.Value:
    ops = ctx.ops
    h1 = ops.norm(b, x_BSH, f"{layer}.norm_1.weight", ctx, path=f"{path}/norm_1", out=f"{prefix}.h1_BSH")
    a = blocks.attention(b, h1, layer, slot, ctx, path=f"{path}/attn", prefix=prefix)
    x1, h3 = ops.add_norm(
        b,
        a,
        x_BSH,
        f"{layer}.norm_2.weight",
        f"{layer}.norm_3.weight",
        ctx,
        path=f"{path}/attn_residual_norm",
        prefix=f"{prefix}.res1",
    )
    assert h3 is not None
    m = ops.mlp(b, h3, layer, ctx, path=f"{path}/mlp", prefix=prefix)
    out, _ = ops.add_norm(
        b,
        m,
        x1,
        f"{layer}.norm_4.weight",
        None,
        ctx,
        path=f"{path}/mlp_residual_norm",
        prefix=f"{prefix}.res2",
    )
    return out


def prelude_blocks(b: GraphBuilder, ids_BS: ir.Value, ctx: blocks.BlockContext) -> ir.Value:
    """embed (·√H) → prelude blocks → embedded_BSH (the injection every core step reads)."""
    config = ctx.config
    x = b.op("Mul", [blocks.embed(b, ids_BS), b.weight(EMBED_SCALE)], path="/embed/scale", out="scaled_BSH")
    for i in range(config.num_prelude_layers):
        x = sandwich_block(
            b,
            x,
            f"prelude_layers.{i}",
            config.prelude_slot(i),
            ctx,
            path=f"/prelude/layer{i}",
            prefix=f"prelude.layer{i}",
        )
    return x


def core_step_blocks(
    b: GraphBuilder, injected_BS2H: ir.Value, slots: list, ctx: blocks.BlockContext
) -> ir.Value:
    """adapter([state, embedded]) → core blocks → the next state. ``slots[l]``: layer l's KV slot
    (a tuple of one slot per row in a row-addressed graph)."""
    x = ctx.ops.linear(b, injected_BS2H, ADAPTER, path="/step/adapter", out="adapted_BSH")
    for l, slot in enumerate(slots):
        x = sandwich_block(b, x, f"layers.{l}", slot, ctx, path=f"/step/layer{l}", prefix=f"step.layer{l}")
    return x


def coda_blocks(b: GraphBuilder, state_BSH: ir.Value, ctx: blocks.BlockContext) -> ir.Value:
    """ln_f → coda blocks → ln_f → head: the logits."""
    config = ctx.config
    x = ctx.ops.norm(b, state_BSH, "norm.weight", ctx, path="/coda/ln_f_in", out="coda_in_BSH")
    for i in range(config.num_coda_layers):
        x = sandwich_block(
            b,
            x,
            f"coda_layers.{i}",
            config.coda_slot(i),
            ctx,
            path=f"/coda/layer{i}",
            prefix=f"coda.layer{i}",
        )
    x = ctx.ops.norm(b, x, "norm.weight", ctx, path="/coda/ln_f_out", out="coda_out_BSH")
    return blocks.lm_head(b, x, ctx)


# a batched kind -> the single-sequence kind whose stack it runs
_SINGLE = {
    GraphKind.PRELUDE_BATCH: GraphKind.PRELUDE,
    GraphKind.CORE_STEP_BATCH: GraphKind.CORE_STEP,
    GraphKind.CODA_BATCH: GraphKind.CODA,
}
BATCH = "batch"  # the symbolic batch dimension (graphs/batched.py's)


def build_recurrent_kind(
    plan: GraphPlan,
    config: ModelConfig,
    dtype: ir.DataType,
    max_length: int,
    b: GraphBuilder,
    *,
    op_set: OpSet | str = OpSet.STOCK,
) -> tuple[ir.Model, GraphSpec]:
    batched = plan.kind in RECURRENT_BATCH_KINDS
    batch: int | str = BATCH if batched else 1
    rows = "num_rows"  # batched: rows per sequence (1 for a decode step, its drafts' for a verify)
    kind = _SINGLE.get(plan.kind, plan.kind)
    hidden = [batch, rows, config.hidden_size]
    step = blocks.StepInputs(
        # batched: seqlens_k[b] = n_b + rows - 1 (each sequence's rows at its own positions)
        seqlens_k=b.input("seqlens_k", ir.DataType.INT32, [batch]),
        total_sequence_length=b.input("total_sequence_length", ir.DataType.INT32, []),
        cos_cache=b.weight("rotary.cos_SD2"),
        sin_cache=b.weight("rotary.sin_SD2"),
    )
    ctx = blocks.BlockContext(
        config, dtype, max_length, step, op_set_builders(op_set), batch=batch, batch_rows=0 if batched else 1
    )
    if kind == GraphKind.PRELUDE:
        ids = b.input("input_ids_BS", ir.DataType.INT64, [batch, rows])
        b.output(prelude_blocks(b, ids, ctx), dtype, hidden, "embedded_BSH")
    elif kind == GraphKind.CORE_STEP:
        state = b.input("state_BSH", dtype, hidden)
        embedded = b.input("embedded_BSH", dtype, hidden)
        joined = b.op("Concat", [state, embedded], path="/step/inject", out="injected_BS2H", axis=-1)
        slots = [config.core_slot(0, l) for l in range(config.num_layers)]
        out = core_step_blocks(b, joined, slots, ctx)
        if batched:
            active = b.input("active_B", ir.DataType.BOOL, [batch])
            active_B11 = b.op(
                "Unsqueeze",
                [active, b.const_i64("active_axes", [1, 2])],
                path="/step/active",
                out="active_B11",
            )
            out = b.op("Where", [active_B11, out, state], path="/step/keep_inactive", out="kept_BSH")
        b.output(out, dtype, hidden, "state_BSH_out")
    elif kind == GraphKind.CODA:
        state = b.input("state_BSH", dtype, hidden)
        blocks.greedy_outputs(b, coda_blocks(b, state, ctx), rows, config.vocab_size, batch=batch)
    else:
        raise ValueError(f"{plan.kind} is not a recurrent-depth kind")
    model = b.build(plan.kind, __doc__.split("\n\n")[0])
    spec = b.spec(plan.kind, f"{plan.kind}.onnx", plan.rows, plan.first_loop, plan.last_loop)
    return model, spec
