"""The pipelined mixed-depth strategy: one pass over the shared core layers serves a lane at every depth.

A *lane* is one position on its way through the R loops. Each cycle runs the ``cycle`` graph
once: the lane in row r runs loop r (row = depth), so R lanes share one read of the weights.

    cycle c:   row 0: lane p+3 (loop 0)   row 1: lane p+2   row 2: lane p+1   row 3: lane p (loop 3)
                 │ a lane finishing loop k (the exit depth, default 1) drafts the next token
                 │ and spawns the lane for the next position with it, k loops behind;
                 └ the lane finishing loop R gives the full-depth token for the next position:
                   equal to its successor's draft → the successor continues; else the successor
                   and every younger lane are discarded and the token starts a new lane.

Every finishing lane commits its position and emits one token, so at full acceptance one cycle
(one pass over the core layers) commits one token, against R passes for plain decoding.

Greedy lanes run K cycles per session call on the ``cycle_run`` graph (graphs/cycles.py): the
rule below, as ``loopcast.LaneStep`` on the device between the unrolled cycles, so the host
copies one state in and one log out per K cycles instead of a round trip per cycle
(``_run_cycles``; the host checks the log's committed positions). Sampling, draft hooks and
artifacts without the graph schedule lanes here, one cycle per call.

KV invariant (docs/architecture.md §5, "Pipeline cycle"): lane q at depth d reads slot (d, l)
at positions < q. Those were written by q's ancestors (lanes q-1, q-2, ...) when they ran depth
d, in earlier cycles, and a lane exists only while all its ancestors survive. A discarded lane
wrote only positions > the rejecting lane's position p; the new lane p+1 and its successors
rewrite each of those positions at each depth before any lane reads it (lane q+1 runs depth d
one cycle after lane q). So no surviving lane ever reads KV written by a discarded lane. The
rule is enforced where lanes are made: ``_run_cycle`` spawns only from the youngest surviving
lane, ``_finish`` discards every lane younger than a rejected draft, and rows of one cycle
never share a (slot, position) address (RowAttention refuses that).

Exactness: a lane's row in a cycle computes exactly what the decode step computes at that
depth and position (RowAttention rows are the one-row attention call bit for bit; the loop
boundary is the draft/verify_tail split), so every emitted token is plain greedy's.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

import numpy as np
from loopcast.ort_runtime.decoding.gates import DECODE_ROUND
from loopcast.ort_runtime.decoding.protocols import ProposerBase, ProposerCaps, VerifierBase, VerifierCaps

from loopcast.errors import RequestError
from loopcast.manifest import CYCLE, CYCLE_RUN, DECODE, lane_record_length, lane_state_length

# Generator timers of whole rounds (host work included): the pipeline's per cycle, and plain
# decoding's while the pipeline's gate stands down (the cost gate's prices, on one scale).
ROUND_TIMER = "cycle_round"
DECODE_ROUND_TIMER = DECODE_ROUND  # plain rounds' wall time (ort_runtime/decoding/gates.py)


@dataclass
class Lane:
    position: int
    token: int  # the token at ``position``: a draft until the lane before it confirms it
    depth: int = 0  # loops run so far
    q: object = None  # sampling: the distribution the draft was drawn from (None: greedy)


@dataclass
class LaneRound:
    """What one round (cycles until a lane finishes) did."""

    token: int  # the full-depth token for the finished lane's next position
    committed: int  # the finished lane's token, whose KV is now complete at every depth
    position: int = -1  # the finished lane's position (committed when the round is taken)
    verified: int = 0  # 1 if a successor's draft was checked against ``token``
    accepted: int = 0
    cycles: int = 0
    discarded: int = 0


@dataclass
class PipelineStats:
    cycles: int = 0
    discarded_lanes: int = 0
    cold_starts: int = 0
    trace: list | None = None  # per cycle (positions, argmax per row, entering token), for tests


class PipelineCycles(VerifierBase):
    """The lane scheduler, an engine strategy (ort_runtime/decoding/speculate.py): each round runs cycles
    until a lane finishes and returns that token. Lanes live across rounds; a round that finds
    the generator moved on (plain steps in between, a new generation) starts cold from ``pending``."""

    name = "pipeline"
    kinds = (CYCLE,)
    # One draft per round: the cost gate's α must remember ~50 of them (a shorter memory's
    # noise, ±0.08 at ~20, decides the gate instead of the acceptance). Lanes live across rounds.
    caps = VerifierCaps(alpha_decay=0.98, persistent_lanes=True)

    def __init__(self, exit_depth: int = 1, *, trace: bool = False, device_lanes: bool = True) -> None:
        self.exit_depth, self.loops = exit_depth, 2
        self.lanes: list[Lane] = []
        self.stats = PipelineStats(trace=[] if trace else None)
        # Greedy rounds run K cycles per call on the cycle_run graph where the artifact has it
        # (the lane schedule on the device: _run_cycles); the rounds it finished wait here.
        self.device_lanes = device_lanes
        self._rounds: deque[LaneRound] = deque()
        self._idle_cycles = 0  # cycle_run cycles since the last finished round
        self._end: tuple[int, int] | None = None  # (n, pending token) where the last round left off
        self._n = 0  # the committed length while a host-scheduled round runs

    def run_round(self, engine, pending: int, step: int, remaining: int) -> list[int]:
        """The pipeline's own round: its lanes run until one finishes (the engine's lane round)."""
        return engine.lane_round(pending, step, remaining)

    def close(self) -> None:
        self.stop()  # lanes still in flight when the generation ends

    def prepare(self, gen) -> None:
        """The schedule must fit the model: R rows (one per loop) and an exit depth in 1..R-1."""
        R = self.loops = gen.model.config.num_loops
        if gen.cycle is None:
            raise RequestError(
                "speculative mode 'pipeline' needs the cycle graph; this artifact lacks it "
                "(a looped model, R > 1, without prelude/coda, exported with the loopcast ops)"
            )
        for kind, binding in ((CYCLE, gen.cycle), (CYCLE_RUN, gen.cycle_run if self.device_lanes else None)):
            if binding is not None and binding.rows != R:
                raise RequestError(f"the {kind} graph has {binding.rows} rows but the model runs {R} loops")
        if not 1 <= self.exit_depth < R:
            raise RequestError(
                f"pipeline_exit must be in 1..{R - 1} (the model runs {R} loops), got {self.exit_depth}"
            )

    def max_drafts(self, gen) -> int:
        return 1

    def token_rate(self, costs, alpha: float) -> float:
        """Expected tokens per second: a token every ``exit_depth`` cycles while drafts hold, R
        cycles for the token after a rejection (its lane starts at loop 0)."""
        return 1.0 / (self.cycle_price(costs) * self.cycles_per_token(alpha))

    def cycles_per_token(self, alpha: float) -> float:
        """Cycles a token costs on average at draft acceptance ``alpha``."""
        return alpha * self.exit_depth + (1 - alpha) * self.loops

    def cycle_price(self, costs) -> float:
        """A cycle's wall time in a round (host scheduling and copies included: on a small model
        they are a third of it), else the bare step time, else a guess from decode; on the
        scale of decode's step timer (the price the gate compares with)."""
        R = self.loops
        cycle = costs.mean(ROUND_TIMER) or costs.mean(CYCLE) or costs.decode() / R * 1.2
        plain_round, plain_step = costs.mean(DECODE_ROUND_TIMER), costs.mean(DECODE)
        if costs.mean(ROUND_TIMER) and plain_round and plain_step:
            # The gate compares with decode's step timer: put the round's wall time (host work
            # in) on that scale, with plain rounds' wall time against their step time.
            cycle *= plain_step / plain_round
        return cycle

    def round_cost(self, costs, k: int) -> float:
        """A round from a cold start (a probe): R cycles to the first token."""
        return self.loops * (
            costs.mean(CYCLE) or costs.mean(ROUND_TIMER) or costs.decode() / self.loops * 1.2
        )

    def has_round(self, gen, pending: int) -> bool:
        """Whether a cycle run already finished the next round (the engine takes it whatever
        its gate says: the cycles are spent)."""
        return bool(self._rounds) and (self._rounds[0].position, self._rounds[0].committed) == (
            gen.n,
            pending,
        )

    def stop(self) -> None:
        """Plain decoding takes over: lanes in flight, and rounds a cycle run finished ahead, are
        abandoned (their KV is past ``n``)."""
        self.stats.discarded_lanes += len(self.lanes)
        self.lanes = []
        self._rounds.clear()
        self._idle_cycles = 0
        self._end = None

    def next_token(
        self, gen, pending: int, limit_position: int, drafts, acceptor, context: list[int]
    ) -> LaneRound:
        """Run cycles until the oldest lane finishes. ``pending`` sits at position ``gen.n``;
        lanes are spawned only at positions <= ``limit_position`` (the last position whose
        successor token the generation may still emit) and inside the KV capacity.
        ``acceptor`` drafts and checks (greedy: argmax and equality; sampling: draws and the
        rejection rule per lane); ``context`` is the committed sequence (read, never kept)."""
        if self._rounds:
            done = self._rounds.popleft()
            if (done.position, done.committed) == (gen.n, pending):
                gen.commit([done.committed])
                self._end = (gen.n, done.token)
                return done
            self.stop()
        # From plain decoding (a new generation, the gate's probe) the first round goes cycle by
        # cycle: R cycles, not a run of K, so probes stay as cheap as before. Its lanes, and a
        # lane restarted after a rejection, then go on in runs, on the same lane states.
        resumed = (gen.n, pending) == self._end
        if not self.lanes or (self.lanes[0].position, self.lanes[0].token) != (gen.n, pending):
            self.stop()
            self.lanes = [Lane(gen.n, pending)]
            self.stats.cold_starts += 1
        if (
            self.device_lanes
            and not acceptor.sampled
            and not drafts.replaces_drafts
            and gen.has_kind(CYCLE_RUN)
            and (resumed or gen.cycle is None)
        ):
            while not self._rounds:
                self._run_cycles(gen, min(limit_position, gen.max_length - 1), drafts)
            done = self._rounds.popleft()
            gen.commit([done.committed])
            self._end = (gen.n, done.token)
            return done
        cycles, t0, steady0 = 0, time.perf_counter(), gen.clock.steady(CYCLE)
        self._n = gen.n
        while True:
            ids, logits = self._run_cycle(gen, acceptor.sampled)
            cycles += 1
            done = self._advance(gen, ids, logits, limit_position, drafts, acceptor, context)
            if done is not None:
                done.cycles = cycles
                gen.commit([done.committed])
                self._end = (gen.n, done.token)
                if gen.clock.steady(CYCLE) - steady0 == cycles:  # no warm-up or capture inside
                    gen.clock.add(ROUND_TIMER, time.perf_counter() - t0, cycles)
                return done

    def _run_cycles(self, gen, limit: int, drafts) -> None:
        """K cycles in one call of the cycle_run graph, the lane schedule between them on the
        device (loopcast.LaneStep: this class's greedy rule, custom_ops/src/lane_step.h). Queues
        the rounds the log shows finished and takes the lanes' state after the last cycle."""
        run = gen.cycle_run
        R, K = run.rows, run.cycles
        state = np.zeros(lane_state_length(R), np.int32)
        state[:R] = -1
        for lane in self.lanes:
            state[lane.depth], state[R + lane.depth] = lane.position, lane.token
        state[2 * R], state[2 * R + 1] = limit, self.exit_depth
        t0, steady0 = time.perf_counter(), gen.clock.steady(CYCLE_RUN)
        log = gen.run_cycles(state)
        width = lane_record_length(R)
        records, final = log[: K * width].reshape(K, width).tolist(), log[K * width :]
        expected, trace = gen.n + len(self._rounds), self.stats.trace
        for positions_ids in records:
            self._idle_cycles += 1
            if trace is not None:
                trace.append((positions_ids[:R], positions_ids[R : 2 * R], positions_ids[2 * R]))
            entering, position, committed, token, verified, accepted, discarded, drafted = positions_ids[
                2 * R :
            ]
            drafts.drafted += drafted
            if position < 0:
                continue
            if position != expected:  # the device's schedule left the host's rule
                raise AssertionError(f"cycle run committed position {position}, expected {expected}")
            expected += 1
            self.stats.discarded_lanes += discarded
            self._rounds.append(
                LaneRound(
                    token=token,
                    committed=committed,
                    position=position,
                    verified=verified,
                    accepted=accepted,
                    cycles=self._idle_cycles,
                    discarded=discarded,
                )
            )
            self._idle_cycles = 0
        self.stats.cycles += K
        self.lanes = [
            Lane(int(final[r]), int(final[R + r]), depth=r) for r in range(R - 1, -1, -1) if final[r] >= 0
        ]
        if gen.clock.steady(CYCLE_RUN) > steady0:  # a steady call: no warm-up or capture inside
            gen.clock.add(ROUND_TIMER, time.perf_counter() - t0, K)

    def _run_cycle(self, gen, want_logits: bool):
        R = gen.cycle.rows
        positions, entering = [-1] * R, 0
        for lane in self.lanes:
            positions[lane.depth] = lane.position
            if lane.depth == 0:
                entering = lane.token
        ids = gen.run_cycle(entering, positions)
        self.stats.cycles += 1
        if self.stats.trace is not None:
            self.stats.trace.append((list(positions), [int(t) for t in ids], entering))
        return ids, (gen.cycle.logits.pull()[0] if want_logits else None)

    def _context(self, context: list[int], upto: int) -> list[int]:
        """The sequence up to position ``upto``: committed tokens, then the lanes' (sampling's
        repetition penalty reads it)."""
        return context + [lane.token for lane in self.lanes if lane.position <= upto]

    def _advance(self, gen, ids, logits, limit_position: int, drafts, acceptor, context) -> LaneRound | None:
        R, e = gen.cycle.rows, self.exit_depth
        for lane in self.lanes:
            lane.depth += 1
        youngest = self.lanes[-1]
        # The youngest lane that just finished the exit loop drafts the next position.
        draft = None
        if youngest.depth == e:
            q = youngest.position + 1
            if q <= limit_position and q < gen.max_length:
                ctx = self._context(context, youngest.position) if acceptor.sampled else context
                token, dist = acceptor.draft(
                    int(ids[e - 1]), logits[e - 1] if logits is not None else None, ctx
                )
                draft = Lane(q, drafts.draft(q, token), q=dist)
        done = None
        if self.lanes[0].depth == R:
            done = self._finish(
                gen, int(ids[R - 1]), logits[R - 1] if logits is not None else None, acceptor, context
            )
        if draft is not None and self.lanes and self.lanes[-1] is youngest:
            self.lanes.append(draft)
        return done

    def _finish(self, gen, target: int, target_logits, acceptor, context) -> LaneRound:
        """The oldest lane ran every loop: its position is committed and the next token is the
        target (greedy: the argmax; sampling: a draw). Its successor survives only if the
        acceptor keeps its draft."""
        lane = self.lanes.pop(0)
        if lane.position != self._n:
            raise AssertionError(f"pipeline lane at {lane.position} finished with n = {self._n}")
        ctx = context + [lane.token] if acceptor.sampled else context
        if not self.lanes:
            token = acceptor.bonus(target_logits, ctx) if acceptor.sampled else target
            return LaneRound(token=token, committed=lane.token, position=lane.position)
        succ = self.lanes[0]
        kept, token = acceptor.check(succ.token, succ.q, target, target_logits, ctx)
        done = LaneRound(
            token=token, committed=lane.token, position=lane.position, verified=1, accepted=int(kept)
        )
        if not kept:
            done.discarded = len(self.lanes)
            self.stats.discarded_lanes += len(self.lanes)
            self.lanes = []
        return done


class ExitDrafts(ProposerBase):
    """The pipeline's drafter: the argmax of the exit loop's head, as the cycle computed it. Its
    drafts come out of the cycles (``draft``), so it offers none to a draft round (``propose``).

    ``hook(position, draft) -> token`` replaces a draft (tests force rejections with it; the
    bench's oracle mode replays a known continuation); a hooked drafter runs host-scheduled
    cycles, where each draft passes through the hook."""

    name = "exit"
    caps = ProposerCaps(drafts_hidden=True)

    def __init__(self, hook=None) -> None:
        self.hook, self.drafted = hook, 0

    @property
    def replaces_drafts(self) -> bool:
        return self.hook is not None

    def draft(self, position: int, token: int) -> int:
        self.drafted += 1
        return int(self.hook(position, token)) if self.hook is not None else token

    def reset(self, gen) -> None:
        self.drafted = 0

    def propose(self, context, k) -> list[int]:
        return []
