"""Reference greedy decoding: a fixed per-slot KV cache written by position, and a no-cache
full recompute that exists only to check the cached path."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from loopcast.exporter.reference import KVCache, LoopedLM

from loopcast.errors import RequestError


@dataclass(frozen=True)
class ReferenceResult:
    tokens: list[int]  # generated ids (prompt excluded)
    finish_reason: str  # "eos", "length" (max_new_tokens) or "capacity"
    step_logits: list[torch.Tensor] = field(default_factory=list, repr=False)  # [V] per token


def validate_request(model: LoopedLM, prompt_ids: list[int], max_new_tokens: int, max_length: int) -> None:
    vocab = model.config.vocab_size
    if not 1 <= max_length <= model.config.max_position_embeddings:
        raise RequestError(
            f"max_length {max_length} is outside 1..{model.config.max_position_embeddings} "
            "(max_position_embeddings)"
        )
    if not prompt_ids:
        raise RequestError("prompt is empty: give at least one token")
    bad = [t for t in prompt_ids if not 0 <= t < vocab]
    if bad:
        raise RequestError(f"token id {bad[0]} is outside the vocabulary [0, {vocab})")
    if max_new_tokens < 0:
        raise RequestError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    if len(prompt_ids) > max_length:
        raise RequestError(f"prompt of {len(prompt_ids)} tokens is longer than the max length {max_length}")


def _greedy_loop(
    next_logits,
    prompt_ids: list[int],
    max_new_tokens: int,
    max_length: int,
    stop_ids: tuple[int, ...],
    keep_logits: bool,
) -> ReferenceResult:
    """The stopping rules both paths share; ``next_logits(pending, n)`` scores the last row."""
    tokens: list[int] = []
    kept: list[torch.Tensor] = []
    pending, n = list(prompt_ids), 0  # n: tokens already consumed (the cached path's KV length)
    while len(tokens) < max_new_tokens:
        if n + len(pending) > max_length:  # no room for the pending tokens' KV
            return ReferenceResult(tokens, "capacity", kept)
        row = next_logits(pending, n)
        n += len(pending)
        token = int(row.argmax())
        tokens.append(token)
        if keep_logits:
            kept.append(row.float().cpu())
        if token in stop_ids:
            return ReferenceResult(tokens, "eos", kept)
        pending = [token]
    return ReferenceResult(tokens, "length", kept)


@torch.no_grad()
def greedy_generate(
    model: LoopedLM,
    prompt_ids: list[int],
    max_new_tokens: int,
    *,
    max_length: int | None = None,
    stop_ids: tuple[int, ...] = (),
    depth: int | None = None,
    keep_logits: bool = False,
) -> ReferenceResult:
    """Greedy decode with the static cache: prefill once, then one token per step.

    ``depth`` stops every step after that many loops (the shallow model). Generation ends at a
    stop id (kept in the output), after ``max_new_tokens`` or when the cache is full.
    """
    max_length = model.config.max_position_embeddings if max_length is None else max_length
    validate_request(model, prompt_ids, max_new_tokens, max_length)
    weight = model.model.embed_tokens.weight
    cache = KVCache(model.config, max_length, dtype=weight.dtype, device=weight.device)

    def next_logits(pending: list[int], n: int) -> torch.Tensor:
        out = model(torch.tensor([pending], device=weight.device), start=n, cache=cache, last_loop=depth)
        return out.final_logits[0, -1]

    return _greedy_loop(next_logits, prompt_ids, max_new_tokens, max_length, stop_ids, keep_logits)


@torch.no_grad()
def greedy_generate_recompute(
    model: LoopedLM,
    prompt_ids: list[int],
    max_new_tokens: int,
    *,
    max_length: int | None = None,
    stop_ids: tuple[int, ...] = (),
    depth: int | None = None,
    keep_logits: bool = False,
) -> ReferenceResult:
    """Same contract as :func:`greedy_generate`, recomputing the whole sequence every step."""
    max_length = model.config.max_position_embeddings if max_length is None else max_length
    validate_request(model, prompt_ids, max_new_tokens, max_length)
    device = model.model.embed_tokens.weight.device
    seq: list[int] = []

    def next_logits(pending: list[int], n: int) -> torch.Tensor:
        seq.extend(pending)
        return model(torch.tensor([seq], device=device), last_loop=depth).final_logits[0, -1]

    return _greedy_loop(next_logits, prompt_ids, max_new_tokens, max_length, stop_ids, keep_logits)
