"""``loopcast export --genai``: the graph and ``genai_config.json`` that ONNX Runtime GenAI loads.

The artifact directory then doubles as a GenAI model directory (``og.Model(artifact_dir)``):
the decoder graph (``graphs/genai_decoder.py``) reads its weights from the artifact's one
``weights.safetensors`` as external data at the offsets our own graphs use, so nothing is
stored twice; a quantized artifact's graph reads the quantized matrices through the stock
MatMulNBits, as ORT-GenAI's own int4 models do. The config mirrors the fields GenAI's model
builder (``onnxruntime_genai.models`` 0.18) writes for a GroupQueryAttention decoder, with
``past_present_share_buffer`` on: GenAI then allocates every KV buffer at ``search.max_length``
(our ``--max-length``, the capacity the rotary tables and the graphs were built for) and
updates it in place.
"""

from __future__ import annotations

import json
from pathlib import Path

import onnx_ir as ir
from loopcast.graphs.builder import GraphBuilder, WeightRef
from loopcast.graphs.genai_decoder import (
    ATTENTION_MASK,
    GENAI_FILE,
    INPUT_IDS,
    LOGITS,
    PAST_KEY,
    PAST_VALUE,
    PRESENT_KEY,
    PRESENT_VALUE,
    build_genai_decoder,
)

from loopcast.config import ModelConfig
from loopcast.quant import QuantScheme, quantized_linears

GENAI_CONFIG_FILE = "genai_config.json"


def genai_config(config: ModelConfig, max_length: int, head_size: int | None = None) -> dict:
    """The ``genai_config.json`` object for a graph built by :func:`build_genai_decoder`;
    ``head_size``: the stored (padded) head size of its KV, when the heads are padded."""
    eos = config.eos_token_id if config.eos_token_id is not None else -1
    return {
        "model": {
            "bos_token_id": config.bos_token_id if config.bos_token_id is not None else eos,
            "context_length": max_length,
            "decoder": {
                "session_options": {"log_id": "onnxruntime-genai", "provider_options": []},
                "filename": GENAI_FILE,
                "head_size": head_size or config.head_dim,
                "hidden_size": config.hidden_size,
                "inputs": {
                    "input_ids": INPUT_IDS,
                    "attention_mask": ATTENTION_MASK,
                    "past_key_names": PAST_KEY,
                    "past_value_names": PAST_VALUE,
                },
                "outputs": {
                    "logits": LOGITS,
                    "present_key_names": PRESENT_KEY,
                    "present_value_names": PRESENT_VALUE,
                },
                "num_attention_heads": config.num_heads,
                # One GenAI "layer" per KV slot: loops × core layers (+ prelude, coda), see genai_decoder.
                "num_hidden_layers": config.num_kv_slots,
                "num_key_value_heads": config.num_kv_heads,
            },
            "eos_token_id": eos,
            "pad_token_id": eos,
            # GenAI keys tokenizer and chat handling off the type; every loopcast model is a
            # plain decoder to it, and "llama" is the generic decoder-only type.
            "type": "llama",
            "vocab_size": config.vocab_size,
        },
        "search": {
            "diversity_penalty": 0.0,
            "do_sample": False,
            "early_stopping": True,
            "length_penalty": 1.0,
            "max_length": max_length,
            "min_length": 0,
            "no_repeat_ngram_size": 0,
            "num_beams": 1,
            "num_return_sequences": 1,
            # The graph's GroupQueryAttention writes past in place (static [1, Hkv, max_length, D]).
            "past_present_share_buffer": True,
            "repetition_penalty": 1.0,
            "temperature": 1.0,
            "top_k": 1,
            "top_p": 1.0,
        },
    }


def write_genai(
    staging: Path,
    config: ModelConfig,
    dtype: ir.DataType,
    max_length: int,
    refs: dict[str, WeightRef],
    weights_file: str,
    quant: QuantScheme | None = None,
    head_size: int | None = None,
) -> list[str]:
    """Write the GenAI graph and config into ``staging``; returns the file names written. With
    ``quant`` the graph reads the artifact's quantized matrices through MatMulNBits, as the
    stock op set's own graphs do."""
    builder = GraphBuilder(
        refs, weights_file, staging, quantized_linears(config, quant, head_size), head_size=head_size
    )
    ir.save(build_genai_decoder(config, dtype, max_length, builder), staging / GENAI_FILE)
    text = json.dumps(genai_config(config, max_length, head_size), indent=2) + "\n"
    (staging / GENAI_CONFIG_FILE).write_text(text)
    return [GENAI_FILE, GENAI_CONFIG_FILE]
