"""Ouro's exit gate through the pipeline (docs/adaptive-depth.md, KV policy ``full``): a lane
emits the next position's token at its own exit loop, and its deeper loops keep running in the
following cycles for the KV, overlapped with the lanes of the tokens after it.

    cycle c:   row 0: lane p+2 (loop 0)   row 1: lane p+1   row 2: lane p   row 3: lane p-1 (loop 3)
                 │ after each loop a lane's gate logit (the cycle's ``exit_gates_BR``, row by row)
                 │ advances its exit distribution (ExitGate.after_loop); at its exit loop x the
                 │ head of its row is the token at the next position, final. The successor that
                 │ lane drafted at the exit depth e (row e-1's head) is kept if it equals that
                 │ token, else it and every younger lane are discarded and the token enters as a
                 │ new lane. A lane that exits before drafting spawns its successor with the token
                 │ itself: no draft, nothing to verify (every exit at loop 1: a token per cycle).
                 │ Until it exits, a lane whose latest head (row r's, past the drafting loop) no
                 │ longer agrees with its successor's draft re-drafts: the successor and every
                 │ younger lane are discarded and that head enters as the new draft.
                 └ the lane finishing loop R commits its position; the round returns the token
                   its exit emitted (rounds stay one token each, in order, as the pipeline's).

So drafts are verified at the exit step, not at R: a rejection costs the exit loop's count of
cycles instead of R, and a draft is compared with the token of its predecessor's exit loop. A
re-draft moves the successor's start to the cycle its predecessor's head changed rather than
the cycle of the exit; it never changes a token (every draft is verified at the exit).

KV invariant (docs/architecture.md §5, "Pipeline cycle", unchanged): lane q at depth d reads
slot (d, l) at positions < q, written by q's ancestors at depth d in earlier cycles (a lane
enters at least one cycle after its predecessor and every lane runs one loop per cycle, so two
lanes never share a row). Every lane runs every loop, so each committed position holds every
loop's own K/V: what the sequential gated ``full`` row leaves. A discarded lane wrote only
positions > the rejecting (or re-drafting) lane's; the new lane and its successors rewrite each
of them at each depth before any lane reads it.

Exactness: a lane's row at depth r computes the loop-step row's normed state at loop r bit for
bit (cycle rows are decode's rows; the cycle's gates are loop_step's ops on a one-row slice), so
each gate logit, each exit decision and each exit token are those of plain gated decoding
(GatedAcceptor), which gives the torch reference's tokens (exporter/reference_depth.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
from loopcast.ort_runtime.decoding.exits import ExitGate, ExitMass, GatedAcceptor
from loopcast.ort_runtime.decoding.pipeline import ROUND_TIMER, Lane, LaneRound, PipelineCycles

from loopcast.errors import RequestError
from loopcast.manifest import CYCLE


@dataclass
class GatedLane(Lane):
    mass: ExitMass = field(default_factory=ExitMass)
    exit: int = -1  # the 0-based exit loop, once the gate made one final
    next: int = -1  # the token its exit emitted (at position + 1)
    final: bool = False  # its token is its predecessor's exit token (not a draft awaiting it)
    verified: int = 0  # its successor's draft was checked at its exit
    accepted: int = 0
    discarded: int = 0


class ExitGateLanes(PipelineCycles):
    """The pipeline's lanes read at each lane's exit loop (the engine's strategy for
    ``exit_threshold`` with ``speculative='pipeline'``). Greedy, host-scheduled: one cycle per
    call (the device's lane schedule, cycle_run's LaneStep, knows no gate). The rule comes from
    the generation's GatedAcceptor, which also keeps each emitted token's exit loop."""

    # Its own name: the cost gate's memory of α (kept per generator by strategy name) must not
    # mix drafts verified at the exit step with the full-depth pipeline's, verified at R.
    name = "exit-lanes"

    def __init__(self, exit_depth: int = 1, *, trace: bool = False) -> None:
        super().__init__(exit_depth, trace=trace, device_lanes=False)
        self._exits = [0, 0]  # (sum of exit loops, lanes): the price's mean loops per token

    def prepare(self, gen) -> None:
        super().prepare(gen)
        if gen.cycle.gates is None:
            raise RequestError(
                "exit_threshold with speculative='pipeline' needs the cycle graph's exit gates "
                "(exit_gates_BR), which this artifact's cycle graph lacks (a model without "
                "Ouro's exit gate)",
                parameter="exit_threshold",
            )

    def cycles_per_token(self, alpha: float) -> float:
        """A token every ``exit_depth`` cycles while drafts hold (sooner where lanes exit before
        drafting), and after a rejection the exit loop's count of cycles, not R: the token enters
        as soon as its predecessor exits."""
        total, lanes = self._exits
        loops = total / lanes if lanes else float(self.loops)
        return alpha * min(self.exit_depth, loops) + (1 - alpha) * loops

    def next_token(
        self, gen, pending: int, limit_position: int, drafts, acceptor: GatedAcceptor, context
    ) -> LaneRound:
        """Run cycles until the oldest lane finishes loop R (see PipelineCycles.next_token)."""
        if not self.lanes or (self.lanes[0].position, self.lanes[0].token) != (gen.n, pending):
            self.stop()
            self.lanes = [GatedLane(gen.n, pending, final=True)]
            self.stats.cold_starts += 1
        cycles, t0, steady0 = 0, time.perf_counter(), gen.clock.steady(CYCLE)
        self._n = gen.n
        while True:
            ids, gates = self._run_gated_cycle(gen)
            cycles += 1
            lane = self._advance_gated(gen, ids, gates, acceptor.gate, limit_position, drafts)
            if lane is None:
                continue
            gen.commit([lane.token])
            acceptor.loops.append(lane.exit + 1)
            self._exits[0] += lane.exit + 1
            self._exits[1] += 1
            if gen.clock.steady(CYCLE) - steady0 == cycles:  # no warm-up or capture inside
                gen.clock.add(ROUND_TIMER, time.perf_counter() - t0, cycles)
            return LaneRound(
                token=lane.next,
                committed=lane.token,
                position=lane.position,
                verified=lane.verified,
                accepted=lane.accepted,
                cycles=cycles,
                discarded=lane.discarded,
            )

    def _run_gated_cycle(self, gen) -> tuple[np.ndarray, np.ndarray]:
        """One cycle; each row's argmax and exit-gate logit. The trace records (positions,
        argmax per row, entering token, gate logit per row)."""
        R = gen.cycle.rows
        positions, entering = [-1] * R, 0
        for lane in self.lanes:
            positions[lane.depth] = lane.position
            if lane.depth == 0:
                entering = lane.token
        ids = gen.run_cycle(entering, positions)
        gates = gen.cycle.gates.pull()[0]
        self.stats.cycles += 1
        if self.stats.trace is not None:
            self.stats.trace.append((list(positions), [int(t) for t in ids], entering, gates.tolist()))
        return ids, gates

    def _advance_gated(
        self, gen, ids, gates, gate: ExitGate, limit_position: int, drafts
    ) -> GatedLane | None:
        """Every lane ran one more loop: exits, checks of drafts at exits, the youngest lane's
        successor, and the oldest lane if it finished loop R (returned)."""
        R, e = self.loops, self.exit_depth
        lanes: list[GatedLane] = self.lanes  # type: ignore[assignment]
        exited = []
        for lane in lanes:
            r = lane.depth
            lane.depth += 1
            if lane.exit < 0 and gate.after_loop(r, float(gates[r]), lane.mass, R):
                lane.exit, lane.next = r, int(ids[r])
                exited.append(lane)
        # A lane still running toward its exit re-drafts its successor from its latest head when
        # that head no longer agrees with the draft (a deeper head agrees with the exit more
        # often: on the demo loop 3's head with loop 4's on 89 % of tokens, loop 1's on 64 %);
        # the new draft is verified at the exit like any other. The discarded lanes wrote only
        # positions past this lane's, as after a rejection (the module's KV invariant).
        for i, lane in enumerate(lanes[:-1]):
            successor = lanes[i + 1]
            if lane.exit >= 0 or lane.depth <= e or successor.final:
                continue
            head = int(ids[lane.depth - 1])
            if head == successor.token:
                continue
            draft = drafts.draft(successor.position, head)
            if draft != successor.token:
                lane.discarded += len(lanes) - i - 1
                self.stats.discarded_lanes += len(lanes) - i - 1
                del lanes[i + 1 :]
                lanes.append(GatedLane(successor.position, draft))
                break
        for lane in exited:  # oldest first: a rejection discards the younger ones, exited or not
            i = next((i for i, other in enumerate(lanes) if other is lane), None)
            if i is None or i + 1 == len(lanes):
                continue  # discarded by an older lane's rejection, or no successor yet
            successor = lanes[i + 1]
            lane.verified = 1
            if successor.token == lane.next:
                successor.final, lane.accepted = True, 1
            else:
                self.stats.discarded_lanes += len(lanes) - i - 1
                lane.discarded += len(lanes) - i - 1
                del lanes[i + 1 :]
        youngest = lanes[-1]
        q = youngest.position + 1
        if q <= limit_position and q < gen.max_length:
            if youngest.exit >= 0:  # its token is final: it enters without a draft
                lanes.append(GatedLane(q, youngest.next, final=True))
            elif youngest.depth == e:
                lanes.append(GatedLane(q, drafts.draft(q, int(ids[e - 1]))))
        if lanes[0].depth < R:
            return None
        lane = lanes.pop(0)
        if lane.position != self._n or not lane.final or lane.exit < 0:
            raise AssertionError(f"gated lane at {lane.position} finished with n = {self._n}: {lane}")
        return lane
