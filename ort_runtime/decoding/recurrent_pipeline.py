"""The recurrent-depth pipeline: one pass over the core serves a lane at every core step.

A *lane* is one position on its way through prelude → r core steps → coda. Each cycle runs the
``recurrent_cycle`` graph once (graphs/recurrent_cycles.py): the lane in row k runs core step k,
so up to r lanes share one read of the core weights; the lane entering row 0 runs the prelude
first and the lane finishing step r-1 runs the coda, in the same call.

    cycle c:   row 0: lane p+3 (prelude, step 0)   row 1: lane p+2   ...   row r-1: lane p (coda)
                 │ after a lane's first step its successor's token is drafted by the proposer
                 │ (prompt lookup, a caller's proposer, the bench's oracle) and enters row 0
                 │ in the next cycle, one step behind;
                 └ the lane leaving the coda gives the next token (the argmax): equal to its
                   successor's draft → the successor continues; else the successor and every
                   younger lane are discarded and the token starts a new lane.

Every leaving lane commits its position and gives one token, so at full acceptance a token costs
one cycle (one pass over the core with the prelude and coda of one row each), against r core
passes plus the prelude and coda for plain decoding.

Sampled (``draw``: the request's processed distribution and its one random stream): the leaving
lane's token is drawn instead of the argmax. A successor's draft x is a point mass, so it is kept
with probability p(x) and otherwise the token is drawn from p with x removed
(``sampling.accept_one``); without a successor the token is a plain draw. Each token's law is
then plain sampling's, though not its draws for a seed.

With the KL exit (``kl_exit``, ``full`` KV only: every lane still runs all r core steps, as a
one-row step does for the skipped steps' KV), each lane keeps its state after every checked
step (the cycle's carried rows) and, when it leaves, takes the coda after each of them in order
until its exit (``RecurrentGenerator.exit_output``, as a verify row does): the token is the exit
step's. Those coda calls rewrite its coda KV last, so the exit step's is what stays, and lanes
leave in position order, so each reads the coda KV of the earlier positions' exits, as plain
decoding does; the cycle's own coda row of that lane is overwritten before any lane reads it.

KV invariant (docs/architecture.md §5, "Pipeline cycle"): lane q at step k reads slot (k, l) at
positions < q, the prelude slots at positions < q and the coda slots at positions < q. Lane q-1
wrote those one cycle earlier (it runs every stage one cycle ahead of q), and a lane exists only
while all its ancestors survive. A discarded lane wrote only positions > the rejecting lane's
position p; the new lane p+1 and its successors rewrite every slot of each of those positions
before any lane reads it. So no surviving lane reads KV of a discarded lane, and each emitted
token is what the one-row prelude → core_step × r → coda calls give (the cycle's rows are those
calls' rows bit for bit), i.e. plain greedy's.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from loopcast.ort_runtime.decoding.proposers import Proposal
from loopcast.ort_runtime.decoding.protocols import ProposerBase
from loopcast.ort_runtime.decoding.sampling import accept_one, sample

from loopcast.errors import RequestError
from loopcast.kl_exit import KLExit
from loopcast.recurrent_state import initial_state
from loopcast.vocab import GraphKind


@dataclass
class Lane:
    position: int
    token: int  # the token at ``position``: a draft until the lane before it confirms it
    steps: int = 0  # core steps run so far
    checked: list = field(default_factory=list)  # KL exit: the states after its checked steps


@dataclass
class RecurrentPipelineStats:
    cycles: int = 0
    verified: int = 0  # successors' drafts checked against a leaving lane's token
    accepted: int = 0
    discarded_lanes: int = 0
    cold_starts: int = 0
    # per cycle (positions per row, leaving-row argmax, entering token, leaving-row logits), for tests
    trace: list | None = field(default=None)


class RecurrentPipeline:
    """The lane scheduler of one generation on a RecurrentGenerator at its ``loops`` = r.
    ``next_token(pending, limit)`` runs cycles until the oldest lane leaves the coda, commits
    its position and returns the token after it. Lanes live across calls; a call that finds the
    generator moved on (plain steps in between) starts cold from ``pending``."""

    def __init__(
        self, gen, drafts: ProposerBase, *, trace: bool = False, draw=None, kl_exit: KLExit | None = None
    ) -> None:
        """``draw``: sampling's ``(logits_V, context) -> p_V`` with its ``rng`` (None: greedy);
        ``kl_exit``: each token at its KL exit (``full`` KV policy only)."""
        refusal = pipeline_refusal(gen)
        if refusal is not None:
            raise RequestError(refusal, parameter="speculative")
        if kl_exit is not None and kl_exit.kv_policy != "full":
            raise RequestError(
                "the pipeline with the KL exit needs kv_policy 'full': every lane runs all r core steps",
                parameter="kv_policy",
            )
        self.gen, self.drafts, self.r, self.draw, self.kl_exit = gen, drafts, gen.loops, draw, kl_exit
        self.last_exit = self.r  # the core steps of the last token's output (its KL exit, or r)
        self.binding = gen.cycle
        self.lanes: list[Lane] = []
        self.stats = RecurrentPipelineStats(trace=[] if trace else None)
        cfg = gen.config
        self._zero = np.zeros(cfg.hidden_size, np.float32)

    def stop(self) -> None:
        """Plain decoding takes over: the lanes in flight are abandoned (their KV is past ``n``)."""
        self.stats.discarded_lanes += len(self.lanes)
        self.lanes = []

    def next_token(self, pending: int, limit_position: int) -> int:
        """``pending`` sits at position ``gen.n``; lanes are spawned only at positions <=
        ``limit_position`` (the last position whose successor token the generation may still
        emit, inside the KV capacity)."""
        gen = self.gen
        if not self.lanes or (self.lanes[0].position, self.lanes[0].token) != (gen.n, pending):
            self.stop()
            self.lanes = [Lane(gen.n, pending)]
            self.stats.cold_starts += 1
        while True:
            token = self._cycle(limit_position)
            if token is not None:
                return token

    def _cycle(self, limit_position: int) -> int | None:
        gen, r, lanes = self.gen, self.r, self.lanes
        positions = [-1] * self.binding.rows
        for lane in lanes:
            positions[lane.steps] = lane.position
        entering = lanes[-1] if lanes[-1].steps == 0 else None
        if entering is not None:
            cfg = gen.config
            state_0 = initial_state(cfg.hidden_size, cfg.state_std, [entering.position], gen.state_seed)[0]
        else:
            state_0 = self._zero
        # the leaving row is r-1 whether a lane is there or not (no lane: position -1, ignored)
        target = self.binding.run(entering.token if entering else 0, r - 1, positions, state_0)
        gen.core_runs += 1
        self.stats.cycles += 1
        leaving = lanes[0].steps + 1 == r
        kl = self.kl_exit
        if kl is not None:  # the states of the lanes that just ran a checked step
            states = self.binding.pull_states()
            for lane in lanes:
                if lane.steps + 1 >= min(kl.min_loops, r):
                    lane.checked.append(states[lane.steps])
        sampled_leave = leaving and self.draw is not None and kl is None  # (KL: the exit step's logits)
        logits = self.binding.pull_logits().copy() if sampled_leave else None
        if self.stats.trace is not None:
            logits = self.binding.pull_logits().copy() if logits is None else logits
            self.stats.trace.append((positions, target, entering.token if entering else -1, logits))
        for lane in lanes:
            lane.steps += 1
        youngest = lanes[-1]
        draft = None
        if youngest.steps == 1 and youngest.steps < r and youngest.position + 1 <= limit_position:
            context = [*gen.tokens, *(lane.token for lane in lanes)]  # the sequence up to youngest
            proposal = self.drafts.propose(context, 1)
            tokens = proposal.tokens if isinstance(proposal, Proposal) else proposal
            if len(tokens):
                draft = Lane(youngest.position + 1, int(tokens[0]))
        done = None
        if lanes[0].steps == r:
            done = self._leave(target, logits)
        if draft is not None and self.lanes and self.lanes[-1] is youngest:
            self.lanes.append(draft)
        return done

    def _leave(self, target: int, logits_V: np.ndarray | None) -> int:
        """The oldest lane ran every step and the coda: its position is committed and the next
        token is ``target`` (greedy) or a draw from ``logits_V``; its successor survives only if
        its draft is that token (sampled: kept by the rejection rule)."""
        lane = self.lanes.pop(0)
        if lane.position != self.gen.n:
            raise AssertionError(f"pipeline lane at {lane.position} left with n = {self.gen.n}")
        self.last_exit = self.r
        if self.kl_exit is not None:  # the coda after each checked step until the exit
            target, logits_V, self.last_exit = self.gen.exit_output(lane.checked, lane.position, self.kl_exit)
        self.gen.commit_lane(lane.token)
        p_V = self.draw(logits_V, self.gen.tokens) if self.draw is not None else None
        if not self.lanes:
            return target if p_V is None else sample(p_V, self.draw.rng)
        self.stats.verified += 1
        successor = self.lanes[0].token
        if p_V is None:
            kept, token = successor == target, target
        else:
            kept, token = accept_one(successor, None, p_V, self.draw.rng)
        if kept:
            self.stats.accepted += 1
        else:
            self.stats.discarded_lanes += len(self.lanes)
            self.lanes = []
        return token


def pipeline_refusal(gen) -> str | None:
    """Why the pipeline cannot run on this generator (None: it can), in one line."""
    manifest = gen.loaded.manifest
    if GraphKind.RECURRENT_CYCLE not in manifest.graphs:
        return (
            "speculative mode 'pipeline' needs the recurrent_cycle graph; this artifact lacks it "
            f"(op set {manifest.op_set}: re-export it with the loopcast attention op, --ops auto)"
        )
    if gen.sharing is not None:
        return "the pipeline needs a KV slot per (step, layer): this generator shares them (kv_sharing)"
    rows = manifest.graphs[GraphKind.RECURRENT_CYCLE].rows
    if gen.max_loops != rows:
        return (
            f"the pipeline's cycle has a row per core step up to {rows}; this generator holds KV "
            f"for {gen.max_loops} steps (max_loops): make it without max_loops"
        )
    return None
