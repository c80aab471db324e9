"""The speculation engine: one round loop for plain decoding and every proposer.

A round (gpt-fast's loop; ORT-GenAI's Propose / Advance / Reset):

    gate.engage ─▶ k drafts?  ── no ──▶ PlainDecode (the degenerate round: no drafts)
                      │ yes
                proposer.propose(context, k) ─▶ Proposal (tokens [+ depth-d states])
                      ▼
                strategy.verify ─▶ the verifier's argmax per row (pending + drafts)
                      ▼
                acceptor.accept ─▶ a accepted drafts + the correction / bonus token
                      │  (greedy_accept, or sampling's rejection rule: ort_runtime/decoding/acceptors.py)
                      ▼
                commit pending + a drafts (n += a + 1), proposer.advance, gate.observe, stats

The KV invariant (docs/architecture.md, "Speculation"): a round writes KV at positions
n..n+W-1 and commits only n..n+a. Rows past the accepted prefix hold stale KV of rejected
tokens at positions >= the new ``n``; every row attends only to positions <= its own, and the
next round's rows start at the new ``n`` and rewrite each position before a later row reads
it, so no surviving row ever reads KV of a rejected token. For self-speculation (draft depth
d) the draft rows write depth<d KV at n..n+K and verify_tail writes depth>=d KV at the same
positions; both are covered by the same argument.

An alternate suffix (``--alternate-gap``, docs/architecture.md §5 "Alternate suffix") writes
its rows at scratch positions n+K+1.. and masks the primary rows after its fork, while the
primary rows never see positions > their own: no row reads KV of the other branch. When the
branch wins, its KV is copied into place (``Generator.move_kv``) before ``n`` moves past it;
when it loses, its scratch KV lies past the new ``n`` like any rejected row's.

Exactness: every mode returns plain greedy's tokens when the artifact's verify rows are
bit-identical to its decode rows on this device (manifest ``exact_verify``). Speculation on
an artifact without that property is refused unless the caller opts in (``allow_inexact``);
then ``stats.exact_greedy`` is false.
"""

from __future__ import annotations

import time
from collections.abc import Generator as Generator_
from collections.abc import Iterator
from dataclasses import dataclass

from loopcast.ort_runtime.binding.generator import Generator
from loopcast.ort_runtime.decoding.acceptors import GreedyAcceptor, SampledAcceptor, accept_round
from loopcast.ort_runtime.decoding.exit_lanes import ExitGateLanes
from loopcast.ort_runtime.decoding.exits import ExitGate, GatedAcceptor
from loopcast.ort_runtime.decoding.finish import Finisher, FinishRule
from loopcast.ort_runtime.decoding.gates import (
    DECODE_ROUND,
    SPEC_ROUND,
    SPEC_ROUND_CALLS,
    SPEC_ROUND_DEVICE,
    GatedRowCosts,
    HitDensityGate,
    StepCosts,
    make_gate,
)
from loopcast.ort_runtime.decoding.generation_config import GenerationConfig, SpeculationConfig
from loopcast.ort_runtime.decoding.pipeline import DECODE_ROUND_TIMER, ExitDrafts, PipelineCycles
from loopcast.ort_runtime.decoding.proposers import (
    AlternateDraftProposer,
    PromptLookupProposer,
    Proposal,
    SelfDraftProposer,
    UserProposer,
)
from loopcast.ort_runtime.decoding.protocols import Acceptor, Costs, Gate, Proposer, ProposerBase, Verifier
from loopcast.ort_runtime.decoding.stats import GenerationStats
from loopcast.ort_runtime.decoding.verifiers import DraftTail, TreeTail, VerifyRows

from loopcast.errors import RequestError
from loopcast.manifest import DECODE
from loopcast.vocab import GateKind, GraphKind, KVPolicy, SpeculativeMode

__all__ = ["GenerationConfig", "GenerationStats", "SpeculationConfig", "require_exact", "stream"]


@dataclass(frozen=True)
class _Plan:
    """What a generation speculates with: decided once, before the prompt runs."""

    proposer: Proposer
    strategy: Verifier
    k_max: int
    width: int  # positions a round writes (the verify graph's fixed rows)


_BUILTIN_PROPOSERS = (PromptLookupProposer, SelfDraftProposer, AlternateDraftProposer, ExitDrafts)


def _plan(
    gen: Generator,
    spec: SpeculationConfig,
    sampled: bool,
    proposer: object | None = None,
    verifier: Verifier | None = None,
    gated: bool = False,
) -> _Plan | None:
    """The proposer and the strategy of a generation. ``proposer``/``verifier``: objects the
    caller injects (a user's proposer; tests' hooked drafters and traced pipelines); ``gated``:
    the exit gate reads each token (the pipeline's lanes then exit at their gates)."""
    mode = spec.mode
    alternate = spec.alternate_gap is not None or isinstance(proposer, AlternateDraftProposer)
    if alternate:  # before the early returns: an alternate gap is never ignored
        _check_alternate(spec, sampled, proposer)
    if mode == SpeculativeMode.NONE and proposer is None:
        return None
    if mode == SpeculativeMode.PIPELINE:
        return _plan_pipeline(gen, spec, sampled, proposer, verifier, gated)
    if verifier is not None:
        raise RequestError("a verifier object goes with speculative='pipeline' only")
    if sampled and mode == SpeculativeMode.SELF and proposer is not None:
        raise RequestError("sampled self-speculation drafts from the draft graph; it takes no proposer")
    vocab = gen.model.config.vocab_size
    chosen: ProposerBase
    if spec.alternate_gap is not None and proposer is None:
        chosen = AlternateDraftProposer(spec.alternate_gap)
    elif proposer is not None:
        chosen = (
            proposer
            if isinstance(proposer, _BUILTIN_PROPOSERS)
            else UserProposer(proposer, vocab, gen.model.config.hidden_size)
        )
        if mode == SpeculativeMode.SELF and not chosen.caps.drafts_hidden:
            raise RequestError(
                "speculative mode 'self' takes a proposer that drafts depth-d states "
                "(drafts_hidden), such as SelfDraftProposer"
            )
        if mode == SpeculativeMode.PROMPT_LOOKUP and chosen.caps.drafts_hidden:
            raise RequestError(
                "speculative mode 'prompt-lookup' takes a token proposer, not a depth-d drafter"
            )
    elif mode == SpeculativeMode.SELF:
        chosen = SelfDraftProposer()
    elif mode == SpeculativeMode.PROMPT_LOOKUP:
        chosen = PromptLookupProposer(spec.min_ngram, spec.max_ngram)
    else:
        raise RequestError("speculative mode 'custom' needs a proposer")
    strategy: Verifier = (
        TreeTail() if alternate else DraftTail() if chosen.caps.drafts_hidden else VerifyRows()
    )
    missing = [k for k in strategy.kinds if not gen.has_kind(k)]
    if missing and alternate:
        raise RequestError(
            f"alternate_gap needs the {' and '.join(strategy.kinds)} graphs; this artifact lacks "
            f"{', '.join(missing)} (re-export it with --tree-verify)"
        )
    if missing:
        raise RequestError(
            f"speculative mode {mode.value!r} needs the {' and '.join(strategy.kinds)} graphs; "
            f"this artifact lacks {', '.join(missing)}"
            + (" (self-speculation needs a looped model, R > 1)" if chosen.caps.drafts_hidden else "")
        )
    require_exact(gen, spec.allow_inexact)
    k_max = strategy.max_drafts(gen)
    # With an alternate suffix the default leaves one row of the verify width for the branch.
    default = max(k_max - 1, 1) if alternate else k_max
    k = spec.num_draft_tokens if spec.num_draft_tokens is not None else default
    if not 1 <= k <= k_max:
        raise RequestError(f"num_draft_tokens must be in 1..{k_max} (verify width {k_max + 1}), got {k}")
    return _Plan(chosen, strategy, k, k_max + 1)


def _check_alternate(spec: SpeculationConfig, sampled: bool, proposer: object | None) -> None:
    """The alternate suffix's boundary checks: greedy self-speculation."""
    if spec.mode != SpeculativeMode.SELF:
        raise RequestError(
            f"alternate_gap forks self-drafts; it goes with speculative='self', not {spec.mode.value!r}"
        )
    if sampled:
        raise RequestError(
            "alternate_gap is greedy-only: a second branch would need its own rejection rule to "
            "keep sampling's distribution; drop it or sample without it"
        )
    if spec.alternate_gap is not None and proposer is not None:
        raise RequestError("give either alternate_gap or an AlternateDraftProposer, not both")


def _plan_pipeline(
    gen: Generator,
    spec: SpeculationConfig,
    sampled: bool,
    proposer: object | None,
    verifier: Verifier | None,
    gated: bool,
) -> _Plan:
    if proposer is not None and not isinstance(proposer, ExitDrafts):
        raise RequestError("speculative mode 'pipeline' drafts inside its cycles and takes no proposer")
    lanes = ExitGateLanes if gated else PipelineCycles
    if verifier is not None and (
        not isinstance(verifier, PipelineCycles) or gated != isinstance(verifier, ExitGateLanes)
    ):
        raise RequestError(f"speculative mode 'pipeline' runs {lanes.__name__} here; got another verifier")
    if spec.num_draft_tokens is not None:
        raise RequestError(
            "num_draft_tokens does not apply to the pipeline (one lane per loop); "
            "use pipeline_exit to choose the drafting loop"
        )
    drafter = proposer if proposer is not None else ExitDrafts()
    if sampled and drafter.replaces_drafts:
        raise RequestError(
            "the pipeline's draft hook replaces sampled drafts, which breaks the rejection rule; "
            "use it with greedy decoding only"
        )
    strategy = verifier or (
        ExitGateLanes(spec.pipeline_exit)
        if gated
        else PipelineCycles(spec.pipeline_exit, device_lanes=spec.pipeline_device_lanes)
    )
    strategy.prepare(gen)
    require_exact(gen, spec.allow_inexact)
    return _Plan(drafter, strategy, 1, 1)


def _set_depth(gen: Generator, config: GenerationConfig) -> None:
    """The generation's static depth (``loops``) on the generator, or a refusal of what does
    not compose with it: self-speculation and the pipeline verify at full depth (their tails and
    lanes run loops d..R-1), prompt lookup verifies at depth k (``verify@k``) and composes."""
    R = gen.model.config.num_loops
    loops = config.loops
    if config.gated:
        mode = config.speculation.mode
        if mode not in (SpeculativeMode.NONE, SpeculativeMode.PIPELINE) or config.sampled:
            raise RequestError(
                "exit_threshold runs greedy, plain or with speculative='pipeline' (drafts verified "
                "at each token's exit loop): drop the sampling options and other speculative modes, "
                "or use loops=k (which composes with prompt lookup)",
                parameter="exit_threshold",
            )
        if mode == SpeculativeMode.PIPELINE and config.kv_policy != KVPolicy.FULL:
            raise RequestError(
                f"kv_policy {config.kv_policy.value!r} skips loops, and the pipeline's lanes run every "
                "loop: exit_threshold with speculative='pipeline' takes kv_policy 'full'",
                parameter="kv_policy",
            )
        if not gen.has_kind(GraphKind.LOOP_STEP):
            raise RequestError(
                "exit_threshold needs the exits graphs, which this artifact lacks (a looped model "
                "with an exit gate, such as Ouro, exported by this loopcast)",
                parameter="exit_threshold",
            )
    if loops is not None and not 1 <= loops <= R:
        raise RequestError(f"loops must be in 1..{R} (the model's loops), got {loops}")
    shallow = loops is not None and loops < R
    mode = config.speculation.mode
    if shallow and mode in (SpeculativeMode.SELF, SpeculativeMode.PIPELINE):
        raise RequestError(
            f"speculative mode {mode.value!r} verifies at full depth (loops {R}); with loops={loops} "
            "use speculative='prompt-lookup' or none",
            parameter="loops",
        )
    gen.set_depth(loops)


def require_exact(gen: Generator, allow_inexact: bool) -> None:
    """Speculation only where the artifact declares verify rows == decode rows on this device,
    unless the caller accepts tokens that may differ from plain decoding."""
    if not gen.model.exact_verify and not allow_inexact:
        # Unprepacked CPU sessions (share_weights=True) lose the manifest's exactness, not the artifact.
        if not gen.model.prepacked:
            fix = "open it without share_weights=True"
        elif gen.model.device == "cuda":
            fix = "re-export it with --target cuda"
        else:  # the CPU's exact graphs are the default export's, given the op library
            fix = (
                "re-export it with the loopcast op library available (run tools/c_generate/fetch_deps.sh, "
                "then loopcast export: the default --ops auto then writes exact loopcast-attention graphs)"
            )
        raise RequestError(
            f"speculation is not exact on this artifact on {gen.model.device}: its verify rows are not "
            "bit-identical to its decode rows (manifest exact_verify), so speculative tokens could differ "
            f"from plain greedy; {fix}, or pass allow_inexact=True (--allow-inexact on the command "
            "line) to accept that"
        )


def stream(
    gen: Generator,
    ids: list[int],
    config: GenerationConfig = GenerationConfig(),
    *,
    stats: GenerationStats | None = None,
    proposer: object | None = None,
    verifier: Verifier | None = None,
    acceptor: Acceptor | None = None,
    costs: Costs | None = None,
) -> Generator_[int, None, None]:
    """Feed ``ids`` after the committed prefix and yield tokens as they are committed: greedy,
    or drawn with ``config.sampling`` (every speculative mode then keeps plain sampling's
    distribution). Injected parts replace the defaults the config implies: a ``proposer``
    (a user's own, or a hooked drafter), a ``verifier`` (the pipeline's), an ``acceptor`` (tests
    of the rejection rule) and fixed step ``costs`` (tests of the gate).

    ``config.stop_ids`` None means no stop id here (the API resolves the artifact's EOS ids).
    Finish reasons: "eos" (a stop id, yielded), "length" (max_new_tokens, or the KV capacity).
    On finish ``n`` equals what plain decoding would leave: the prefix, the input, and every
    yielded token but the last (which is pending: its KV is not written).
    """
    if not isinstance(config, GenerationConfig):
        raise RequestError(f"config must be a GenerationConfig, got {type(config).__name__}")
    spec = config.speculation
    stats = stats if stats is not None else GenerationStats()
    sampled = acceptor is not None or config.sampled
    chosen: Acceptor
    if sampled:
        chosen = acceptor if acceptor is not None else SampledAcceptor(config.sampling)
        if spec.gate == GateKind.COST and config.sampling is not None and config.sampling.seed is not None:
            # Greedy tokens do not depend on which steps speculate; sampled ones do (the modes use
            # the random stream differently), and the cost gate decides on measured times.
            raise RequestError(
                "gate cost decides on measured step times, so seeded sampling would not be "
                "reproducible; use gate hit-density or always with a seed (or drop the seed)",
                parameter="gate",
            )
    elif config.gated:
        chosen = GatedAcceptor(ExitGate.of(config, gen.model.config.num_loops))
    else:
        chosen = GreedyAcceptor(spec.tie_guard)
    if not ids:
        raise RequestError("prompt is empty: give at least one token")
    gen.validate_ids(ids)
    _set_depth(gen, config)
    plan = _plan(gen, spec, sampled, proposer, verifier, isinstance(chosen, GatedAcceptor))
    stats.prompt_tokens = len(ids)
    stats.speculative = (
        "none" if plan is None else (spec.mode.value if spec.mode != SpeculativeMode.NONE else "custom")
    )
    stats.exact_verify = gen.model.exact_verify
    stats.exact_greedy = plan is None or stats.exact_verify
    rule = FinishRule(config.max_new_tokens, frozenset(config.stop_ids or ()), gen.max_length)
    finish = Finisher(gen, stats, len(ids), rule)
    if config.max_new_tokens == 0:
        finish("length")
        return
    stats.kv_policy = config.kv_policy.value if config.gated else ""
    if isinstance(chosen, GatedAcceptor):  # its first row is the prompt's last: all R loops
        finish.prompt_passes = gen.loop_steps.num_loops
    try:
        yield from _Engine(gen, spec, plan, stats, chosen, costs).run(ids, finish)
    finally:
        finish.abandoned()
        _depth_stats(stats, chosen.loops if isinstance(chosen, GatedAcceptor) else None, gen.depth)


def _depth_stats(stats: GenerationStats, loops: list[int] | None, depth: int) -> None:
    """The exit-depth histogram (loops a token was read at -> tokens) and the mean."""
    emitted = stats.new_tokens
    loops = loops[:emitted] if loops is not None else [depth] * emitted
    histogram: dict[int, int] = {}
    for k in loops:
        histogram[k] = histogram.get(k, 0) + 1
    stats.exit_histogram = dict(sorted(histogram.items()))
    stats.mean_loops = round(sum(loops) / len(loops), 4) if loops else 0.0


class _RoundClock:
    """A round's wall time against its graph runs' step timers (StepCosts.host_factor): kept
    only when every run of the round was a steady one (a CUDA slot's warm-up and capture would
    swamp it)."""

    def __init__(self, gen: Generator, kinds) -> None:
        self.gen, self.kinds = gen, kinds
        self.t0 = time.perf_counter()
        clock = gen.clock
        self.runs = [(clock.runs(k), clock.steady(k), clock.steady_seconds(k)) for k in kinds]

    def stop(self, timer: str) -> None:
        clock, wall = self.gen.clock, time.perf_counter() - self.t0
        calls = steady = 0
        device = 0.0
        for kind, (runs0, steady0, seconds0) in zip(self.kinds, self.runs):
            calls += clock.runs(kind) - runs0
            steady += clock.steady(kind) - steady0
            device += clock.steady_seconds(kind) - seconds0
        if not calls or steady != calls:
            return
        clock.add(timer, wall)
        if timer == SPEC_ROUND:
            clock.add(SPEC_ROUND_DEVICE, device, 0)
            clock.add(SPEC_ROUND_CALLS, 0.0, calls)


class _Engine:
    """The round loop of one generation (the ``RoundHost`` its strategy's rounds call back)."""

    gate: Gate

    def __init__(
        self,
        gen: Generator,
        spec: SpeculationConfig,
        plan: _Plan | None,
        stats: GenerationStats,
        acceptor: Acceptor,
        costs: Costs | None,
    ) -> None:
        self.gen, self.spec, self.plan, self.stats, self.acceptor = gen, spec, plan, stats, acceptor
        if plan is not None:
            plan.proposer.reset(gen)
            plan.proposer.bind(acceptor)  # proposers that draw drafts (self) draw them its way
            cfg = gen.model.config
            share = (gen.model.manifest.draft_depth or 1) / cfg.num_loops
            # A gated plain round is one row through the loop steps, priced as such.
            costs = costs or (GatedRowCosts if isinstance(acceptor, GatedAcceptor) else StepCosts)(gen, share)
            self._plain_kind = GatedRowCosts.ROW_KIND if isinstance(acceptor, GatedAcceptor) else DECODE
            if acceptor.sampled and spec.gate == "auto":
                # Sampled tokens depend on which steps speculate, so the default gate must decide on
                # the tokens alone (reproducible with a seed), not on measured times.
                self.gate = HitDensityGate(plan.k_max, chosen_by="auto")
            else:
                memory = gen.clock.gate_state((spec.gate.value, plan.proposer.name, plan.strategy.name))
                self.gate = make_gate(
                    spec.gate,
                    plan.k_max,
                    costs,
                    plan.strategy,
                    free_guess=plan.proposer.caps.free_guess,
                    memory=memory,
                )
            stats.strategy, stats.gate = plan.strategy.name, spec.gate.value
            # Read once, not per step: on a sub-millisecond step the loop's microseconds count.
            self._writes_padding = plan.strategy.caps.writes_padding

    def run(self, ids: list[int], finish: Finisher) -> Iterator[int]:
        finish.on_finish = self._close
        pending = self.acceptor.first(self.gen, ids)
        # The committed sequence, kept here and extended on commit, so a proposer's context
        # costs no copy of the whole sequence per step (proposers must not keep it).
        self.context = self.gen.tokens
        new_tokens, step = [pending], 0
        self._streak = 0
        while not (yield from finish.emit(new_tokens)):
            step += 1
            if self._streak:
                # The gate has nothing to decide for these steps (CostGate.plain_streak): plain
                # steps as plain decoding runs them, without the gate, the round clock and the
                # fit check (a few microseconds each, a visible share of a sub-millisecond step);
                # each token is emitted as it comes, so stops and budgets act as always.
                self._streak -= 1
                self.gate.steps_off += 1
                token = self.acceptor.decode(self.gen, pending, self.context)
                self.context.append(pending)
                self.plan.proposer.advance([pending])
                new_tokens = [token]
            else:
                new_tokens = self._round(pending, step, finish.remaining)
            pending = new_tokens[-1]

    def _round(self, pending: int, step: int, remaining: int) -> list[int]:
        gen, plan = self.gen, self.plan
        if plan is None:  # plain decoding: the degenerate round, nothing to decide
            token = self.acceptor.decode(gen, pending, self.context)
            self.context.append(pending)
            return [token]
        return plan.strategy.run_round(self, pending, step, remaining)

    def draft_round(self, pending: int, step: int, remaining: int) -> list[int]:
        """A proposer's round: the gate's k drafts verified in one call, or a plain step."""
        gen, plan, gate = self.gen, self.plan, self.gate
        context = self.context
        # A round writes plan.width positions (the verify graph's fixed rows): no room, no round.
        # A strategy whose unused rows write nothing (tree verify) needs only the rows it uses.
        n = gen.n
        room = gen.max_length - n - 1
        fits = n + plan.width <= gen.max_length or (not self._writes_padding and room >= 1)
        k = gate.engage(step) if fits else None
        # Plain rounds' wall time (the gate's host factor) is a mean: every 8th plain round is
        # sample enough, and spares the others the clock's bookkeeping.
        clock = (
            _RoundClock(gen, plan.strategy.kinds)
            if k
            else (_RoundClock(gen, (DECODE,)) if step % 8 == 0 else None)
        )
        if k:
            context.append(pending)
            proposal = plan.proposer.propose(context, min(k, plan.k_max, remaining, room))
            context.pop()
            if not isinstance(proposal, Proposal):
                proposal = Proposal(list(proposal))
            drafts, evidence = proposal.tokens, proposal.evidence
            if drafts and evidence is not None and proposal.branch is None:
                # Re-priced at its evidence's α (CostGate.fit); none kept: a plain step, guessed
                keep = gate.fit(len(drafts), evidence)
                if keep < len(drafts):
                    proposal = proposal.first(keep)
            if proposal.tokens:
                committed = self._speculate(pending, proposal, step)
                clock.stop(SPEC_ROUND)
                return committed
            guess = drafts[:1]
        elif plan.proposer.caps.free_guess and gate.wants_evidence(step):
            # Free evidence for the gate: would the proposer's first draft have been right?
            context.append(pending)
            guess = plan.proposer.propose(context, 1)
            context.pop()
            evidence = guess.evidence if isinstance(guess, Proposal) else None
            guess = guess.tokens if isinstance(guess, Proposal) else guess
        else:
            guess, evidence = None, None
        token = self.acceptor.decode(gen, pending, context)
        context.append(pending)
        plan.proposer.advance([pending])
        if guess is not None:
            gate.observe(0, 0, would_hit=bool(guess) and guess[0] == token, step=step, evidence=evidence)
        if clock is not None and not k:
            clock.stop(DECODE_ROUND)
        if not k and guess is None:
            self._streak = gate.plain_streak(step) - 1  # the steps after this one (run())
        return [token]

    def lane_round(self, pending: int, step: int, remaining: int) -> list[int]:
        """The pipeline's round: its lanes run until one finishes; with the gate down, plain
        decode (lanes in flight are abandoned: their KV lies past ``n``)."""
        gen, strategy = self.gen, self.plan.strategy
        if not strategy.has_round(gen, pending) and not self.gate.engage(step):
            strategy.stop()
            plain = self._plain_kind
            t0, steady0 = time.perf_counter(), gen.clock.steady(plain)
            token = self.acceptor.decode(gen, pending, self.context)
            if gen.clock.steady(plain) > steady0:  # the pipeline's price of a plain round
                gen.clock.add(DECODE_ROUND_TIMER, time.perf_counter() - t0)
            self.context.append(pending)
            return [token]
        done = strategy.next_token(
            gen, pending, gen.n + remaining - 1, self.plan.proposer, self.acceptor, self.context
        )
        self.context.append(done.committed)
        stats = self.stats
        stats.rounds += 1
        stats.proposed += done.verified
        stats.accepted += done.accepted
        stats.discarded_lanes = strategy.stats.discarded_lanes
        stats.pipeline_trace = strategy.stats.trace
        if done.verified:
            self.gate.observe(done.verified, done.accepted, step=step)
        return [done.token]

    def _speculate(self, pending: int, proposal: Proposal, step: int) -> list[int]:
        """One round with drafts: verify, accept, commit pending + the accepted prefix."""
        gen, plan = self.gen, self.plan
        verified = plan.strategy.verify(gen, pending, proposal)
        self.context.append(pending)
        result, emitted = accept_round(self.acceptor, self.context, proposal, verified)
        self.context.pop()
        drafts = emitted[:-1]
        if result.branch_accepted:
            # The branch won: its rows' KV (scratch positions n+K+1..) moves into place at
            # n+fork+1.. before n passes it (docs/architecture.md §5, "Alternate suffix").
            branch = proposal.branch
            drafts = proposal.tokens[: branch.fork] + branch.tokens[: result.branch_accepted]
            gen.move_kv(gen.n + len(proposal.tokens) + 1, gen.n + branch.fork + 1, result.branch_accepted)
        committed = [pending] + drafts
        gen.commit(committed)
        self.context.extend(committed)
        plan.proposer.advance(committed)
        self._count(
            proposal.tokens, result, proposal.branch.fork if result.branch_accepted else result.accepted
        )
        self._count_branch(proposal, result)
        self.gate.observe(len(proposal.tokens), result.accepted, step=step, evidence=proposal.evidence)
        return drafts + [result.next_token]

    def _count_branch(self, proposal: Proposal, result) -> None:
        stats = self.stats
        stats.fork_skips += int(proposal.fork_skipped)
        if proposal.branch is None:
            return
        stats.forks += 1
        stats.alternate_selected += int(result.branch_accepted > 0)
        stats.alternate_tokens += result.branch_accepted
        stats.fork_misses += int(result.fork_miss)
        stats.alternate_discarded += int(not result.branch_accepted and not result.fork_miss)

    def _count(self, drafts: list[int], result, primary: int | None = None) -> None:
        """``primary``: the drafts of the primary chain committed (fewer than ``result.accepted``
        when an alternate suffix won)."""
        primary = result.accepted if primary is None else primary
        stats = self.stats
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
            stats.accepted_by_position[i] += int(i < primary)

    def _close(self) -> None:
        if self.plan is None:
            return
        self.plan.strategy.close()
        if isinstance(self.plan.strategy, PipelineCycles):
            self.stats.discarded_lanes = self.plan.strategy.stats.discarded_lanes
        self.stats.gate_report = self.gate.report()
        self.stats.gate_transitions = self.gate.transitions
        self.gate.remember()
