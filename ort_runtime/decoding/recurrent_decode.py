"""Decoding a recurrent-depth (Huginn) artifact: greedy or sampled, with the KL exit.

One loop over ``RecurrentGenerator.step``: the prompt in one call, then one token per call, each
at the generator's depth r (or less, where the KL exit stops a call early: loopcast/kl_exit.py).
Sampling is the project's (ort_runtime/decoding/sampling.py: the processed distribution over
the pulled logits row, one ``PCG64(seed)`` stream per request), so a seed fixes the tokens for
an artifact, device, r, state seed and exit rule.
"""

from __future__ import annotations

import time

from loopcast.ort_runtime.binding.recurrent_generator import RecurrentGenerator
from loopcast.ort_runtime.decoding.sampling import SamplingParams, make_rng, probabilities, sample
from loopcast.ort_runtime.decoding.stats import GenerationStats

from loopcast.errors import RequestError
from loopcast.kl_exit import KLExit


def decode_recurrent(
    generator: RecurrentGenerator,
    prompt: list[int],
    max_new_tokens: int,
    *,
    sampling: SamplingParams | None = None,
    kl_exit: KLExit | None = None,
    stop_ids: tuple[int, ...] = (),
) -> tuple[list[int], GenerationStats, list[int]]:
    """The new tokens, the stats record and each token's core steps (r, or its exit step)."""
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise RequestError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
    if not prompt:
        raise RequestError("prompt is empty: give at least one token")
    greedy = sampling is None or sampling.greedy
    rng = None if greedy else make_rng(sampling)
    stats = GenerationStats(prompt_tokens=len(prompt))
    started = time.perf_counter()
    generator.rewind(0)
    out = generator.step(list(prompt), kl_exit=kl_exit)
    context = list(prompt)
    tokens: list[int] = []
    steps: list[int] = []
    while True:
        row = out.logits[-1]
        if greedy:
            token = int(out.next_ids[-1])
        else:
            token = sample(probabilities(row, sampling, context), rng)
        tokens.append(token)
        context.append(token)
        steps.append(out.exit_loops)
        if token in stop_ids:
            stats.finish_reason = "stop"
            break
        if len(tokens) >= max_new_tokens or generator.n >= generator.max_length:
            stats.finish_reason = "length"
            break
        out = generator.step([token], kl_exit=kl_exit)
    stats.new_tokens = len(tokens)
    stats.seconds = time.perf_counter() - started
    stats.tokens_per_second = stats.new_tokens / stats.seconds if stats.seconds else 0.0
    stats.core_calls_per_token = sum(steps) / len(steps)
    return tokens, stats, steps
