"""The ONNX Runtime GenAI decoder: one graph in GenAI's IO contract, built from the same blocks.

GenAI (onnxruntime-genai) drives a decoder-only model through fixed names:

    input_ids [B, S] int64, attention_mask [B, T] int64 (T = past + S tokens),
    past_key_values.{i}.key / .value  →  logits [B, S, V], present.{i}.key / .value

With ``past_present_share_buffer`` it allocates each past buffer once at ``search.max_length``
and binds it as the present too: the static-slot layout of docs/architecture.md §2 that GroupQueryAttention
already writes in place, so the layers are the unchanged blocks. Only the step inputs differ:
GenAI gives a mask where our kinds take ``seqlens_k``/``total_sequence_length``, so the graph
derives them as GenAI's own builder does:

    attention_mask ─ ReduceSum(axis 1) ─ Sub(1) ─ Cast(int32) ─▶ seqlens_k [B]
                   └ Shape[1:2] ─ Squeeze ─ Cast(int32) ──────▶ total_sequence_length []

Looped models fit the contract as they are: GenAI's "layer" i is just a KV pair it allocates
and binds, so KV slot ``r*L + l`` (one per loop and layer, then prelude, then coda) becomes
GenAI layer ``slot`` and ``num_hidden_layers`` is the slot count.
"""

from __future__ import annotations

import onnx_ir as ir
from loopcast.graphs import blocks
from loopcast.graphs.builder import GraphBuilder
from loopcast.graphs.ops import op_set_builders

from loopcast.config import ModelConfig
from loopcast.vocab import OpSet

# B = 1, as in every loopcast graph (the blocks' KV buffers and tied head are batch-1); GenAI
# refuses a larger batch_size with an input-shape error (docs/install.md).
GENAI_FILE = "genai_decoder.onnx"
INPUT_IDS, ATTENTION_MASK, LOGITS = "input_ids", "attention_mask", "logits"
PAST_KEY, PAST_VALUE = "past_key_values.%d.key", "past_key_values.%d.value"
PRESENT_KEY, PRESENT_VALUE = "present.%d.key", "present.%d.value"


def build_genai_decoder(
    config: ModelConfig, dtype: ir.DataType, max_length: int, b: GraphBuilder
) -> ir.Model:
    """All rows' logits for ``input_ids`` (prompt or one token), writing every KV slot at n..n+S-1."""
    input_ids = b.input(INPUT_IDS, ir.DataType.INT64, [1, "sequence_length"])
    mask = b.input(ATTENTION_MASK, ir.DataType.INT64, [1, "total_sequence_length"])
    mask_sum = b.op(
        "ReduceSum", [mask, b.const_i64("axis_1", [1])], path="/mask/sum", out="mask_sum_B", keepdims=0
    )
    last = b.op("Sub", [mask_sum, b.const_i64("one", [1])], path="/mask/last", out="mask_last_B")
    seqlens_k = b.op("Cast", [last], path="/mask/seqlens_k", out="seqlens_k", to=ir.DataType.INT32)
    total_1 = b.op("Shape", [mask], path="/mask/total", out="mask_total_1", start=1, end=2)
    total = b.op(
        "Squeeze", [total_1, b.const_i64("axis_0", [0])], path="/mask/total_scalar", out="mask_total"
    )
    total_i32 = b.op(
        "Cast", [total], path="/mask/total_i32", out="total_sequence_length", to=ir.DataType.INT32
    )
    step = blocks.StepInputs(
        seqlens_k=seqlens_k,
        total_sequence_length=total_i32,
        cos_cache=b.weight("rotary.cos_SD2"),
        sin_cache=b.weight("rotary.sin_SD2"),
    )
    # Stock ops only: GenAI runs the graph in its own sessions, which know no loopcast ops.
    ops = op_set_builders(OpSet.STOCK)
    ctx = blocks.BlockContext(config, dtype, max_length, step, ops)
    sites = blocks.layer_sites(config, 0, config.num_loops, prelude=True)
    x, _ = ops.stack(b, blocks.embed(b, input_ids), sites, ctx)
    logits = blocks.lm_head(b, x, ctx)
    b.output(logits, ir.DataType.FLOAT, [1, "sequence_length", config.vocab_size], LOGITS)
    _rename_kv(b)
    return b.build("genai_decoder", __doc__.split("\n\n")[0])


def _rename_kv(b: GraphBuilder) -> None:
    """The blocks name KV ``past_key.{slot}`` / ``present_key.{slot}``; GenAI wants its own names."""
    renames = {
        "past_key": PAST_KEY,
        "past_value": PAST_VALUE,
        "present_key": PRESENT_KEY,
        "present_value": PRESENT_VALUE,
    }
    for value in [*b.inputs, *b.outputs]:
        stem, _, slot = value.name.partition(".")
        if stem in renames and slot.isdigit():
            value.name = renames[stem] % int(slot)
