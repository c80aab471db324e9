"""`loopcast generate --backend torch`: the reference model on a checkpoint directory."""

from __future__ import annotations

import time
from pathlib import Path

from loopcast.exporter.checkpoint import load_checkpoint, resolve_checkpoint
from loopcast.exporter.reference_depth import depth_generate

from loopcast.errors import ConfigError, RequestError
from loopcast.kv_sharing import parse_sharing


def load_tokenizer(directory: Path):
    """The directory's ``tokenizer.json`` as a `tokenizers.Tokenizer`, or None."""
    path = Path(directory) / "tokenizer.json"
    if not path.is_file():
        return None
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(path))


def generate_with_reference(
    path: str, prompt: str | None, prompt_ids: list[int] | None, config, *, kv_sharing: str | None = None
) -> dict:
    """Plain greedy with the reference on ``config`` (a GenerationConfig: its length, static
    depth ``loops`` or exit gate); ``kv_sharing``: a recurrent-depth checkpoint's KV lookup."""
    checkpoint_dir = resolve_checkpoint(path)
    tokenizer = load_tokenizer(checkpoint_dir)
    if prompt is not None:
        if tokenizer is None:
            raise RequestError(f"{checkpoint_dir}: no tokenizer.json, use --prompt-ids")
        prompt_ids = tokenizer.encode(prompt).ids
    import torch

    model = load_checkpoint(checkpoint_dir, dtype=torch.float32)
    stop = model.config.eos_token_ids
    q = model.config.early_exit_threshold
    if q is not None and q < 1.0 and config.loops is None and not config.gated:
        config = config.replace(exit_threshold=q)  # the checkpoint's default (docs/adaptive-depth.md)
    start = time.perf_counter()
    if kv_sharing is not None and not model.config.recurrent_depth:
        raise RequestError(
            f"kv_sharing {kv_sharing!r}: sharing KV slots across core steps is the recurrent-depth "
            "(Huginn) family's; a looped checkpoint keeps a slot per loop and layer",
            parameter="kv_sharing",
        )
    if model.config.recurrent_depth:  # Huginn: r, the KL exit, the state seed (below)
        result = _recurrent(model, prompt_ids, config, stop, kv_sharing)
    else:
        result = depth_generate(model, prompt_ids, config, stop_ids=stop)
    seconds = time.perf_counter() - start
    text = tokenizer.decode(result.tokens, skip_special_tokens=False) if tokenizer else None
    return {
        "tokens": result.tokens,
        "text": text,
        "stats": {
            "backend": "torch",
            "prompt_tokens": len(prompt_ids),
            "new_tokens": len(result.tokens),
            "finish_reason": result.finish_reason,
            **(result.depth_stats() if hasattr(result, "depth_stats") else {}),
            "seconds": round(seconds, 4),
            "tokens_per_second": round(len(result.tokens) / seconds, 2) if seconds > 0 else None,
        },
    }


def _recurrent(model, prompt_ids: list[int], config, stop: tuple[int, ...], kv_sharing: str | None = None):
    """The recurrent-depth reference on the options the runtime takes for the family
    (ort_runtime/decoding/recurrent_stream.py): r, the KL exit, the initial state's seed."""
    from loopcast.exporter.reference_generate import ReferenceResult
    from loopcast.exporter.reference_huginn import greedy_generate as recurrent_greedy

    from loopcast.kl_exit import KLExit

    cfg = model.config
    if config.exit_threshold is not None:
        raise RequestError(
            "exit_threshold is Ouro's exit gate; a recurrent-depth model exits on kl_threshold",
            parameter="exit_threshold",
        )
    if config.loops is not None and not 1 <= config.loops <= cfg.num_loops:
        raise RequestError(
            f"loops must be an integer in 1..{cfg.num_loops} (the checkpoint's max_recurrence), "
            f"got {config.loops}",
            parameter="loops",
        )
    kl = (
        KLExit(config.kl_threshold, config.min_loops or 1, config.kv_policy.value)
        if config.kl_threshold is not None
        else None
    )
    try:
        sharing = parse_sharing(kv_sharing)
    except ConfigError as exc:
        raise RequestError(str(exc), parameter="kv_sharing") from None
    if sharing is not None and kl is not None:
        raise RequestError(
            "the KL exit needs a KV slot per (step, layer): kv_sharing must be None", parameter="kv_sharing"
        )
    max_length = min(cfg.max_position_embeddings, len(prompt_ids) + config.max_new_tokens)
    tokens, _ = recurrent_greedy(
        model,
        prompt_ids,
        config.max_new_tokens,
        loops=config.loops,
        seed=config.state_seed,
        kl_exit=kl,
        sharing=sharing,
        stop_ids=stop,
        max_length=max_length,
    )
    return ReferenceResult(tokens, "eos" if tokens and tokens[-1] in stop else "length")
