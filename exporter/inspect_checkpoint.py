"""Human-readable summary of a checkpoint directory (``loopcast inspect``)."""

from __future__ import annotations

import math

from loopcast.exporter.checkpoint import (
    checkpoint_dtype,
    expected_shapes,
    resolve_checkpoint,
    validate_checkpoint,
)

from loopcast.config import load_config

_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


def _biases(cfg) -> str:
    parts = [
        name for name, on in (("q/k/v", cfg.qkv_bias), ("o_proj", cfg.o_bias), ("mlp", cfg.mlp_bias)) if on
    ]
    return ", ".join(parts) or "none"


def describe_checkpoint(path_or_name: str) -> str:
    path = resolve_checkpoint(path_or_name)
    cfg = load_config(path)
    validate_checkpoint(path, cfg)  # names the first missing or mis-shaped tensor
    dtype = checkpoint_dtype(path)
    nbytes = _BYTES.get(dtype, 4)
    params = sum(math.prod(s) for s in expected_shapes(cfg).values())
    per_token = cfg.kv_bytes_per_token(nbytes)
    if cfg.recurrent_depth:
        return "\n".join(_recurrent_lines(path, cfg, dtype, params, per_token))
    lines = [
        f"checkpoint      {path}",
        f"model_type      {cfg.model_type}",
        f"dtype           {dtype}",
        f"parameters      {params:,}",
        f"loops (R)       {cfg.num_loops}  x  {cfg.num_layers} core layers"
        + (
            f"  (+{cfg.num_prelude_layers} prelude, +{cfg.num_coda_layers} coda)"
            if cfg.num_prelude_layers or cfg.num_coda_layers
            else ""
        ),
        f"layer norms     {'sandwich (4 RMSNorms)' if cfg.sandwich_norm else 'pre-norm (2 RMSNorms)'}",
        f"hidden          {cfg.hidden_size}, intermediate {cfg.intermediate_size}",
        f"attention       {cfg.num_heads} heads / {cfg.num_kv_heads} KV heads of {cfg.head_dim}"
        + (f", sliding window {cfg.sliding_window}" if cfg.sliding_window else ""),
        f"rope            theta {cfg.rope_theta:g}, type {cfg.rope_type}"
        + "".join(
            f", {k} {v:g}" if isinstance(v, float) else f", {k} {v}"
            for k, v in (cfg.rope_scaling.params if cfg.rope_scaling else ())
        ),
        f"biases          {_biases(cfg)}",
        f"eos ids         {', '.join(map(str, cfg.eos_token_ids)) or 'none'}",
        f"vocab           {cfg.vocab_size} ({'tied' if cfg.tie_word_embeddings else 'untied'} lm_head)",
        f"exit gate       {'yes' if cfg.has_exit_gate else 'no'}",
        f"KV slots        {cfg.num_kv_slots}",
        f"KV per token    {_size(per_token)}",
        f"KV at max len   {_size(per_token * cfg.max_position_embeddings)} "
        f"(max_position_embeddings {cfg.max_position_embeddings})",
    ]
    return "\n".join(lines)


def _recurrent_lines(path, cfg, dtype: str, params: int, per_token: int) -> list[str]:
    """Huginn/Raven: prelude, r core steps with the injection, coda (loopcast/config_huginn.py)."""
    return [
        f"checkpoint      {path}",
        f"model_type      {cfg.model_type} (recurrent depth)",
        f"dtype           {dtype}",
        f"parameters      {params:,}",
        f"depth           {cfg.num_prelude_layers} prelude + {cfg.num_layers} core x r + "
        f"{cfg.num_coda_layers} coda layers; r = {cfg.loops_default} by default, up to {cfg.num_loops}"
        f" (= {cfg.num_prelude_layers + cfg.num_layers * cfg.loops_default + cfg.num_coda_layers} "
        "layer applications a token)",
        f"core steps      s_k+1 = core(adapter([s_k, e])): Linear({2 * cfg.hidden_size}->{cfg.hidden_size}) "
        "on the state and the prelude output e",
        f"initial state   truncated normal, std {cfg.state_std:.4g} (cut at 3 std), "
        "seeded per position; or zero",
        "layer norms     Huginn sandwich: x = n2(x + attn(n1 x)); x = n4(x + mlp(n3 x)); "
        "ln_f before and after the coda",
        f"embedding       x {cfg.embed_scale:.4g} (sqrt hidden)",
        f"hidden          {cfg.hidden_size}, intermediate {cfg.intermediate_size} (fc = gate|up fused)",
        f"attention       {cfg.num_heads} heads / {cfg.num_kv_heads} KV heads of {cfg.head_dim}, "
        f"Wqkv fused{', q/k bias' if cfg.qkv_bias else ''}",
        f"rope            theta {cfg.rope_theta:g}, adjacent pairs (interleaved)",
        f"eos ids         {', '.join(map(str, cfg.eos_token_ids)) or 'none'}",
        f"vocab           {cfg.vocab_size} ({'tied' if cfg.tie_word_embeddings else 'untied'} lm_head)",
        f"KV slots        {cfg.num_kv_slots} ({cfg.num_loops} steps x {cfg.num_layers} + "
        f"{cfg.num_prelude_layers} prelude + {cfg.num_coda_layers} coda)",
        f"KV per token    {_size(per_token)} at r = {cfg.num_loops}",
    ]
