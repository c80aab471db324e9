"""The decoding loop: plain greedy and the one speculation loop shared by all proposers.

Self-speculation round (draft depth d, K drafts), the KV invariant:

    pending p and drafts x1..xK sit at positions n..n+K.
    draft graph, one row at a time: row i (token x_i, x_0 = p) at position n+i writes the
    depth<d slots at n+i and yields x_{i+1} and h_i, the loop-normed state at depth d.
    verify_tail over h_0..h_K at positions n..n+K writes the depth>=d slots there and yields
    the full-depth argmax t_0..t_K.
    greedy_accept → a; commit p, x1..xa (n += a+1); the next pending token is t_a.

Rows a+1..K hold stale KV of rejected tokens at positions ≥ n+a+1 — past the new ``n``. Every
row attends only to positions ≤ its own, and the next round's rows start at the new ``n`` and
rewrite each position before a later row can read it, so no surviving row ever reads KV of a
rejected token. Prompt-lookup rounds are the same with the ``verify`` graph (all depths) in
place of draft + verify_tail.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field

import numpy as np

from loopcast.errors import RequestError
from loopcast.manifest import DECODE, DRAFT, VERIFY, VERIFY_TAIL
from loopcast.ort_runtime.generator import Generator
from loopcast.ort_runtime.speculate import (AlwaysGate, CostGate, HitDensityGate, PromptLookupProposer,
                                            SelfDraftProposer, TieGuard, greedy_accept)

MODES = ("none", "prompt-lookup", "self")
GATES = ("none", "hit-density", "cost")


@dataclass(frozen=True)
class SpeculationConfig:
    mode: str = "none"
    num_draft_tokens: int | None = None   # K; default W-1
    gate: str = "none"
    min_ngram: int = 1
    max_ngram: int = 3
    tie_guard: TieGuard = TieGuard()
    proposer: object | None = None        # inject a proposer with .propose(context, k) (tests)
    costs: object | None = None           # inject step costs (.decode(), .round(k)); default: measured


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    new_tokens: int = 0
    finish_reason: str = ""
    seconds: float = 0.0
    tokens_per_second: float = 0.0
    speculative: str = "none"
    gate: str = "none"
    rounds: int = 0
    proposed: int = 0
    accepted: int = 0
    tokens_per_round: float = 0.0
    proposed_by_position: list[int] = field(default_factory=list)
    accepted_by_position: list[int] = field(default_factory=list)
    near_tie_rejections: int = 0
    tolerant_accepts: int = 0
    exact_greedy: bool = True
    gate_transitions: int = 0
    steps: dict[str, int] = field(default_factory=dict)
    step_seconds: dict[str, float] = field(default_factory=dict)

    def as_dict(self) -> dict:
        out = asdict(self)
        out["step_seconds"] = {k: round(v, 6) for k, v in out["step_seconds"].items()}
        return out


class StepCosts:
    """Measured mean step time per graph kind on this machine (the cost gate's input)."""

    def __init__(self, gen: Generator, draft_depth: int | None, mode: str) -> None:
        self.gen, self.mode = gen, mode
        self.depth_share = (draft_depth or 1) / gen.model.config.num_loops

    def _mean(self, kind: str) -> float | None:
        # Steady runs only: a CUDA slot's first run (warm-up + capture) costs many steps.
        count = self.gen.timed_counts.get(kind, 0)
        return self.gen.timed_seconds[kind] / count if count else None

    def decode(self) -> float:
        return self._mean(DECODE) or 1e-3

    def round(self, k: int) -> float:
        decode = self.decode()
        if self.mode == "self":
            draft = self._mean(DRAFT) or decode * self.depth_share
            tail = self._mean(VERIFY_TAIL) or decode * (1 - self.depth_share) * 1.2
            return (k + 1) * draft + tail
        return self._mean(VERIFY) or decode * 1.2


def _make_gate(spec: SpeculationConfig, k: int, costs: StepCosts):
    if spec.gate == "hit-density":
        return HitDensityGate(k)
    if spec.gate == "cost":
        return CostGate(k, costs)
    return AlwaysGate(k)


def stream(gen: Generator, ids: list[int], max_new_tokens: int, *, stop_ids: tuple[int, ...] = (),
           spec: SpeculationConfig = SpeculationConfig(), stats: GenerationStats | None = None) -> Iterator[int]:
    """Feed ``ids`` after the committed prefix and yield greedy tokens as they are committed.

    Finish reasons: "eos" (a stop id, yielded), "length" (max_new_tokens, or the KV capacity).
    On finish ``n`` equals what plain greedy would leave: the prefix, the input, and every
    yielded token but the last (which is pending: its KV is not written).
    """
    stats = stats if stats is not None else GenerationStats()
    if spec.mode not in MODES:
        raise RequestError(f"unknown speculative mode {spec.mode!r}; choose from {', '.join(MODES)}")
    if spec.gate not in GATES:
        raise RequestError(f"unknown gate {spec.gate!r}; choose from {', '.join(GATES)}")
    if max_new_tokens < 0:
        raise RequestError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    if not ids:
        raise RequestError("prompt is empty: give at least one token")
    gen.validate_ids(ids)
    proposer, k_max = _proposer(gen, spec)
    stats.prompt_tokens, stats.speculative, stats.gate = len(ids), spec.mode, spec.gate
    base = gen.n
    start = time.perf_counter()
    counts0, secs0 = dict(gen.step_counts), dict(gen.step_seconds)

    def finish(reason: str, emitted: int = 0) -> None:
        stats.finish_reason = reason
        gen.rewind(min(gen.n, base + len(ids) + emitted - 1))
        stats.seconds = time.perf_counter() - start
        stats.new_tokens = emitted
        stats.tokens_per_second = emitted / stats.seconds if stats.seconds > 0 else 0.0
        stats.tokens_per_round = (stats.accepted + stats.rounds) / stats.rounds if stats.rounds else 0.0
        stats.steps = {k: gen.step_counts[k] - counts0.get(k, 0) for k in gen.step_counts}
        stats.step_seconds = {k: gen.step_seconds[k] - secs0.get(k, 0.0) for k in gen.step_seconds}

    if max_new_tokens == 0:
        finish("length")
        return
    try:
        yield from _decode_loop(gen, ids, max_new_tokens, stop_ids, spec, stats, proposer, k_max, finish)
    finally:
        # A consumer that stops early (close(), break) or an error mid-round must not leave
        # ``n`` past the yielded tokens: rounds commit drafts before yielding them.
        if not stats.finish_reason:
            emitted = stats.new_tokens
            gen.rewind(min(gen.n, base + len(ids) + emitted - 1) if emitted else base)


def _decode_loop(gen: Generator, ids: list[int], max_new_tokens: int, stop_ids: tuple[int, ...],
                 spec: SpeculationConfig, stats: GenerationStats, proposer, k_max: int, finish) -> Iterator[int]:
    pending = gen.prefill(ids)
    costs = spec.costs or StepCosts(gen, gen.model.manifest.draft_depth, spec.mode)
    gate = _make_gate(spec, k_max, costs) if proposer is not None else None
    step = 0
    new_tokens = [pending]
    emitted = 0
    while True:
        for token in new_tokens:
            emitted += 1
            stats.new_tokens = emitted
            yield token
            if token in stop_ids:
                finish("eos", emitted)
                return
            if emitted >= max_new_tokens:
                finish("length", emitted)
                return
        if gen.n >= gen.max_length:  # no room for the pending token's KV
            finish("length", emitted)
            return
        step += 1
        new_tokens = None
        k = gate.engage(step) if gate is not None else None
        width = gen.rows(VERIFY_TAIL if spec.mode == "self" else VERIFY) if proposer is not None else None
        if k and gen.n + width <= gen.max_length:
            k = min(k, width - 1, max_new_tokens - emitted)
            outcome = _round(gen, proposer, pending, k, spec, stats)
            if outcome is not None:
                new_tokens, proposed, accepted = outcome
                gate.observe(proposed, accepted, step=step)
        if new_tokens is None:
            guess = proposer.propose(gen.tokens + [pending], 1) if isinstance(proposer, PromptLookupProposer) else None
            token = gen.decode(pending)
            if gate is not None and guess is not None:
                gate.observe(0, 0, would_hit=bool(guess) and guess[0] == token, step=step)
            new_tokens = [token]
        pending = new_tokens[-1]
        stats.gate_transitions = getattr(gate, "transitions", 0)


def _proposer(gen: Generator, spec: SpeculationConfig):
    if spec.mode == "none":
        return None, 0
    kind = VERIFY_TAIL if spec.mode == "self" else VERIFY
    if not gen.has_kind(kind) or (spec.mode == "self" and not gen.has_kind(DRAFT)):
        raise RequestError(f"speculative mode {spec.mode!r} needs the {kind} graph, which this artifact "
                           "lacks (self-speculation needs a looped model, R > 1)")
    width = gen.rows(kind)
    k = spec.num_draft_tokens if spec.num_draft_tokens is not None else width - 1
    if not 1 <= k <= width - 1:
        raise RequestError(f"--num-draft-tokens must be in 1..{width - 1} (verify width {width}), got {k}")
    if spec.proposer is not None:
        if spec.mode == "self" and not isinstance(spec.proposer, SelfDraftProposer):
            raise RequestError("speculative mode 'self' takes a SelfDraftProposer")
        return spec.proposer, k
    if spec.mode == "self":
        return SelfDraftProposer(), k
    return PromptLookupProposer(spec.min_ngram, spec.max_ngram), k


def _round(gen: Generator, proposer, pending: int, k: int, spec: SpeculationConfig,
           stats: GenerationStats) -> tuple[list[int], int, int] | None:
    """One speculative round → (new tokens, proposed, accepted), or None to fall back to decode."""
    n = gen.n
    if isinstance(proposer, SelfDraftProposer):
        rows_in, hidden = [pending], []
        for i in range(k + 1):
            out = gen.run(DRAFT, n + i, tokens=[rows_in[i]], want_logits=False)
            hidden.append(out.hidden[0])
            if i < k:
                token = proposer.adjust(i, int(out.next_ids[0]))
                if not 0 <= token < gen.model.config.vocab_size:
                    raise RequestError(f"self-draft token {token} is outside the vocabulary")
                rows_in.append(token)
        drafts = rows_in[1:]
        verified = gen.run(VERIFY_TAIL, n, hidden=np.stack(hidden))
    else:
        drafts = [int(t) for t in proposer.propose(gen.tokens + [pending], k)][:k]
        if not drafts:
            return None
        vocab = gen.model.config.vocab_size
        if any(not 0 <= t < vocab for t in drafts):
            raise RequestError(f"proposer {getattr(proposer, 'name', proposer)!r} offered a token outside the vocabulary")
        verified = gen.run(VERIFY, n, tokens=[pending] + drafts)
    guard = spec.tie_guard
    result = greedy_accept(drafts, verified.next_ids, verified.logits, epsilon=guard.epsilon, tolerant=guard.tolerant)
    gen.commit([pending] + drafts[:result.accepted])
    stats.rounds += 1
    stats.proposed += len(drafts)
    stats.accepted += result.accepted
    stats.near_tie_rejections += result.near_tie_rejections
    stats.tolerant_accepts += result.tolerant_accepts
    stats.exact_greedy = stats.exact_greedy and result.tolerant_accepts == 0
    for i in range(len(drafts)):
        if len(stats.proposed_by_position) <= i:
            stats.proposed_by_position.append(0)
            stats.accepted_by_position.append(0)
        stats.proposed_by_position[i] += 1
        stats.accepted_by_position[i] += int(i < result.accepted)
    return drafts[:result.accepted] + [result.next_token], len(drafts), result.accepted
