"""The exit gate's loop-skipping kinds (docs/adaptive-depth.md): loop_embed, loop_step, exit_head.

The host composes a token's forward one loop at a time and stops at the loop its gate picks:

    loop_embed = embed                                          → embedded_BSH        (1 row)
    loop_step  = one core loop (its loop-norm) → gate logit     → hidden_BSH_out, exit_gates_BR
    exit_head  = head → argmax                                  → next_token_ids_BS, logits_BSV

loop_step's KV inputs are named for loop 0's slots (``past_key.{l}``); the host binds loop r's
buffers (slots ``r*L + l``) to them for the token's r-th call. The loops share their weights
(Ouro), so the one session of loop_step holds one (prepacked) copy of the core for every loop,
and the three kinds hold disjoint weights: skipping loops adds no copy of any weight beside the
artifact's other sessions (one session per loop would prepack the core R times).

Each state carries the bits of the exits graph's: a loop is one stack call on the previous
loop's normed state, which opens with the norm a verify_tail graph opens with (graphs/blocks.py
decoder_stack), exactly as each loop of ``exits`` is built (graphs/kinds.py).
"""

from __future__ import annotations

import onnx_ir as ir
from loopcast.graphs import blocks
from loopcast.graphs.builder import GraphBuilder
from loopcast.graphs.ops import op_set_builders

from loopcast.config import ModelConfig
from loopcast.manifest import GraphSpec
from loopcast.vocab import GraphKind, GraphPlan, OpSet


def build_loop_step_kind(
    plan: GraphPlan,
    config: ModelConfig,
    dtype: ir.DataType,
    max_length: int,
    b: GraphBuilder,
    *,
    op_set: OpSet | str = OpSet.STOCK,
) -> tuple[ir.Model, GraphSpec]:
    hidden = [1, 1, config.hidden_size]
    ops = op_set_builders(op_set)
    if plan.kind == GraphKind.LOOP_EMBED:
        x = blocks.embed(b, b.input("input_ids_BS", ir.DataType.INT64, [1, 1]))
        b.output(x, dtype, hidden, "embedded_BSH")
    elif plan.kind == GraphKind.LOOP_STEP:
        x = b.input("hidden_BSH", dtype, hidden)
        step = blocks.StepInputs(
            seqlens_k=b.input("seqlens_k", ir.DataType.INT32, [1]),
            total_sequence_length=b.input("total_sequence_length", ir.DataType.INT32, []),
            cos_cache=b.weight("rotary.cos_SD2"),
            sin_cache=b.weight("rotary.sin_SD2"),
        )
        ctx = blocks.BlockContext(config, dtype, max_length, step, ops)
        x, _ = ops.stack(b, x, blocks.layer_sites(config, 0, 1, prelude=False), ctx)
        b.output(x, dtype, hidden, "hidden_BSH_out")
        _gate(b, x, dtype)
    elif plan.kind == GraphKind.EXIT_HEAD:
        x = b.input("hidden_BSH", dtype, hidden)
        ctx = blocks.BlockContext(config, dtype, max_length, None, ops)  # type: ignore[arg-type]
        blocks.greedy_outputs(b, blocks.lm_head(b, x, ctx), 1, config.vocab_size)
    else:
        raise ValueError(f"{plan.kind} is not a loop-step kind")
    model = b.build(plan.key, __doc__.split("\n\n")[0])
    spec = b.spec(plan.kind, f"{plan.kind}.onnx", plan.rows, plan.first_loop, plan.last_loop)
    return model, spec


def _gate(b: GraphBuilder, x_BSH: ir.Value, dtype: ir.DataType) -> None:
    """The exit-gate logit of the normed state, in fp32 (the host decides the exit on it)."""
    gate = exit_gate_logit(b, x_BSH, dtype, "/loop_step/gate", "gate")
    shape = b.const_i64("gate_shape", [1, 1])
    gate = b.op("Reshape", [gate, shape], path="/loop_step/gate/flat", out="exit_gates_BR")
    b.output(gate, ir.DataType.FLOAT, [1, 1])


def exit_gate_logit(b: GraphBuilder, x_BSH: ir.Value, dtype: ir.DataType, path: str, name: str) -> ir.Value:
    """One row's exit-gate logit [1, 1, 1] in fp32, as every graph that reads the gate computes
    it (the pipeline's cycle too, row by row, so its gates carry loop_step's bits):
    x ─ MatMul(gate) ─ Add(bias) ─ (Cast). ``name`` prefixes the value names."""
    weight, bias = b.weight("early_exit_gate.weight_T"), b.weight("early_exit_gate.bias")
    gate = b.op("MatMul", [x_BSH, weight], path=path, out=f"{name}_BS1_nobias")
    gate = b.op("Add", [gate, bias], path=f"{path}/bias", out=f"{name}_BS1")
    if dtype != ir.DataType.FLOAT:
        gate = b.op("Cast", [gate], path=f"{path}/cast", out=f"{name}_f32_BS1", to=ir.DataType.FLOAT)
    return gate
