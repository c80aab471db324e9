"""Op sets as objects: each knows how its graphs compute a linear layer, attention, the norms and
so the decoder stack (docs/architecture.md, "Op sets and exactness"; loopcast/vocab.py OpSet).

    StockOps               MatMul, GroupQueryAttention, RMSNormalization +
                           SkipSimplifiedLayerNormalization, one decoder layer at a time
    LoopcastAttentionOps   StockOps with the loopcast attention op (BatchInvariantAttention,
                           RowAttention for row-addressed kinds)
    LoopcastOps            every hot op from the loopcast library: BatchInvariantMatMul (the MLP
                           activation inside the down projection, the tied head read in place),
                           or BatchInvariantMatMulNBits for quantized weights (the same fusion),
                           the fused ResidualRMSNorm, so a layer is 7 nodes instead of ~15

A graph kind builds a :class:`blocks.BlockContext` with ``ops=op_set_builders(op_set)`` and
composes the blocks; the blocks ask ``ctx.ops`` where the op sets differ.
"""

from __future__ import annotations

from typing import ClassVar

import onnx_ir as ir
from loopcast.graphs import blocks
from loopcast.graphs.builder import LOOPCAST_DOMAIN, MS_DOMAIN, GraphBuilder

from loopcast.quant import QuantLinear
from loopcast.vocab import OpSet


class OpSetBuilders:
    """The builders of one op set. The base class is the stock one; subclasses override what
    their op set computes differently. Stateless: one instance serves every graph."""

    op_set: ClassVar[OpSet] = OpSet.STOCK
    # The single-sequence attention op (type, domain); the inputs and attributes are the same
    # for both ops (blocks.attention).
    attention_op: ClassVar[tuple[str, str]] = ("GroupQueryAttention", MS_DOMAIN)

    def linear(
        self,
        b: GraphBuilder,
        x: ir.Value,
        weight: str,
        *,
        path: str,
        out: str,
        bias: str | None = None,
    ) -> ir.Value:
        """``x @ W`` (``W`` stored [K, N], or quantized: _matmul_nbits), then ``+ bias`` ([N])
        when given."""
        mm_out = f"{out}_nobias" if bias is not None else out
        if weight in b.quantized:
            y = self._matmul_nbits(b, x, b.quantized[weight], path=path, out=mm_out)
        else:
            y = b.op("MatMul", [x, b.weight(weight)], path=path, out=mm_out)
        if bias is not None:
            return b.op("Add", [y, b.weight(bias)], path=f"{path}/bias", out=out)
        return y

    def _matmul_nbits(self, b: GraphBuilder, x: ir.Value, q: QuantLinear, *, path: str, out: str) -> ir.Value:
        """``x @ W`` for a block-quantized ``W`` (com.microsoft MatMulNBits, weights dequantized
        per block inside the op; loopcast/quant.py). Inputs in schema order: A, B, scales,
        zero_points (omitted when symmetric: the op's default 2^(bits-1)); g_idx and bias (4, 5)
        are not used."""
        names = q.stored
        inputs = [x, b.weight(names["packed"]), b.weight(names["scales"])]
        if "zero_points" in names:
            inputs.append(b.weight(names["zero_points"]))
        return b.op(
            "MatMulNBits",
            inputs,
            path=path,
            out=out,
            domain=MS_DOMAIN,
            K=q.k,
            N=q.n,
            bits=q.bits,
            block_size=q.block_size,
            accuracy_level=q.accuracy_level,
        )

    def mlp(
        self,
        b: GraphBuilder,
        h_BSH: ir.Value,
        layer: str,
        ctx: blocks.BlockContext,
        *,
        path: str,
        prefix: str,
    ) -> ir.Value:
        """``down(silu(gate(h)) · up(h))`` with gate and up fused into one MatMul.

        h ─ gate_up_proj ─▶ [gate | up] ─ Split ─▶ gate ─ Sigmoid ─ Mul(gate) ─ Mul(up) ─ down_proj ─▶
        """
        inter = ctx.config.intermediate_size
        mlp_bias = ctx.config.mlp_bias
        gate_up = self.linear(
            b,
            h_BSH,
            f"{layer}.gate_up_proj.weight_T",
            path=f"{path}/gate_up_proj",
            out=f"{prefix}.gate_up_BS2I",
            bias=f"{layer}.gate_up_proj.bias" if mlp_bias else None,
        )
        gate, up = b.op_multi(
            "Split",
            [gate_up, b.const_i64("split_sizes_2I", [inter, inter])],
            path=f"{path}/split",
            outs=[f"{prefix}.gate_BSI", f"{prefix}.up_BSI"],
            axis=-1,
        )
        sig = b.op("Sigmoid", [gate], path=f"{path}/sigmoid", out=f"{prefix}.sigmoid_BSI")
        silu = b.op("Mul", [gate, sig], path=f"{path}/silu", out=f"{prefix}.silu_BSI")
        act = b.op("Mul", [silu, up], path=f"{path}/gated", out=f"{prefix}.act_BSI")
        return self.linear(
            b,
            act,
            f"{layer}.down_proj.weight_T",
            path=f"{path}/down_proj",
            out=f"{prefix}.mlp_out_BSH",
            bias=f"{layer}.down_proj.bias" if mlp_bias else None,
        )

    def norm(
        self, b: GraphBuilder, x_BSH: ir.Value, weight: str, ctx: blocks.BlockContext, *, path: str, out: str
    ) -> ir.Value:
        """``rms(x)·g``, standing alone (the recurrent-depth blocks' opening norms, ln_f)."""
        return blocks.rms_norm(b, x_BSH, weight, ctx, path=path, out=out)

    def add_norm(
        self,
        b: GraphBuilder,
        branch: ir.Value,
        residual: ir.Value,
        weight: str,
        next_weight: str | None,
        ctx: blocks.BlockContext,
        *,
        path: str,
        prefix: str,
    ) -> tuple[ir.Value, ir.Value | None]:
        """Huginn's norm after the residual add: ``x = rms(residual + branch)·g``, and ``h =
        rms(x)·g_next`` when ``next_weight``; returns (x, h or None)."""
        x, _ = blocks.residual_rms_norm(b, branch, residual, weight, ctx, path=path, prefix=prefix)
        if next_weight is None:
            return x, None
        h = self.norm(b, x, next_weight, ctx, path=f"{path}/next_norm", out=f"{prefix}.next_BSH")
        return x, h

    def stack(
        self, b: GraphBuilder, x_BSH: ir.Value, sites: list[blocks.LayerSite], ctx: blocks.BlockContext
    ) -> tuple[ir.Value, ir.Value | None]:
        """The layers of ``sites``, one decoder layer at a time with its own norms, and the
        loop-norm after each core loop; returns (x, x after the last loop-norm)."""
        depth_state = None
        for site in sites:
            x_BSH = blocks.decoder_layer(
                b, x_BSH, site.weights, site.slot, ctx, path=site.path, prefix=site.prefix
            )
            if site.loop_norm is not None:
                path, out = site.loop_norm
                x_BSH = depth_state = blocks.rms_norm(b, x_BSH, "norm.weight", ctx, path=path, out=out)
        return x_BSH, depth_state

    def tied_head(self, b: GraphBuilder, x_BSH: ir.Value, ctx: blocks.BlockContext) -> ir.Value:
        """Logits from the [V, H] embedding: Gemm(transB) reads it in place instead of storing
        a transposed copy; a quantized head reads its own quantized copy instead."""
        cfg = ctx.config
        if "lm_head.weight_T" in b.quantized:
            return self.linear(b, x_BSH, "lm_head.weight_T", path="/lm_head/matmul", out="logits_raw_BSV")
        flat = b.op(
            "Reshape",
            [x_BSH, b.const_i64("shape_NH", [-1, cfg.hidden_size])],
            path="/lm_head/flatten",
            out="head_in_NH",
        )
        logits = b.op(
            "Gemm", [flat, b.weight("embed_tokens.weight")], path="/lm_head/gemm", out="logits_NV", transB=1
        )
        # single sequence: [1, rows, V]; batched kinds: [B, rows per sequence, V]
        # (batch_rows -1: the batched cycle's one activation entry of a symbolic row count;
        # 0: a symbolic count per sequence, the recurrent batched kinds': B and S from the input)
        one_entry = ctx.batch == 1 or ctx.batch_rows == -1
        if ctx.batch_rows == 0 and not one_entry:
            lead = b.op("Shape", [x_BSH], path="/lm_head/lead_dims", out="head_lead_2", start=0, end=2)
            shape = b.op(
                "Concat",
                [lead, b.const_i64("vocab_1", [cfg.vocab_size])],
                path="/lm_head/shape",
                out="shape_3",
                axis=0,
            )
        else:
            dims = [1, -1, cfg.vocab_size] if one_entry else [-1, ctx.batch_rows, cfg.vocab_size]
            shape = b.const_i64("shape_BSV", dims)
        return b.op("Reshape", [logits, shape], path="/lm_head/unflatten", out="logits_raw_BSV")


class StockOps(OpSetBuilders):
    """ONNX and com.microsoft ops only."""


class LoopcastAttentionOps(OpSetBuilders):
    """The loopcast attention op with stock MatMul and norms: rows are exact on the CPU, whose
    stock MatMul is already row-invariant (docs/architecture.md)."""

    op_set = OpSet.LOOPCAST_ATTENTION
    attention_op = ("BatchInvariantAttention", LOOPCAST_DOMAIN)


class LoopcastOps(LoopcastAttentionOps):
    """Every hot op from the loopcast library: BatchInvariantMatMul and BatchInvariantAttention
    (a row's result then does not depend on how many rows the step has, so every verify row
    equals the M=1 decode row bit for bit, docs/architecture.md §6), the fused ResidualRMSNorm,
    and the MLP activation inside the down projection."""

    op_set = OpSet.LOOPCAST

    def linear(
        self,
        b: GraphBuilder,
        x: ir.Value,
        weight: str,
        *,
        path: str,
        out: str,
        bias: str | None = None,
    ) -> ir.Value:
        # The op has no bias input: a bias is an Add after it, elementwise and so row-invariant
        # (the recurrent-depth family's q/k bias; export refuses biases for the decoder stack,
        # whose fused layer has no place for the Add).
        mm_out = f"{out}_nobias" if bias is not None else out
        if weight in b.quantized:
            y = self._matmul_nbits_invariant(b, x, b.quantized[weight], path=path, out=mm_out)
        else:
            y = self._matmul(b, x, weight, path=path, out=mm_out)
        if bias is not None:
            return b.op("Add", [y, b.weight(bias)], path=f"{path}/bias", out=out)
        return y

    def _matmul_nbits_invariant(
        self, b: GraphBuilder, x: ir.Value, q: QuantLinear, *, path: str, out: str, swiglu: bool = False
    ) -> ir.Value:
        """``x @ W`` for a block-quantized ``W``: the loopcast BatchInvariantMatMulNBits, which reads
        MatMulNBits' tensors (loopcast/quant.py) and keeps each row independent of the call's
        row count on the CPU and CUDA; with ``swiglu`` x is [gate | up]. Inputs: A, B, scales,
        zero_points (omitted when symmetric; fp32 ones are a GGUF Q4_1's). fp32 activations take
        the scheme's accuracy_level (4: int8 activations per block on the CPU; CUDA computes fp32); 16-bit
        ones are multiplied as they are (the CUDA kernels)."""
        names = q.stored
        inputs = [x, b.weight(names["packed"]), b.weight(names["scales"])]
        if "zero_points" in names:
            inputs.append(b.weight(names["zero_points"]))
        level = q.accuracy_level if b.activation_dtype == ir.DataType.FLOAT and q.accuracy_level == 4 else 0
        return b.op(
            "BatchInvariantMatMulNBits",
            inputs,
            path=path,
            out=out,
            domain=LOOPCAST_DOMAIN,
            K=q.k,
            N=q.n,
            bits=q.bits,
            block_size=q.block_size,
            **({"swiglu": 1} if swiglu else {}),
            **({"accuracy_level": level} if level else {}),
        )

    def _matmul(
        self,
        b: GraphBuilder,
        x: ir.Value,
        weight: str,
        *,
        path: str,
        out: str,
        trans_b: bool = False,
        swiglu: bool = False,
    ) -> ir.Value:
        """``x @ W``, or ``x @ Wᵀ`` for a [N, K] weight read in place (``trans_b``); with
        ``swiglu`` x is [gate | up] and the op multiplies silu(gate)·up as it loads x."""
        attrs = {**({"trans_b": 1} if trans_b else {}), **({"swiglu": 1} if swiglu else {})}
        return b.op(
            "BatchInvariantMatMul", [x, b.weight(weight)], path=path, out=out, domain=LOOPCAST_DOMAIN, **attrs
        )

    def mlp(
        self,
        b: GraphBuilder,
        h_BSH: ir.Value,
        layer: str,
        ctx: blocks.BlockContext,
        *,
        path: str,
        prefix: str,
    ) -> ir.Value:
        """gate_up_proj, then down_proj forming silu(gate)·up as it loads its input."""
        gate_up = self.linear(
            b,
            h_BSH,
            f"{layer}.gate_up_proj.weight_T",
            path=f"{path}/gate_up_proj",
            out=f"{prefix}.gate_up_BS2I",
            bias=f"{layer}.gate_up_proj.bias" if ctx.config.mlp_bias else None,  # refused
        )
        down = f"{layer}.down_proj.weight_T"
        if down in b.quantized:
            return self._matmul_nbits_invariant(
                b,
                gate_up,
                b.quantized[down],
                path=f"{path}/down_proj",
                out=f"{prefix}.mlp_out_BSH",
                swiglu=True,
            )
        return self._matmul(
            b, gate_up, down, path=f"{path}/down_proj", out=f"{prefix}.mlp_out_BSH", swiglu=True
        )

    def norm(
        self, b: GraphBuilder, x_BSH: ir.Value, weight: str, ctx: blocks.BlockContext, *, path: str, out: str
    ) -> ir.Value:
        """ResidualRMSNorm without a residual: the fused ops' rounding, row-invariant on CUDA."""
        _, h = blocks.fused_residual_norm(
            b,
            x_BSH,
            None,
            ctx,
            branch_weight=None,
            loop_weight=None,
            out_weight=weight,
            path=path,
            prefix=out,
        )
        assert h is not None
        return h

    def add_norm(
        self,
        b: GraphBuilder,
        branch: ir.Value,
        residual: ir.Value,
        weight: str,
        next_weight: str | None,
        ctx: blocks.BlockContext,
        *,
        path: str,
        prefix: str,
    ) -> tuple[ir.Value, ir.Value | None]:
        """One ResidualRMSNorm: its loop norm is the norm after the add, its out norm the next."""
        return blocks.fused_residual_norm(
            b,
            branch,
            residual,
            ctx,
            branch_weight=None,
            loop_weight=weight,
            out_weight=next_weight,
            path=path,
            prefix=prefix,
        )

    def stack(
        self, b: GraphBuilder, x_BSH: ir.Value, sites: list[blocks.LayerSite], ctx: blocks.BlockContext
    ) -> tuple[ir.Value, ir.Value | None]:
        return blocks.decoder_stack(b, x_BSH, sites, ctx)

    def tied_head(self, b: GraphBuilder, x_BSH: ir.Value, ctx: blocks.BlockContext) -> ir.Value:
        if "lm_head.weight_T" in b.quantized:  # its own quantized copy of the embedding
            return self.linear(b, x_BSH, "lm_head.weight_T", path="/lm_head/matmul", out="logits_raw_BSV")
        return self._matmul(
            b, x_BSH, "embed_tokens.weight", path="/lm_head/matmul", out="logits_raw_BSV", trans_b=True
        )


_BUILDERS: dict[OpSet, OpSetBuilders] = {
    OpSet.STOCK: StockOps(),
    OpSet.LOOPCAST_ATTENTION: LoopcastAttentionOps(),
    OpSet.LOOPCAST: LoopcastOps(),
}


def op_set_builders(op_set: OpSet | str) -> OpSetBuilders:
    """The builders of ``op_set`` (a ValueError names an unknown one)."""
    return _BUILDERS[OpSet(op_set)]
