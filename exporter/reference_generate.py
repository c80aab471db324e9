"""Reference greedy decoding: a fixed per-slot KV cache written by position, and a no-cache
full recompute that exists only to check the cached path."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from loopcast.errors import RequestError
from loopcast.exporter.reference import KVCache, LoopedLM


@dataclass(frozen=True)
class ReferenceResult:
    tokens: list[int]                    # generated ids (prompt excluded)
    finish_reason: str                   # "eos", "length" (max_new_tokens) or "capacity"
    step_logits: list[torch.Tensor] = field(default_factory=list, repr=False)  # [V] per token


def validate_request(model: LoopedLM, prompt_ids: list[int], max_new_tokens: int, max_length: int) -> None:
    vocab = model.config.vocab_size
    if not 1 <= max_length <= model.config.max_position_embeddings:
        raise RequestError(f"max_length {max_length} is outside 1..{model.config.max_position_embeddings} "
                           "(max_position_embeddings)")
    if not prompt_ids:
        raise RequestError("prompt is empty: give at least one token")
    bad = [t for t in prompt_ids if not 0 <= t < vocab]
    if bad:
        raise RequestError(f"token id {bad[0]} is outside the vocabulary [0, {vocab})")
    if max_new_tokens < 0:
        raise RequestError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    if len(prompt_ids) > max_length:
        raise RequestError(f"prompt of {len(prompt_ids)} tokens is longer than the max length {max_length}")


@torch.no_grad()
def greedy_generate(model: LoopedLM, prompt_ids: list[int], max_new_tokens: int, *,
                    max_length: int | None = None, stop_ids: tuple[int, ...] = (),
                    depth: int | None = None, keep_logits: bool = False) -> ReferenceResult:
    """Greedy decode with the static cache: prefill once, then one token per step.

    ``depth`` stops every step after that many loops (the shallow model). Generation ends at a
    stop id (kept in the output), after ``max_new_tokens`` or when the cache is full.
    """
    max_length = model.config.max_position_embeddings if max_length is None else max_length
    validate_request(model, prompt_ids, max_new_tokens, max_length)
    dtype = model.model.embed_tokens.weight.dtype
    device = model.model.embed_tokens.weight.device
    cache = KVCache(model.config, max_length, dtype=dtype, device=device)
    tokens: list[int] = []
    logits_kept: list[torch.Tensor] = []
    pending = list(prompt_ids)
    n = 0  # committed KV length
    reason = "length"
    while len(tokens) < max_new_tokens:
        if n + len(pending) > max_length:
            reason = "capacity"
            break
        ids = torch.tensor([pending], device=device)
        out = model(ids, start=n, cache=cache, last_loop=depth)
        n += len(pending)
        row = out.final_logits[0, -1]
        token = int(row.argmax())
        tokens.append(token)
        if keep_logits:
            logits_kept.append(row.float().cpu())
        if token in stop_ids:
            reason = "eos"
            break
        pending = [token]
    return ReferenceResult(tokens, reason, logits_kept)


@torch.no_grad()
def greedy_generate_recompute(model: LoopedLM, prompt_ids: list[int], max_new_tokens: int, *,
                              max_length: int | None = None, stop_ids: tuple[int, ...] = (),
                              depth: int | None = None, keep_logits: bool = False) -> ReferenceResult:
    """Same contract as :func:`greedy_generate`, recomputing the whole sequence every step."""
    max_length = model.config.max_position_embeddings if max_length is None else max_length
    validate_request(model, prompt_ids, max_new_tokens, max_length)
    device = model.model.embed_tokens.weight.device
    seq = list(prompt_ids)
    tokens: list[int] = []
    logits_kept: list[torch.Tensor] = []
    reason = "length"
    while len(tokens) < max_new_tokens:
        # The cached path needs room for the pending token's KV at position len(seq)-1.
        if len(seq) > max_length:
            reason = "capacity"
            break
        out = model(torch.tensor([seq], device=device), last_loop=depth)
        row = out.final_logits[0, -1]
        token = int(row.argmax())
        tokens.append(token)
        if keep_logits:
            logits_kept.append(row.float().cpu())
        if token in stop_ids:
            reason = "eos"
            break
        seq.append(token)
    return ReferenceResult(tokens, reason, logits_kept)
