"""The speculation engine: one round loop for plain decoding and every proposer.

A round (gpt-fast's loop; ORT-GenAI's Propose / Advance / Reset):

    gate.engage ─▶ k drafts?  ── no ──▶ PlainDecode (the degenerate round: no drafts)
                      │ yes
                proposer.propose(context, k) ─▶ Proposal (tokens [+ depth-d states])
                      ▼
                strategy.verify ─▶ the verifier's argmax per row (pending + drafts)
                      ▼
                acceptor.accept ─▶ a accepted drafts + the correction / bonus token
                      │  (greedy_accept, or the rejection rule when sampling: ort_runtime/decoding/acceptors.py)
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
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field

from loopcast.ort_runtime.binding.generator import Generator
from loopcast.ort_runtime.decoding.acceptors import GreedyAcceptor, SampledAcceptor
from loopcast.ort_runtime.decoding.gates import (
    DECODE_ROUND,
    GATES,
    SPEC_ROUND,
    SPEC_ROUND_CALLS,
    SPEC_ROUND_DEVICE,
    HitDensityGate,
    StepCosts,
    make_gate,
)
from loopcast.ort_runtime.decoding.greedy_accept import TieGuard
from loopcast.ort_runtime.decoding.pipeline import DECODE_ROUND_TIMER, ExitDrafts, PipelineCycles
from loopcast.ort_runtime.decoding.proposers import (
    AlternateDraftProposer,
    PromptLookupProposer,
    Proposal,
    SelfDraftProposer,
    UserProposer,
)
from loopcast.ort_runtime.decoding.sampling import SamplingParams
from loopcast.ort_runtime.decoding.verifiers import DraftTail, TreeTail, VerifyRows

from loopcast.errors import RequestError
from loopcast.manifest import CYCLE, CYCLE_RUN, DECODE

# The built-in modes: each names a proposer; the strategy follows from what the proposer
# declares (drafts_hidden -> draft+verify_tail, tokens only -> verify-W), except the pipeline,
# whose drafts come out of its own cycles (a continuous strategy: lanes live across rounds).
MODES = ("none", "prompt-lookup", "self", "pipeline", "custom")


@dataclass(frozen=True)
class SpeculationConfig:
    mode: str = "none"
    num_draft_tokens: int | None = None  # K; default W-1
    gate: str = "auto"
    min_ngram: int = 1
    max_ngram: int = 3
    tie_guard: TieGuard = TieGuard()
    proposer: object | None = None  # a user's proposer (ort_runtime/decoding/proposers.py protocol)
    costs: object | None = None  # step costs (.decode(), .mean(kind), .draft_share); default measured
    allow_inexact: bool = False  # speculate even where verify rows are not decode rows bit for bit
    pipeline_exit: int = 1  # pipeline: the loop whose head drafts the next lane's token
    draft_hook: object | None = None  # pipeline: (position, draft) -> token; tests and oracle benches
    trace: bool = False  # pipeline: keep each cycle's rows in stats (tests)
    device_lanes: bool = True  # pipeline: greedy lanes scheduled on the device (cycle_run graph)
    alternate_gap: float | None = (
        None  # self: fork an alternate suffix below this top-1/top-2 probability gap
    )


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    new_tokens: int = 0
    finish_reason: str = ""
    seconds: float = 0.0
    tokens_per_second: float = 0.0
    speculative: str = "none"
    strategy: str = "decode"
    gate: str = "none"
    gate_report: dict = field(default_factory=dict)
    rounds: int = 0
    proposed: int = 0
    accepted: int = 0
    tokens_per_round: float = 0.0
    proposed_by_position: list[int] = field(default_factory=list)
    accepted_by_position: list[int] = field(default_factory=list)
    near_tie_rejections: int = 0
    tolerant_accepts: int = 0
    exact_verify: bool = True  # the artifact's verify rows are decode rows on this device
    exact_greedy: bool = True  # the tokens are plain greedy's by construction
    gate_transitions: int = 0
    cycles: int = 0  # pipeline cycles (one pass over the core layers each)
    discarded_lanes: int = 0
    core_calls_per_token: float = 0.0  # passes over the core layers per new token (plain: R)
    pipeline_trace: list | None = None  # SpeculationConfig(trace=True): each cycle's rows (tests)
    forks: int = 0  # alternate suffix: rounds verified with a branch
    fork_skips: int = 0  # near ties whose branch did not fit (width or KV capacity)
    alternate_selected: int = 0  # rounds the branch won
    alternate_discarded: int = 0  # rounds the primary chain passed the fork (or broke before it)
    fork_misses: int = 0  # rounds whose fork had neither branch's token right
    alternate_tokens: int = 0  # tokens gained: branch tokens committed past the primary's
    steps: dict[str, int] = field(default_factory=dict)
    step_seconds: dict[str, float] = field(default_factory=dict)

    def as_dict(self) -> dict:
        out = asdict(self)
        if out["pipeline_trace"] is None:
            del out["pipeline_trace"]
        out["step_seconds"] = {k: round(v, 6) for k, v in out["step_seconds"].items()}
        return out


@dataclass(frozen=True)
class _Plan:
    """What a generation speculates with: decided once, before the prompt runs."""

    proposer: object
    strategy: object
    k_max: int
    width: int  # positions a round writes (the verify graph's fixed rows)


def _plan(gen: Generator, spec: SpeculationConfig, sampled: bool = False) -> _Plan | None:
    if spec.mode not in MODES:
        raise RequestError(
            f"unknown speculative mode {spec.mode!r}; choose from {', '.join(MODES)} (custom takes a proposer)"
        )
    if spec.gate not in GATES:
        raise RequestError(f"unknown gate {spec.gate!r}; choose from {', '.join(GATES)}")
    alternate = spec.alternate_gap is not None or isinstance(spec.proposer, AlternateDraftProposer)
    if alternate:  # before the early returns: an alternate gap is never ignored
        _check_alternate(gen, spec, sampled)
    if spec.mode == "none" and spec.proposer is None:
        return None
    if spec.mode == "pipeline":
        if sampled and spec.draft_hook is not None:
            raise RequestError(
                "the pipeline's draft hook replaces sampled drafts, which breaks the rejection rule; "
                "use it with greedy decoding only"
            )
        return _plan_pipeline(gen, spec)
    if sampled and spec.mode == "self" and spec.proposer is not None:
        raise RequestError("sampled self-speculation drafts from the draft graph; it takes no proposer")
    vocab = gen.model.config.vocab_size
    if spec.alternate_gap is not None and spec.proposer is None:
        proposer = AlternateDraftProposer(spec.alternate_gap)
    elif spec.proposer is not None:
        proposer = (
            spec.proposer
            if isinstance(spec.proposer, (PromptLookupProposer, SelfDraftProposer, AlternateDraftProposer))
            else UserProposer(spec.proposer, vocab)
        )
        if spec.mode == "self" and not proposer.drafts_hidden:
            raise RequestError(
                "speculative mode 'self' takes a proposer that drafts depth-d states "
                "(drafts_hidden), such as SelfDraftProposer"
            )
        if spec.mode == "prompt-lookup" and proposer.drafts_hidden:
            raise RequestError(
                "speculative mode 'prompt-lookup' takes a token proposer, not a depth-d drafter"
            )
    elif spec.mode == "self":
        proposer = SelfDraftProposer()
    elif spec.mode == "prompt-lookup":
        proposer = PromptLookupProposer(spec.min_ngram, spec.max_ngram)
    else:
        raise RequestError("speculative mode 'custom' needs a proposer")
    strategy = TreeTail() if alternate else DraftTail() if proposer.drafts_hidden else VerifyRows()
    missing = [k for k in strategy.kinds if not gen.has_kind(k)]
    if missing and alternate:
        raise RequestError(
            f"--alternate-gap needs the {' and '.join(strategy.kinds)} graphs; this artifact lacks "
            f"{', '.join(missing)} (re-export it with --tree-verify)"
        )
    if missing:
        raise RequestError(
            f"speculative mode {spec.mode!r} needs the {' and '.join(strategy.kinds)} graphs; "
            f"this artifact lacks {', '.join(missing)}"
            + (" (self-speculation needs a looped model, R > 1)" if proposer.drafts_hidden else "")
        )
    require_exact(gen, spec.allow_inexact)
    k_max = strategy.max_drafts(gen)
    # With an alternate suffix the default leaves one row of the verify width for the branch.
    default = max(k_max - 1, 1) if alternate else k_max
    k = spec.num_draft_tokens if spec.num_draft_tokens is not None else default
    if not 1 <= k <= k_max:
        raise RequestError(f"--num-draft-tokens must be in 1..{k_max} (verify width {k_max + 1}), got {k}")
    return _Plan(proposer, strategy, k, k_max + 1)


def _check_alternate(gen: Generator, spec: SpeculationConfig, sampled: bool) -> None:
    """The alternate suffix's boundary checks: greedy self-speculation."""
    if spec.mode != "self":
        raise RequestError(
            f"--alternate-gap forks self-drafts; it goes with --speculative self, not {spec.mode!r}"
        )
    if sampled:
        raise RequestError(
            "--alternate-gap is greedy-only: a second branch would need its own rejection rule to "
            "keep sampling's distribution; drop it or sample without it"
        )
    if spec.alternate_gap is not None and spec.proposer is not None:
        raise RequestError("give either alternate_gap or an AlternateDraftProposer, not both")


def _plan_pipeline(gen: Generator, spec: SpeculationConfig) -> _Plan:
    if spec.proposer is not None:
        raise RequestError("speculative mode 'pipeline' drafts inside its cycles and takes no proposer")
    if spec.num_draft_tokens is not None:
        raise RequestError(
            "--num-draft-tokens does not apply to the pipeline (one lane per loop); "
            "use --pipeline-exit to choose the drafting loop"
        )
    strategy = PipelineCycles(spec.pipeline_exit, trace=spec.trace, device_lanes=spec.device_lanes)
    strategy.validate(gen)
    require_exact(gen, spec.allow_inexact)
    return _Plan(ExitDrafts(spec.draft_hook), strategy, 1, 1)


def require_exact(gen: Generator, allow_inexact: bool) -> None:
    """Speculation only where the artifact declares verify rows == decode rows on this device,
    unless the caller accepts tokens that may differ from plain decoding."""
    if not gen.model.exact_verify and not allow_inexact:
        # Unprepacked CPU sessions (share_weights=True) lose the manifest's exactness, not the artifact.
        fix = (
            "open it without share_weights=True"
            if not getattr(gen.model, "prepacked", True)
            else "re-export with --batch-invariant (or --target cuda)"
        )
        raise RequestError(
            f"speculation is not exact on this artifact on {gen.model.device}: its verify rows are not "
            "bit-identical to its decode rows (manifest exact_verify), so speculative tokens could differ "
            f"from plain greedy; {fix}, or pass --allow-inexact / allow_inexact=True to accept that"
        )


def stream(
    gen: Generator,
    ids: list[int],
    max_new_tokens: int,
    *,
    stop_ids: tuple[int, ...] = (),
    spec: SpeculationConfig = SpeculationConfig(),
    stats: GenerationStats | None = None,
    sampling: SamplingParams | None = None,
    acceptor=None,
) -> Iterator[int]:
    """Feed ``ids`` after the committed prefix and yield tokens as they are committed: greedy,
    or drawn with ``sampling`` (every speculative mode then keeps plain sampling's
    distribution; ``acceptor`` replaces the default SampledAcceptor, as tests of the rule do).

    Finish reasons: "eos" (a stop id, yielded), "length" (max_new_tokens, or the KV capacity).
    On finish ``n`` equals what plain decoding would leave: the prefix, the input, and every
    yielded token but the last (which is pending: its KV is not written).
    """
    stats = stats if stats is not None else GenerationStats()
    sampled = acceptor is not None or (sampling is not None and not sampling.greedy)
    if sampled:
        acceptor = acceptor if acceptor is not None else SampledAcceptor(sampling)
        if spec.gate not in GATES:
            raise RequestError(f"unknown gate {spec.gate!r}; choose from {', '.join(GATES)}")
        if spec.gate == "cost" and acceptor.params.seed is not None:
            # Greedy tokens do not depend on which steps speculate; sampled ones do (the modes use
            # the random stream differently), and the cost gate decides on measured times.
            raise RequestError(
                "--gate cost decides on measured step times, so seeded sampling would not be "
                "reproducible; use --gate hit-density or none with --seed (or drop --seed)"
            )
    else:
        acceptor = GreedyAcceptor(spec.tie_guard)
    if max_new_tokens < 0:
        raise RequestError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    if not ids:
        raise RequestError("prompt is empty: give at least one token")
    gen.validate_ids(ids)
    plan = _plan(gen, spec, sampled)
    stats.prompt_tokens, stats.speculative = (
        len(ids),
        "none" if plan is None else (spec.mode if spec.mode != "none" else "custom"),
    )
    stats.exact_verify = gen.model.exact_verify
    stats.exact_greedy = plan is None or stats.exact_verify
    finish = Finisher(gen, stats, len(ids), max_new_tokens, stop_ids)
    if max_new_tokens == 0:
        finish("length")
        return
    try:
        yield from _Engine(gen, spec, plan, stats, acceptor).run(ids, finish)
    finally:
        finish.abandoned()


class Finisher:
    """Hands a generation's tokens out and ends it: stops at a stop id (yielded), at
    ``max_new_tokens`` or at the KV capacity, sets ``n`` to what plain decoding leaves (the
    prefix, the input and every yielded token but the last, which is pending) and fills in the
    stats. Shared by the greedy and the sampled loops; ``on_finish`` runs first (a gate's report)."""

    def __init__(
        self,
        gen: Generator,
        stats: GenerationStats,
        input_len: int,
        max_new_tokens: int,
        stop_ids: tuple[int, ...],
    ) -> None:
        self.gen, self.stats, self.input_len = gen, stats, input_len
        self.max_new_tokens, self.stop_ids = max_new_tokens, stop_ids
        self.emitted, self.on_finish = 0, None
        self.base, self.start = gen.n, time.perf_counter()
        self.counts0, self.secs0 = dict(gen.step_counts), dict(gen.step_seconds)
        stats.finish_reason = ""  # a reused stats record must not make an early close skip the rewind

    @property
    def remaining(self) -> int:
        return self.max_new_tokens - self.emitted

    def emit(self, tokens: list[int]):
        """Yield ``tokens``; returns True when the generation has finished (``yield from``)."""
        for token in tokens:
            self.emitted += 1
            self.stats.new_tokens = self.emitted
            yield token
            if token in self.stop_ids:
                self("eos", self.emitted)
                return True
            if self.emitted >= self.max_new_tokens:
                self("length", self.emitted)
                return True
        if self.gen.n >= self.gen.max_length:  # no room for the pending token's KV
            self("length", self.emitted)
            return True
        return False

    def __call__(self, reason: str, emitted: int = 0) -> None:
        gen, stats = self.gen, self.stats
        if self.on_finish is not None:
            self.on_finish()
        stats.finish_reason = reason
        gen.rewind(min(gen.n, self.base + self.input_len + emitted - 1))
        stats.seconds = time.perf_counter() - self.start
        stats.new_tokens = emitted
        stats.tokens_per_second = emitted / stats.seconds if stats.seconds > 0 else 0.0
        stats.tokens_per_round = (stats.accepted + stats.rounds) / stats.rounds if stats.rounds else 0.0
        # Passes over the core layers: a step of a graph running loops a..b-1 is b-a passes
        # whatever its rows (prefill excluded); a cycle is one pass, a cycle run K.
        ran = {k: gen.step_counts[k] - self.counts0.get(k, 0) for k in gen.step_counts}
        graphs = gen.model.manifest.graphs
        per_call = {CYCLE: 1, CYCLE_RUN: gen.cycle_run.cycles if ran.get(CYCLE_RUN) else 0}
        passes = sum(
            n * per_call.get(k, graphs[k].last_loop - graphs[k].first_loop)
            for k, n in ran.items()
            if k != "prefill"
        )
        stats.cycles = ran.get(CYCLE, 0) + ran.get(CYCLE_RUN, 0) * per_call[CYCLE_RUN]
        if stats.cycles:
            stats.tokens_per_round = 1.0 if stats.rounds else 0.0  # a pipeline round ends with one token
        stats.core_calls_per_token = round(passes / emitted, 4) if emitted else 0.0
        stats.steps = {k: gen.step_counts[k] - self.counts0.get(k, 0) for k in gen.step_counts}
        stats.step_seconds = {k: gen.step_seconds[k] - self.secs0.get(k, 0.0) for k in gen.step_seconds}

    def abandoned(self) -> None:
        """A consumer that stops early (close(), break) or an error mid-round must not leave
        ``n`` past the yielded tokens: rounds commit drafts before yielding them."""
        if not self.stats.finish_reason:
            emitted = self.stats.new_tokens
            self.gen.rewind(
                min(self.gen.n, self.base + self.input_len + emitted - 1) if emitted else self.base
            )


class _RoundClock:
    """A round's wall time against its graph runs' step timers (StepCosts.host_factor): kept
    only when every run of the round was a steady one (a CUDA slot's warm-up and capture would
    swamp it)."""

    def __init__(self, gen: Generator, kinds) -> None:
        self.gen, self.kinds = gen, kinds
        self.t0 = time.perf_counter()
        self.runs = [(gen.step_counts[k], gen.timed_counts[k], gen.timed_seconds[k]) for k in kinds]

    def stop(self, timer: str) -> None:
        gen, wall = self.gen, time.perf_counter() - self.t0
        calls = steady = 0
        device = 0.0
        for kind, (runs0, steady0, seconds0) in zip(self.kinds, self.runs):
            calls += gen.step_counts[kind] - runs0
            steady += gen.timed_counts[kind] - steady0
            device += gen.timed_seconds[kind] - seconds0
        if not calls or steady != calls:
            return
        gen.timed_seconds[timer] += wall
        gen.timed_counts[timer] += 1
        if timer == SPEC_ROUND:
            gen.timed_seconds[SPEC_ROUND_DEVICE] += device
            gen.timed_counts[SPEC_ROUND_CALLS] += calls


class _Engine:
    """The round loop of one generation."""

    def __init__(
        self, gen: Generator, spec: SpeculationConfig, plan: _Plan | None, stats: GenerationStats, acceptor
    ) -> None:
        self.gen, self.spec, self.plan, self.stats, self.acceptor = gen, spec, plan, stats, acceptor
        self.gate = None
        if plan is not None:
            plan.proposer.reset(gen)
            if hasattr(plan.proposer, "acceptor"):  # proposers that draw drafts (self) draw them its way
                plan.proposer.acceptor = acceptor
            cfg = gen.model.config
            costs = spec.costs or StepCosts(gen, (gen.model.manifest.draft_depth or 1) / cfg.num_loops)
            if acceptor.sampled and spec.gate == "auto":
                # Sampled tokens depend on which steps speculate, so the default gate must decide on
                # the tokens alone (reproducible with a seed), not on measured times.
                self.gate = HitDensityGate(plan.k_max, chosen_by="auto")
            else:
                memory = gen.gate_memory.setdefault((spec.gate, plan.proposer.name, plan.strategy.name), {})
                self.gate = make_gate(
                    spec.gate,
                    plan.k_max,
                    costs,
                    plan.strategy,
                    free_guess=getattr(plan.proposer, "free_guess", False),
                    memory=memory,
                )
            stats.strategy, stats.gate = plan.strategy.name, spec.gate
            # Read once, not per step: on a 0.4 ms step every microsecond of the loop is 0.25%.
            self._continuous = getattr(plan.strategy, "continuous", False)
            self._writes_padding = getattr(plan.strategy, "writes_padding", True)

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
                # fit check (a few microseconds each: ~1.5% of the demo's 0.42 ms step on the
                # H200); each token is emitted as it comes, so stops and budgets act as always.
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
        gen, plan, gate = self.gen, self.plan, self.gate
        if plan is None:  # plain decoding: the degenerate round, nothing to decide
            token = self.acceptor.decode(gen, pending, self.context)
            self.context.append(pending)
            return [token]
        if self._continuous:
            return self._lane_round(pending, step, remaining)
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
            if proposal.tokens:
                committed = self._speculate(pending, proposal, step)
                clock.stop(SPEC_ROUND)
                return committed
            guess = proposal.tokens
        elif plan.proposer.free_guess and gate.wants_evidence(step):
            # Free evidence for the gate: would the proposer's first draft have been right?
            context.append(pending)
            guess = plan.proposer.propose(context, 1)
            context.pop()
            guess = guess.tokens if isinstance(guess, Proposal) else guess
        else:
            guess = None
        token = self.acceptor.decode(gen, pending, context)
        context.append(pending)
        plan.proposer.advance([pending])
        if guess is not None:
            gate.observe(0, 0, would_hit=bool(guess) and guess[0] == token, step=step)
        if clock is not None and not k:
            clock.stop(DECODE_ROUND)
        if not k and guess is None and hasattr(gate, "plain_streak"):
            self._streak = gate.plain_streak(step) - 1  # the steps after this one (run())
        return [token]

    def _lane_round(self, pending: int, step: int, remaining: int) -> list[int]:
        """A continuous strategy's round (the pipeline): its lanes run until one finishes; with
        the gate down, plain decode (lanes in flight are abandoned: their KV lies past ``n``)."""
        gen, strategy = self.gen, self.plan.strategy
        if not strategy.has_round(gen, pending) and not self.gate.engage(step):
            strategy.stop()
            t0, steady0 = time.perf_counter(), gen.timed_counts["decode"]
            token = self.acceptor.decode(gen, pending, self.context)
            if gen.timed_counts["decode"] > steady0:  # the pipeline's price of a plain round
                gen.timed_seconds[DECODE_ROUND_TIMER] += time.perf_counter() - t0
                gen.timed_counts[DECODE_ROUND_TIMER] += 1
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
        result = self.acceptor.accept(self.context, proposal, verified)
        self.context.pop()
        drafts = proposal.tokens[: result.accepted]
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
        self.gate.observe(len(proposal.tokens), result.accepted, step=step)
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
        if self.plan is not None and getattr(self.plan.strategy, "continuous", False):
            self.plan.strategy.stop()  # lanes still in flight when the generation ends
            self.stats.discarded_lanes = self.plan.strategy.stats.discarded_lanes
        if self.gate is not None:
            self.stats.gate_report = self.gate.report()
            self.stats.gate_transitions = self.gate.transitions
            if hasattr(self.gate, "remember"):
                self.gate.remember()
