"""Named model shapes for tests and benchmarks; ``loopcast random-checkpoint --preset NAME``
writes a random-weight checkpoint of any of them."""

from __future__ import annotations

import dataclasses
import math

from loopcast.config import ModelConfig

# Shapes used by tests and benchmarks; the tool `loopcast random-checkpoint` writes any of them.
PRESETS: dict[str, ModelConfig] = {
    "ouro-1.4b": ModelConfig(
        model_type="ouro",
        vocab_size=49152,
        hidden_size=2048,
        intermediate_size=5632,
        num_layers=24,
        num_heads=16,
        num_kv_heads=16,
        head_dim=128,
        num_loops=4,
        rms_norm_eps=1e-6,
        rope_theta=1e6,
        max_position_embeddings=65536,
        bos_token_id=1,
        eos_token_id=2,
        torch_dtype="float16",
    ),
    "tiny-ouro": ModelConfig(
        model_type="ouro",
        vocab_size=97,
        hidden_size=64,
        intermediate_size=96,
        num_layers=2,
        num_heads=4,
        num_kv_heads=4,
        head_dim=16,
        num_loops=3,
        rope_theta=1e4,
        max_position_embeddings=128,
        eos_token_id=0,
    ),
    "tiny-llama": ModelConfig(
        model_type="llama",
        vocab_size=101,
        hidden_size=64,
        intermediate_size=80,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        num_loops=1,
        rope_theta=1e4,
        max_position_embeddings=128,
        tie_word_embeddings=True,
        eos_token_id=0,
    ),
    "tiny-qwen2": ModelConfig(
        model_type="qwen2",
        vocab_size=103,
        hidden_size=64,
        intermediate_size=80,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        rope_theta=1e6,
        max_position_embeddings=128,
        tie_word_embeddings=True,
        eos_token_id=0,
        extra_eos_token_ids=(1,),
        qkv_bias=True,
    ),
    # Huginn-0125's shapes (tomg-group-umd/huginn-0125 config.json): 2 prelude + 4 core x r + 2
    # coda layers, r = 32 by default; 3.5B parameters.
    "huginn-3.5b": ModelConfig(
        model_type="huginn_raven",
        vocab_size=65536,
        hidden_size=5280,
        intermediate_size=17920,
        num_layers=4,
        num_heads=55,
        num_kv_heads=55,
        head_dim=96,
        num_loops=32,
        default_loops=32,
        rms_norm_eps=1e-6,
        rope_theta=50000.0,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        num_prelude_layers=2,
        num_coda_layers=2,
        bos_token_id=65504,
        eos_token_id=65505,
        torch_dtype="bfloat16",
        qkv_bias=True,
        rope_interleaved=True,
        embed_scale=math.sqrt(5280),
        state_std=math.sqrt(2 / (5 * 5280)) * math.sqrt(5280),
    ),
    # SmolLM-135M shapes (~135M parameters, 514 MiB in fp32): export-speed and memory measurements.
    "smollm-135m": ModelConfig(
        model_type="llama",
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_layers=30,
        num_heads=9,
        num_kv_heads=3,
        head_dim=64,
        rms_norm_eps=1e-5,
        rope_theta=1e5,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
    ),
}
# Huginn's structure at test size: up to 32 core steps (the release's r), 4 by default.
PRESETS["tiny-huginn"] = dataclasses.replace(
    PRESETS["huginn-3.5b"],
    vocab_size=97,
    hidden_size=64,
    intermediate_size=96,
    num_layers=2,
    num_heads=4,
    num_kv_heads=4,
    head_dim=16,
    default_loops=4,
    max_position_embeddings=128,
    bos_token_id=None,
    eos_token_id=0,
    torch_dtype="float32",
    embed_scale=8.0,
    state_std=math.sqrt(2 / (5 * 64)) * 8.0,
)
# Ouro-1.4B's shapes as a plain Llama (R=1, untied head): 1.43B parameters, 2.7 GiB in fp16,
# the size timed against ORT-GenAI's builder on the H200 host (tools/gpu_machine/h200_run.sh).
PRESETS["llama-1.4b"] = dataclasses.replace(
    PRESETS["ouro-1.4b"], model_type="llama", num_loops=1, max_position_embeddings=4096
)
