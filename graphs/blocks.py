"""Block builders: one function per architectural block, taking and returning values.

A graph kind (``graphs/kinds.py``) is a composition of these; a change to a block is made once.
Value names carry shapes: B batch (1), S new rows, H hidden, Q packed q|k|v width, I
intermediate, V vocab, Hkv KV heads, T KV capacity (max length), D head dim.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import onnx_ir as ir
from loopcast.graphs.builder import LOOPCAST_DOMAIN, MS_DOMAIN, GraphBuilder

from loopcast.config import ModelConfig
from loopcast.quant import EMBEDDING

if TYPE_CHECKING:
    from loopcast.graphs.ops import OpSetBuilders


@dataclass(frozen=True)
class StepInputs:
    """Per-step values every attention block reads (docs/architecture.md §2: the host owns n).

    For M new rows at positions n..n+M-1: ``seqlens_k = n+M-1`` (int32 [B]) and
    ``total_sequence_length = n+M`` (int32 scalar), GroupQueryAttention's contract.
    """

    seqlens_k: ir.Value | None  # None in row-addressed graphs (per-row positions)
    total_sequence_length: ir.Value | None
    cos_cache: ir.Value
    sin_cache: ir.Value


@dataclass(frozen=True)
class RowAddresses:
    """Row-addressed graphs (the pipeline cycle, the tree kinds; docs/architecture.md §3 "Row
    addressing"): the attention blocks take one KV slot per row (RowAttention) instead of one
    slot for all rows."""

    positions: ir.Value  # per-row cache positions [S] int32 (-1: an inactive row)
    # Tree kinds: per-row masked key ranges [S, 2] int32 (RowAttention input 3), and the rows S,
    # every one at the layer's own slot.
    masked: ir.Value | None = None
    count: int = 1
    # The cycle run (K cycles in one graph): RowAttention writes K/V into the bound input buffers
    # and the graph declares no present outputs.
    kv_in_place: bool = False
    # The batched cycle (graphs/batched_cycle.py): per-row batch entry of the KV buffers [S]
    # int32 (RowAttention input 2); None: entry 0 of one-sequence buffers.
    sequences: ir.Value | None = None


@dataclass(frozen=True)
class BlockContext:
    config: ModelConfig
    dtype: ir.DataType
    max_length: int
    step: StepInputs
    ops: OpSetBuilders  # the op set's linear, attention and norms (graphs/ops.py)
    # The batch dimension B of every activation and KV buffer: 1 for the single-sequence kinds;
    # the batched kinds (graphs/batched.py) take one row per sequence and a symbolic B.
    batch: int | str = 1
    # rows per sequence in a batched kind (decode_batch 1, verify_batch W); -1: the batched
    # cycle's activations, one entry of a symbolic row count (graphs/batched_cycle.py); 0: a
    # symbolic count per sequence (the recurrent batched kinds, graphs/recurrent.py)
    batch_rows: int = 1
    rows: RowAddresses | None = None  # row-addressed graphs only


@dataclass(frozen=True)
class LayerSite:
    """One application of a decoder layer in the unrolled graph."""

    weights: str  # weight prefix, e.g. "layers.3"
    slot: int | tuple[int, ...]  # KV slot; row-addressed graphs: one slot per row
    path: str  # node-name path, e.g. "/loop1/layer3"
    prefix: str  # value-name prefix
    # The loop-norm follows (last layer of a core loop): its node path and output name when it is
    # a node of its own (the stock norms; the fused stack folds it into ResidualRMSNorm).
    loop_norm: tuple[str, str] | None


def layer_sites(config: ModelConfig, first_loop: int, last_loop: int, *, prelude: bool) -> list[LayerSite]:
    """The layers a graph applies, in order: prelude, core loops first_loop..last_loop-1, coda."""
    sites = []
    if prelude:
        sites += [
            LayerSite(
                f"prelude_layers.{i}",
                config.prelude_slot(i),
                f"/prelude/layer{i}",
                f"prelude.layer{i}",
                None,
            )
            for i in range(config.num_prelude_layers)
        ]
    for loop in range(first_loop, last_loop):
        sites += [
            LayerSite(
                f"layers.{i}",
                config.core_slot(loop, i),
                f"/loop{loop}/layer{i}",
                f"loop{loop}.layer{i}",
                (f"/loop{loop}/loop_norm", f"loop{loop}.normed_BSH") if i == config.num_layers - 1 else None,
            )
            for i in range(config.num_layers)
        ]
    sites += [
        LayerSite(f"coda_layers.{i}", config.coda_slot(i), f"/coda/layer{i}", f"coda.layer{i}", None)
        for i in range(config.num_coda_layers)
    ]
    return sites


def rms_norm(
    b: GraphBuilder, x: ir.Value, weight: str, ctx: BlockContext, *, path: str, out: str
) -> ir.Value:
    # stash_type=1: statistics in fp32 whatever the model dtype, as the reference does.
    return b.op(
        "RMSNormalization",
        [x, b.weight(weight)],
        path=path,
        out=out,
        axis=-1,
        epsilon=ctx.config.rms_norm_eps,
        stash_type=1,
    )


def residual_rms_norm(
    b: GraphBuilder,
    branch: ir.Value,
    residual: ir.Value,
    weight: str,
    ctx: BlockContext,
    *,
    path: str,
    prefix: str,
) -> tuple[ir.Value, ir.Value]:
    """``x = residual + branch; h = rms(x)·g`` in one fused contrib op; returns (h, x).

    SkipSimplifiedLayerNormalization outputs: 0 normed, 1 mean, 2 inv_std_var, 3 input+skip.
    """
    normed, _, _, summed = b.op_multi(
        "SkipSimplifiedLayerNormalization",
        [branch, residual, b.weight(weight)],
        path=path,
        outs=[f"{prefix}.normed_BSH", f"{prefix}.mean", f"{prefix}.inv_std", f"{prefix}.sum_BSH"],
        domain=MS_DOMAIN,
        epsilon=ctx.config.rms_norm_eps,
    )
    return normed, summed


def fused_residual_norm(
    b: GraphBuilder,
    branch: ir.Value,
    residual: ir.Value | None,
    ctx: BlockContext,
    *,
    branch_weight: str | None,
    loop_weight: str | None,
    out_weight: str | None,
    path: str,
    prefix: str,
) -> tuple[ir.Value, ir.Value | None]:
    """loopcast.ResidualRMSNorm: ``x = residual + n_b(branch)``, then ``x = n_loop(x)``, and
    ``h = n_out(x)``, each part optional; returns (x, h or None). One kernel per call."""
    weights = [b.weight(w) if w else None for w in (branch_weight, loop_weight, out_weight)]
    outs = [f"{prefix}.sum_BSH"] + ([f"{prefix}.normed_BSH"] if out_weight else [])
    values = b.op_multi(
        "ResidualRMSNorm",
        [branch, residual, *weights],
        path=path,
        outs=outs,
        domain=LOOPCAST_DOMAIN,
        epsilon=ctx.config.rms_norm_eps,
    )
    return values[0], (values[1] if out_weight else None)


def decoder_stack(
    b: GraphBuilder, x_BSH: ir.Value, sites: list[LayerSite], ctx: BlockContext
) -> tuple[ir.Value, ir.Value | None]:
    """The layers of ``sites`` with fused norms (loopcast.ResidualRMSNorm); returns (x, x after
    the last loop-norm).

    Each residual add carries its neighbouring norms, and the norm that opens the next layer
    (the loop-norm too, at the end of a loop), so after the stack's first norm a layer is
    attention, one ResidualRMSNorm, the MLP, one ResidualRMSNorm:

        x ─ n1 ─▶ h ─ attn ─▶ a ─ [x += n2(a); h = n3(x)] ─ mlp ─▶ m ─
                                          ─ [x += n4(m); (x = n_loop(x)); h = n1'(x)] ─▶

    The first norm is the same op without a residual, not a stock RMSNormalization: a
    verify_tail graph opens its stack on the hidden state that the full graph normalises inside
    a fused op, and its rows must carry the same bits.
    """
    if not sites:
        return x_BSH, None
    sandwich = ctx.config.sandwich_norm
    _, h = fused_residual_norm(
        b,
        x_BSH,
        None,
        ctx,
        branch_weight=None,
        loop_weight=None,
        out_weight=f"{sites[0].weights}.input_layernorm.weight",
        path=f"{sites[0].path}/input_norm",
        prefix=f"{sites[0].prefix}.res0",
    )
    depth_state = None
    for i, site in enumerate(sites):
        layer, nxt = site.weights, (sites[i + 1] if i + 1 < len(sites) else None)
        a = attention(b, h, layer, site.slot, ctx, path=f"{site.path}/attn", prefix=site.prefix)
        x_BSH, h = fused_residual_norm(
            b,
            a,
            x_BSH,
            ctx,
            branch_weight=f"{layer}.input_layernorm_2.weight" if sandwich else None,
            loop_weight=None,
            out_weight=f"{layer}.post_attention_layernorm.weight",
            path=f"{site.path}/attn_residual_norm",
            prefix=f"{site.prefix}.res1",
        )
        m = ctx.ops.mlp(b, h, layer, ctx, path=f"{site.path}/mlp", prefix=site.prefix)
        x_BSH, h = fused_residual_norm(
            b,
            m,
            x_BSH,
            ctx,
            branch_weight=f"{layer}.post_attention_layernorm_2.weight" if sandwich else None,
            loop_weight="norm.weight" if site.loop_norm is not None else None,
            out_weight=f"{nxt.weights}.input_layernorm.weight" if nxt else None,
            path=f"{site.path}/mlp_residual_norm",
            prefix=f"{site.prefix}.res2",
        )
        if site.loop_norm is not None:
            depth_state = x_BSH
    return x_BSH, depth_state


def kv_buffer_shape(b: GraphBuilder, ctx: BlockContext) -> list[int | str]:
    """[B, H_kv, T, D] of a slot's K or V buffer; D is the stored head size (padded heads:
    exporter/head_padding.py), which the attention ops also read off the packed q|k|v width."""
    cfg = ctx.config
    return [ctx.batch, cfg.num_kv_heads, ctx.max_length, b.head_size or cfg.head_dim]


def attention(
    b: GraphBuilder,
    h_BSH: ir.Value,
    layer: str,
    slot: int | tuple[int, ...],
    ctx: BlockContext,
    *,
    path: str,
    prefix: str,
) -> ir.Value:
    """Self-attention over the static KV buffers of ``slot`` (bound as past and present).

        h ─ qkv_proj ─▶ qkv_BSQ ─▶ GroupQueryAttention(rotary, KV write at n.., causal) ─ o_proj ─▶
                                          ▲ past_key.{slot}  ▼ present_key.{slot} (same buffer)

    In a row-addressed graph ``slot`` holds one slot per row and RowAttention reads and writes
    row i's slot at row i's position (docs/architecture.md §3, "Row addressing").
    """
    cfg = ctx.config
    # A q/k/v bias is added before GroupQueryAttention applies rotary, as upstream models do.
    qkv = ctx.ops.linear(
        b,
        h_BSH,
        f"{layer}.qkv_proj.weight_T",
        path=f"{path}/qkv_proj",
        out=f"{prefix}.qkv_BSQ",
        bias=f"{layer}.qkv_proj.bias" if cfg.qkv_bias else None,
    )
    if ctx.rows is not None and isinstance(slot, int):
        slot = (slot,) * ctx.rows.count  # tree kinds: every row reads and writes the layer's slot
    if isinstance(slot, tuple):
        attn = _row_attention(b, qkv, slot, ctx, path=path, prefix=prefix)
        return ctx.ops.linear(
            b,
            attn,
            f"{layer}.o_proj.weight_T",
            path=f"{path}/o_proj",
            out=f"{prefix}.attn_out_BSH",
            bias=f"{layer}.o_proj.bias" if cfg.o_bias else None,
        )
    kv_shape = kv_buffer_shape(b, ctx)
    past_key = b.input(f"past_key.{slot}", ctx.dtype, kv_shape)
    past_value = b.input(f"past_value.{slot}", ctx.dtype, kv_shape)
    # Inputs in schema order: query (packed q|k|v), key, value (empty: packed), past_key,
    # past_value, seqlens_k, total_sequence_length, cos_cache, sin_cache; trailing optional
    # inputs 9.. (position_ids, attention_bias, head_sink) are not used. The batch-invariant op
    # takes the same inputs and attributes.
    op_type, domain = ctx.ops.attention_op
    attn, present_key, present_value = b.op_multi(
        op_type,
        [
            qkv,
            None,
            None,
            past_key,
            past_value,
            ctx.step.seqlens_k,
            ctx.step.total_sequence_length,
            ctx.step.cos_cache,
            ctx.step.sin_cache,
        ],
        path=f"{path}/gqa",
        outs=[f"{prefix}.attn_BSHD", f"present_key.{slot}", f"present_value.{slot}"],
        domain=domain,
        num_heads=cfg.num_heads,
        kv_num_heads=cfg.num_kv_heads,
        do_rotary=1,
        rotary_interleaved=0,
        scale=cfg.head_dim**-0.5,  # explicit: padded heads must keep 1/sqrt(head_dim)
    )
    b.output(present_key, ctx.dtype, kv_shape)
    b.output(present_value, ctx.dtype, kv_shape)
    return ctx.ops.linear(
        b,
        attn,
        f"{layer}.o_proj.weight_T",
        path=f"{path}/o_proj",
        out=f"{prefix}.attn_out_BSH",
        bias=f"{layer}.o_proj.bias" if cfg.o_bias else None,
    )


def _row_attention(
    b: GraphBuilder, qkv_BSQ: ir.Value, slots: tuple[int, ...], ctx: BlockContext, *, path: str, prefix: str
) -> ir.Value:
    """loopcast.RowAttention: row i writes and reads slot ``slots[i]`` at ``ctx.rows.positions[i]``
    (-1: an inactive row). Each distinct slot is one (key, value) pair of inputs."""
    rows = ctx.rows
    if rows is None or not ctx.ops.op_set.loopcast_attention:
        raise ValueError("row-addressed attention needs the loopcast attention op (RowAttention)")
    cfg = ctx.config
    kv_shape = kv_buffer_shape(b, ctx)
    pairs = list(dict.fromkeys(slots))
    kv_in, kv_out = [], []
    for s in pairs:
        kv_in += [
            b.input(f"past_key.{s}", ctx.dtype, kv_shape),
            b.input(f"past_value.{s}", ctx.dtype, kv_shape),
        ]
        kv_out += [f"present_key.{s}", f"present_value.{s}"]
    if rows.kv_in_place:
        kv_out = [f"{prefix}.{name}_0" for name in kv_out]  # empty placeholders
    values = b.op_multi(
        "RowAttention",
        [
            qkv_BSQ,
            rows.positions,
            rows.sequences,
            rows.masked,
            ctx.step.cos_cache,
            ctx.step.sin_cache,
            *kv_in,
        ],
        path=f"{path}/row_attention",
        outs=[f"{prefix}.attn_BSHD", *kv_out],
        domain=LOOPCAST_DOMAIN,
        num_heads=cfg.num_heads,
        kv_num_heads=cfg.num_kv_heads,
        do_rotary=1,
        rotary_interleaved=0,
        scale=cfg.head_dim**-0.5,  # explicit: padded heads must keep 1/sqrt(head_dim)
        row_buffers=[pairs.index(s) for s in slots],
        **({"kv_in_place": 1} if rows.kv_in_place else {}),
    )
    if not rows.kv_in_place:
        for v in values[1:]:
            b.output(v, ctx.dtype, kv_shape)
    return values[0]


def decoder_layer(
    b: GraphBuilder, x_BSH: ir.Value, layer: str, slot: int, ctx: BlockContext, *, path: str, prefix: str
) -> ir.Value:
    """One decoder layer: Ouro sandwich or Llama pre-norm.

    Sandwich:  x ─┬─ n1 ─ attn ─ n2 ─(+)─ x1 ─┬─ n3 ─ mlp ─ n4 ─(+)─▶
                  └──────────────────┘         └──────────────────┘
    The residual add after attention and n3 are one SkipSimplifiedLayerNormalization.
    """
    sandwich = ctx.config.sandwich_norm
    h1 = rms_norm(
        b, x_BSH, f"{layer}.input_layernorm.weight", ctx, path=f"{path}/input_norm", out=f"{prefix}.h1_BSH"
    )
    a = attention(b, h1, layer, slot, ctx, path=f"{path}/attn", prefix=prefix)
    if sandwich:
        a = rms_norm(
            b,
            a,
            f"{layer}.input_layernorm_2.weight",
            ctx,
            path=f"{path}/input_norm_2",
            out=f"{prefix}.a2_BSH",
        )
    h3, x1 = residual_rms_norm(
        b,
        a,
        x_BSH,
        f"{layer}.post_attention_layernorm.weight",
        ctx,
        path=f"{path}/attn_residual_norm",
        prefix=f"{prefix}.res1",
    )
    m = ctx.ops.mlp(b, h3, layer, ctx, path=f"{path}/mlp", prefix=prefix)
    if sandwich:
        m = rms_norm(
            b,
            m,
            f"{layer}.post_attention_layernorm_2.weight",
            ctx,
            path=f"{path}/post_norm_2",
            out=f"{prefix}.m4_BSH",
        )
    return b.op("Add", [x1, m], path=f"{path}/mlp_residual", out=f"{prefix}.out_BSH")


def embed(b: GraphBuilder, input_ids_BS: ir.Value) -> ir.Value:
    q = b.quantized.get(EMBEDDING)
    if q is None:
        return b.op("Gather", [b.weight(EMBEDDING), input_ids_BS], path="/embed", out="embed_BSH", axis=0)
    # A quantized embedding: only the gathered rows are dequantized (fp32 out, as the scales).
    inputs = [b.weight(q.stored["packed"]), input_ids_BS, b.weight(q.stored["scales"])]
    if "zero_points" in q.stored:
        inputs.append(b.weight(q.stored["zero_points"]))
    return b.op(
        "GatherBlockQuantized",
        inputs,
        path="/embed",
        out="embed_BSH",
        domain=MS_DOMAIN,
        gather_axis=0,
        quantize_axis=1,
        block_size=q.block_size,
        bits=q.bits,
    )


def lm_head(b: GraphBuilder, x_BSH: ir.Value, ctx: BlockContext) -> ir.Value:
    """Logits in fp32 whatever the model dtype (the argmax and the host read them)."""
    if ctx.config.tie_word_embeddings:
        logits = ctx.ops.tied_head(b, x_BSH, ctx)
    else:
        logits = ctx.ops.linear(b, x_BSH, "lm_head.weight_T", path="/lm_head/matmul", out="logits_raw_BSV")
    if ctx.dtype != ir.DataType.FLOAT:
        logits = b.op("Cast", [logits], path="/lm_head/cast", out="logits_f32_BSV", to=ir.DataType.FLOAT)
    return logits


def greedy_outputs(
    b: GraphBuilder,
    logits_BSV: ir.Value,
    rows: int | str,
    vocab: int,
    *,
    with_gap: bool = False,
    batch: int | str = 1,
) -> None:
    """Next-token ids on the device (ArgMax), logits, and optionally the top-1/top-2 gap."""
    ids = b.op("ArgMax", [logits_BSV], path="/sample/argmax", out="next_token_ids_BS", axis=-1, keepdims=0)
    b.output(ids, ir.DataType.INT64, [batch, rows])
    b.output(logits_BSV, ir.DataType.FLOAT, [batch, rows, vocab], "logits_BSV")
    if with_gap:
        top_values, _ = b.op_multi(
            "TopK",
            [logits_BSV, b.const_i64("k2", [2])],
            path="/sample/top2",
            outs=["top2_values_BS2", "top2_indices_BS2"],
            axis=-1,
        )
        first, second = b.op_multi(
            "Split",
            [top_values, b.const_i64("split_ones", [1, 1])],
            path="/sample/top2_split",
            outs=["top1_BS1", "top2_BS1"],
            axis=-1,
        )
        gap = b.op("Sub", [first, second], path="/sample/gap", out="top2_gap_BS1")
        b.output(
            b.op(
                "Squeeze",
                [gap, b.const_i64("axis_last", [-1])],
                path="/sample/gap_squeeze",
                out="top2_gap_BS",
            ),
            ir.DataType.FLOAT,
            [1, rows],
        )
