"""Sampled decoding's entry point, kept for callers of ``sampled_stream``.

Sampling runs in the speculation engine's one round loop (ort_runtime/decoding/speculate.py) with a
``SampledAcceptor`` (ort_runtime/decoding/acceptors.py) in place of the greedy one: plain sampling, and
lossless speculative sampling in every mode (prompt lookup, self-speculation, the pipeline).

Self-speculation round with sampling (draft depth d, K drafts): row i of the draft graph (token
x_i, x_0 = pending) writes depth<d KV at n+i and gives q_i, the processed distribution of its
depth-d logits; x_{i+1} ~ q_i. verify_tail over the K+1 depth-d states writes depth>=d KV and
gives p_0..p_K; the rejection rule keeps a drafts and draws one token from the residual (or
the bonus row). The pipeline applies the same rule per lane: a lane's draft x ~ q (its exit
loop's distribution) is kept with probability min(1, p(x)/q(x)) when the lane before it finishes
with p, else the token is drawn from the residual and the lanes after it are discarded. The
KV invariants are the greedy rounds' (sampling changes which tokens, not which positions).
"""

from __future__ import annotations

from collections.abc import Iterator

from loopcast.ort_runtime.binding.generator import Generator
from loopcast.ort_runtime.decoding.acceptors import SampledAcceptor
from loopcast.ort_runtime.decoding.sampling import SamplingParams
from loopcast.ort_runtime.decoding.speculate import GenerationStats, SpeculationConfig, stream

__all__ = ["SampledAcceptor", "sampled_stream"]


def sampled_stream(
    gen: Generator,
    ids: list[int],
    max_new_tokens: int,
    *,
    sampling: SamplingParams,
    stop_ids: tuple[int, ...] = (),
    mode: str = "none",
    num_draft_tokens: int | None = None,
    gate: str = "auto",
    proposer=None,
    stats: GenerationStats | None = None,
    acceptor: SampledAcceptor | None = None,
    pipeline_exit: int = 1,
) -> Iterator[int]:
    """Feed ``ids`` after the committed prefix and yield sampled tokens as they are committed.
    ``acceptor`` replaces the default ``SampledAcceptor(sampling)`` (tests inject wrong rules)."""
    spec = SpeculationConfig(mode, num_draft_tokens, gate, proposer=proposer, pipeline_exit=pipeline_exit)
    return stream(
        gen,
        ids,
        max_new_tokens,
        stop_ids=stop_ids,
        spec=spec,
        stats=stats,
        sampling=sampling,
        acceptor=acceptor if acceptor is not None else SampledAcceptor(sampling),
    )
