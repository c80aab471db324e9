"""One generation of a recurrent-depth (Huginn) artifact from a GenerationConfig: plain,
prompt lookup or self-speculation, greedy or sampled, with the KL exit.

The options are the ones a looped artifact takes (ort_runtime/decoding/generation_config.py):
``loops`` is r, the core steps per token (default the release's mean_recurrence, at most the
artifact's max_recurrence); ``kl_threshold``/``min_loops``/``kv_policy`` the KL exit
(loopcast/kl_exit.py); ``state_seed`` the initial state (loopcast/recurrent_state.py).

A speculative round at ``n`` (positions < n committed, the pending token p not yet run):

    propose  prompt lookup's n-gram drafts, or (self) p, d_1 .. d_K-1 one by one at
             ``draft_loops`` core steps → d_1 .. d_K, then rewind to n
    verify   [p, d_1 .. d_K] in one call at r (``RecurrentGenerator.verify``: each row's output
             as its own one-row call, the KL exit included)
    accept   greedy_accept: a drafts plus the verifier's next token; rewind to n + a + 1

KV invariant (docs/architecture.md §2): the verify call rewrites every slot of positions
n..n+K (prelude, all r core steps, coda) before any row reads them, so a committed position
holds its committed token's KV at depth r; the draft rows' shallow KV and the rejected rows'
KV lie at positions >= the new n, rewritten by the next call before any row reads them. The
tokens are plain decoding's where the artifact declares ``exact_verify`` (M-row calls equal
one-row calls bit for bit); elsewhere speculation needs ``allow_inexact``.

Sampled, a round draws self-drafts from the draft rows' processed distributions and accepts
with the rejection rule (``speculative_accept``), so the tokens keep plain sampling's
distribution (not its draws); one ``PCG64(seed)`` stream per request makes them reproducible.

The gate (``auto`` = ``hit-density``; ``always`` speculates every round) engages while recent
drafts hit (prompt lookup's free one-token guesses count on plain steps) and probes now and
then when they do not; it decides on tokens only, so it never changes a greedy token. Not
offered here: the cost gate.

The pipeline (``speculative='pipeline'``, greedy or sampled, with or without the KL exit) runs
its rounds on the ``recurrent_cycle`` graph (ort_runtime/decoding/recurrent_pipeline.py): each
round runs cycles until the oldest lane leaves the coda and gives one token; its lanes' tokens are drafted by
prompt lookup or the caller's proposer, one lane per cycle. The gate decides per round between
a pipeline round and a plain step (lanes in flight are dropped when it stands down).
"""

from __future__ import annotations

import time
from collections.abc import Generator as TokenStream

import numpy as np
from loopcast.ort_runtime.binding.recurrent_generator import RecurrentGenerator, RecurrentStep
from loopcast.ort_runtime.decoding.finish import FinishRule
from loopcast.ort_runtime.decoding.gates import HitDensityGate
from loopcast.ort_runtime.decoding.generation_config import GenerationConfig
from loopcast.ort_runtime.decoding.greedy_accept import greedy_accept
from loopcast.ort_runtime.decoding.proposers import PromptLookupProposer, Proposal, UserProposer
from loopcast.ort_runtime.decoding.protocols import ProposerBase
from loopcast.ort_runtime.decoding.recurrent_pipeline import RecurrentPipeline, pipeline_refusal
from loopcast.ort_runtime.decoding.sampling import make_rng, probabilities, sample, speculative_accept
from loopcast.ort_runtime.decoding.stats import GenerationStats

from loopcast.errors import RequestError
from loopcast.kl_exit import KLExit
from loopcast.vocab import GateKind, SpeculativeMode


class RecurrentSelfDrafts(ProposerBase):
    """Self-drafts: the pending token and each draft run one by one at ``draft_loops`` core
    steps from ``n`` (writing shallow KV there), then the generator is rewound to ``n``. Greedy
    drafts are each row's argmax; sampled ones are drawn from the row's processed distribution
    (``draw``), which the proposal carries for the rejection rule."""

    name = "self"

    def __init__(self, gen: RecurrentGenerator, draft_loops: int, draw=None) -> None:
        self.gen, self.draft_loops, self.draw = gen, draft_loops, draw

    def propose(self, context, k: int) -> Proposal:
        gen, n = self.gen, self.gen.n
        drafts: list[int] = []
        probs: list[np.ndarray] = []
        last = int(context[-1])
        for _ in range(k):
            out = gen.step([last], loops=self.draft_loops)
            if self.draw is None:
                last = int(out.next_ids[-1])
            else:
                q = self.draw(out.logits[-1], gen.tokens)
                probs.append(q)
                last = sample(q, self.draw.rng)
            drafts.append(last)
        gen.rewind(n)
        return Proposal(drafts, probs=probs if self.draw is not None else None)


class _Draw:
    """The processed distribution of a row under the request's sampling, and its one stream."""

    def __init__(self, sampling, rng) -> None:
        self.sampling, self.rng = sampling, rng

    def __call__(self, logits_V: np.ndarray, context) -> np.ndarray:
        return probabilities(logits_V, self.sampling, context)


def _refuse(gen: RecurrentGenerator, config: GenerationConfig, proposer: object | None) -> None:
    """What this family does not take, each in one line naming the option."""
    spec = config.speculation
    if config.exit_threshold is not None:
        raise RequestError(
            "exit_threshold is Ouro's exit gate; a recurrent-depth model exits on kl_threshold "
            "(the KL between successive core steps' distributions)",
            parameter="exit_threshold",
        )
    if config.kl_threshold is None and config.min_loops is not None:
        raise RequestError("min_loops goes with kl_threshold (the KL exit)", parameter="min_loops")
    if spec.mode == SpeculativeMode.PIPELINE:
        _refuse_pipeline(gen, config)
    speculating = spec.mode != SpeculativeMode.NONE or proposer is not None
    if spec.alternate_gap is not None:
        raise RequestError(
            "alternate_gap needs the tree-verify graphs, which recurrent-depth artifacts lack",
            parameter="alternate_gap",
        )
    if spec.draft_loops is not None and spec.mode != SpeculativeMode.SELF:
        raise RequestError("draft_loops goes with speculative='self'", parameter="draft_loops")
    if speculating and gen.sharing is not None:
        raise RequestError(
            "speculation needs a KV slot per (step, layer): this generator shares them (kv_sharing)"
        )
    if speculating and spec.gate == GateKind.COST:
        raise RequestError(
            "gate 'cost' prices the looped graphs' measured steps; a recurrent-depth artifact takes "
            "auto (= hit-density), hit-density or always",
            parameter="gate",
        )
    if speculating and not gen.loaded.exact_verify and not spec.allow_inexact:
        raise RequestError(
            f"speculation is not exact on this artifact on {gen.device}: its verify rows are not "
            "bit-identical to its decode rows (manifest exact_verify), so speculative tokens could "
            "differ from plain decoding; re-export it with the loopcast op library (the default "
            "--ops auto), or pass allow_inexact=True (--allow-inexact) to accept that"
        )


def _refuse_pipeline(gen: RecurrentGenerator, config: GenerationConfig) -> None:
    """What the pipeline does not take (it runs every lane through all r core steps, and drafts
    one token per lane)."""
    spec = config.speculation
    if spec.num_draft_tokens is not None or spec.pipeline_exit != 1:
        raise RequestError(
            "the recurrent-depth pipeline drafts one token per lane with its proposer (prompt lookup "
            "or the caller's); num_draft_tokens and pipeline_exit do not apply",
            parameter="num_draft_tokens" if spec.num_draft_tokens is not None else "pipeline_exit",
        )
    refusal = pipeline_refusal(gen)
    if refusal is not None:
        raise RequestError(refusal, parameter="speculative")


def _proposer(
    gen: RecurrentGenerator, config: GenerationConfig, proposer: object | None, draw: _Draw | None
) -> tuple[ProposerBase | None, int]:
    """The round's proposer and its most drafts per round."""
    spec = config.speculation
    k = spec.num_draft_tokens if spec.num_draft_tokens is not None else 4
    if proposer is not None:
        if spec.mode == SpeculativeMode.SELF:
            raise RequestError("speculative='self' drafts with fewer core steps; it takes no proposer")
        chosen = UserProposer(proposer, gen.config.vocab_size)
        if spec.mode == SpeculativeMode.PIPELINE:
            k = 1
        if chosen.caps.drafts_hidden:
            raise RequestError(
                "a recurrent-depth artifact verifies tokens; a proposer of depth-d states does not apply",
                parameter="proposer",
            )
        return chosen, k
    if spec.mode == SpeculativeMode.PROMPT_LOOKUP:
        return PromptLookupProposer(spec.min_ngram, spec.max_ngram), k
    if spec.mode == SpeculativeMode.PIPELINE:  # one draft per lane, one lane per cycle
        return PromptLookupProposer(spec.min_ngram, spec.max_ngram), 1
    if spec.mode == SpeculativeMode.SELF:
        r = gen.loops
        d = spec.draft_loops if spec.draft_loops is not None else max(1, r // 4)
        if r < 2 or not 1 <= d < r:
            raise RequestError(
                f"draft_loops must be in 1..{r - 1} (fewer core steps than loops={r}), got {d}"
                if r >= 2
                else "self-speculation drafts with fewer core steps than loops: it needs loops >= 2",
                parameter="draft_loops" if r >= 2 else "loops",
            )
        return RecurrentSelfDrafts(gen, d, draw), k
    if spec.mode == SpeculativeMode.NONE:
        return None, 0
    raise RequestError("speculative mode 'custom' needs a proposer", parameter="speculative")


def stream_recurrent(
    gen: RecurrentGenerator,
    ids: list[int],
    config: GenerationConfig = GenerationConfig(),
    *,
    stats: GenerationStats | None = None,
    proposer: object | None = None,
    trace: bool = False,
) -> TokenStream[int, None, None]:
    """Feed ``ids`` after the committed prefix and yield tokens as they are committed, with the
    looped engine's finish rule (ort_runtime/decoding/finish.py): "eos" at a stop id (yielded),
    "length" at max_new_tokens or the KV capacity; on finish (or close) ``n`` is what plain
    decoding leaves: the prefix, the input and every yielded token but the last. ``trace``: the
    pipeline's cycles in ``stats.pipeline_trace`` (tests)."""
    if not isinstance(config, GenerationConfig):
        raise RequestError(f"config must be a GenerationConfig, got {type(config).__name__}")
    if not ids:
        raise RequestError("prompt is empty: give at least one token")
    stats = stats if stats is not None else GenerationStats()
    _refuse(gen, config, proposer)
    if gen.n + len(ids) > gen.max_length:
        raise RequestError(
            f"prompt of {len(ids)} tokens after {gen.n} committed ones is longer than the max length "
            f"{gen.max_length}"
        )
    gen.configure(config.loops, config.state_seed)
    kl = (
        KLExit(config.kl_threshold, config.min_loops or 1, config.kv_policy.value)
        if config.kl_threshold is not None
        else None
    )
    rng = make_rng(config.sampling) if config.sampled else None
    draw = _Draw(config.sampling, rng) if rng is not None else None
    chosen, k_max = _proposer(gen, config, proposer, draw)
    if chosen is not None and kl is not None and kl.kv_policy != "full":
        raise RequestError(
            "speculation with the KL exit needs kv_policy 'full': with 'last-exited' a token's "
            "skipped-step KV depends on its exit, which a verify call over several rows cannot know",
            parameter="kv_policy",
        )
    spec = config.speculation
    stats.prompt_tokens = len(ids)
    stats.speculative = "none" if chosen is None else (spec.mode.value if proposer is None else "custom")
    pipeline = (
        RecurrentPipeline(gen, chosen, trace=trace, draw=draw, kl_exit=kl)
        if chosen is not None and spec.mode == SpeculativeMode.PIPELINE
        else None
    )
    strategies = {SpeculativeMode.SELF: "draft+verify", SpeculativeMode.PIPELINE: "pipeline"}
    stats.strategy = "decode" if chosen is None else strategies.get(spec.mode, "verify")
    stats.gate = "none"
    stats.exact_verify = gen.loaded.exact_verify
    stats.exact_greedy = chosen is None or stats.exact_verify
    stats.kv_policy = config.kv_policy.value if kl is not None else ""
    stats.finish_reason = ""
    # The gate decides on the tokens alone (whether recent drafts hit), so greedy tokens do not
    # depend on it and sampled ones are reproducible with a seed.
    gate = (
        HitDensityGate(k_max, chosen_by="auto" if spec.gate == GateKind.AUTO else "caller")
        if chosen is not None and spec.gate != GateKind.ALWAYS
        else None
    )
    rule = FinishRule(config.max_new_tokens, frozenset(config.stop_ids or ()), gen.max_length)
    base, started, runs0 = gen.n, time.perf_counter(), gen.core_runs
    # the pipeline's lanes: up to the position of the last token it will run, inside the KV
    limit_position = min(gen.max_length - 1, base + len(ids) + config.max_new_tokens - 2)
    after_prompt = runs0
    exits: list[int] = []
    emitted = step = 0

    def finish(reason: str) -> None:
        stats.finish_reason = reason
        gen.rewind(min(gen.n, base + len(ids) + emitted - 1) if emitted else base)
        stats.new_tokens = emitted
        stats.seconds = time.perf_counter() - started
        stats.tokens_per_second = emitted / stats.seconds if stats.seconds > 0 else 0.0
        stats.tokens_per_round = (stats.accepted + stats.rounds) / stats.rounds if stats.rounds else 0.0
        stats.core_calls_per_token = round((gen.core_runs - runs0) / emitted, 4) if emitted else 0.0
        stats.core_passes = gen.core_runs - after_prompt  # the prompt's passes left out, as for looped models
        _exit_stats(stats, exits[:emitted])
        if pipeline is not None:
            pipeline.stop()  # lanes still in flight
            stats.cycles, stats.discarded_lanes = pipeline.stats.cycles, pipeline.stats.discarded_lanes
            stats.pipeline_trace = pipeline.stats.trace
        if gate is not None:
            stats.gate_report, stats.gate_transitions = gate.report(), gate.transitions

    if config.max_new_tokens == 0:
        finish("length")
        return
    if chosen is not None:
        chosen.reset(gen)
        stats.gate = "always" if gate is None else gate.name

    def pick(out: RecurrentStep) -> int:
        if draw is None:
            return int(out.next_ids[-1])
        return sample(draw(out.logits[-1], gen.tokens), draw.rng)

    try:
        out = gen.step(list(ids), kl_exit=kl)
        after_prompt = gen.core_runs
        new_tokens, new_exits = [pick(out)], [out.exit_loops]
        while True:
            last = len(new_tokens) - 1
            for i, token in enumerate(new_tokens):
                emitted += 1
                exits.append(new_exits[i])
                stats.new_tokens = emitted
                yield token
                reason = rule.after(token, emitted, gen.n - (last - i))
                if reason is not None:
                    finish(reason)
                    return
            pending = new_tokens[-1]
            n = gen.n
            # the verify writes positions n..n+k: k drafts fit while n + k < max_length
            k = min(k_max, gen.max_length - n - 1, config.max_new_tokens - emitted)
            drafts: list[int] = []
            draft_probs = guess = None
            step += 1
            if chosen is not None and k > 0:
                engaged = k if gate is None else gate.engage(step)
                if engaged and pipeline is not None:
                    new_tokens = [_pipeline_round(pipeline, pending, limit_position, stats, gate, step)]
                    new_exits = [pipeline.last_exit]
                    continue
                if engaged:
                    raw = chosen.propose([*gen.tokens, pending], min(k, engaged))
                    drafts = list(raw.tokens if isinstance(raw, Proposal) else raw)[:k]
                    draft_probs = (
                        raw.probs[: len(drafts)] if isinstance(raw, Proposal) and raw.probs else None
                    )
                elif chosen.caps.free_guess:  # free evidence for the gate: would a draft have hit?
                    raw = chosen.propose([*gen.tokens, pending], 1)
                    guess = list(raw.tokens if isinstance(raw, Proposal) else raw)
            if not drafts:
                if pipeline is not None:
                    pipeline.stop()  # a plain step: the lanes' KV is rewritten from n on
                out = gen.step([pending], kl_exit=kl)
                new_tokens, new_exits = [pick(out)], [out.exit_loops]
                if chosen is not None:
                    chosen.advance([pending])
                if gate is not None and guess is not None:
                    gate.observe(0, 0, would_hit=bool(guess) and guess[0] == new_tokens[0], step=step)
                continue
            out = gen.verify([pending, *drafts], kl)
            if draw is None:
                guard = spec.tie_guard  # counts near ties; tolerant (never the default) accepts them
                result = greedy_accept(
                    drafts, out.next_ids.tolist(), out.logits, epsilon=guard.epsilon, tolerant=guard.tolerant
                )
                a, next_token = result.accepted, result.next_token
                stats.near_tie_rejections += result.near_tie_rejections
                stats.tolerant_accepts += result.tolerant_accepts
                stats.exact_greedy = stats.exact_greedy and result.tolerant_accepts == 0
            else:  # the rejection rule keeps plain sampling's distribution (row i: after drafts[:i])
                targets = [draw(out.logits[i], gen.tokens[: n + i + 1]) for i in range(len(drafts) + 1)]
                a, next_token = speculative_accept(drafts, draft_probs, targets, draw.rng)
            gen.rewind(n + a + 1)
            if chosen is not None:
                chosen.advance([pending, *drafts[:a]])
            stats.rounds += 1
            stats.proposed += len(drafts)
            stats.accepted += a
            if gate is not None:
                gate.observe(len(drafts), a, step=step)
            new_tokens = [*drafts[:a], next_token]
            new_exits = list(out.row_exits[: a + 1]) if out.row_exits else [out.exit_loops] * (a + 1)
    finally:
        if not stats.finish_reason:  # closed early or failed: n back to the yielded tokens
            gen.rewind(min(gen.n, base + len(ids) + emitted - 1) if emitted else base)


def _pipeline_round(
    pipeline: RecurrentPipeline, pending: int, limit: int, stats: GenerationStats, gate, step: int
) -> int:
    """One pipeline round: cycles until the oldest lane leaves; its successor's check counts as
    one draft proposed (and accepted if kept), as a one-draft verify round would. For the gate a
    leaving lane without a successor is a miss too (the proposer had no draft, so the round cost
    r cycles for one token); at r = 1 a lane leaves as it enters and rounds give no evidence."""
    verified, accepted = pipeline.stats.verified, pipeline.stats.accepted
    token = pipeline.next_token(pending, limit)
    proposed, kept = pipeline.stats.verified - verified, pipeline.stats.accepted - accepted
    stats.rounds += 1
    stats.proposed += proposed
    stats.accepted += kept
    if gate is not None:
        gate.observe(proposed or int(pipeline.r > 1), kept, step=step)
    return token


def _exit_stats(stats: GenerationStats, exits: list[int]) -> None:
    """Each new token's core steps (r, or its KL exit) as a histogram and a mean."""
    histogram: dict[int, int] = {}
    for k in exits:
        histogram[k] = histogram.get(k, 0) + 1
    stats.exit_histogram = dict(sorted(histogram.items()))
    stats.mean_loops = round(sum(exits) / len(exits), 4) if exits else 0.0
