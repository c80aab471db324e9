"""The pipeline inside the continuous batch (``speculative="pipeline"``, greedy requests): every
running pipeline request keeps its lanes (ort_runtime/decoding/pipeline.py) in its slot's state,
and each engine step runs one ``cycle_batch`` call (graphs/batched_cycle.py,
ort_runtime/binding/cycle_batch_binding.py) over the lanes of all of them: slot b's lane at
depth r is row b·R + r, at its own position, reading and writing batch entry b of loop r's KV.

Per slot and call, the single-request pipeline's greedy rule, unchanged:

- every lane runs one loop; the youngest lane that finishes the exit loop e drafts the next
  position with that row's argmax (``hook`` may replace it: tests' forced rejections, the bench's
  oracle) and spawns its lane there, within ``limit`` (the last position whose successor the
  request may still emit, and room for the widest step's dummy rows);
- the oldest lane that finishes loop R commits its position (its KV is complete at every depth)
  and its argmax is the next token: its successor lane keeps going if its draft equals it, else
  the successor and every younger lane are discarded and the next call starts a lane from the
  new token.

KV invariant (per slot, as alone): a discarded lane wrote only positions past the committed
one, which the new lanes rewrite at each depth before any lane reads them; rows of one call
never share a (slot, depth, position) address. In steps that slot has no row in (decode_batch,
whose batch dummy rows would write at n_b), ``BatchGenerator.hold`` puts its dummy rows past its
youngest lane. Each row is the one-sequence cycle row bit for bit
(tests/ort_runtime/test_batch_cycle_rows.py), so every token is plain greedy's
(tests/ort_runtime/test_batch_pipeline.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from loopcast.ort_runtime.binding.cycle_batch_binding import CycleBatch


@dataclass
class BatchLane:
    position: int
    token: int  # the token at ``position``: a draft until the lane before it confirms it
    depth: int = 0  # loops run so far
    state: np.ndarray | None = None  # normed state after loop ``depth - 1`` (None at depth 0)


@dataclass
class SlotOutcome:
    """What one call did for one slot: the token after its committed position (None: no lane
    finished), and whether a draft was checked, kept, and how many lanes were discarded."""

    token: int | None = None
    verified: int = 0
    accepted: int = 0
    discarded: int = 0


class BatchedPipeline:
    """Lanes per sequence slot and the one call per step that advances them."""

    def __init__(
        self,
        gen,
        exit_depth: int = 1,
        hook: Callable[[int, list[int], int], int] | None = None,
    ) -> None:
        """``hook(slot, lane tokens after the pending one, draft) -> token`` replaces a draft."""
        self.gen, self.cycle = gen, CycleBatch(gen)
        self.loops = self.cycle.loops
        if not 1 <= exit_depth < self.loops:
            raise ValueError(f"pipeline exit depth must be in 1..{self.loops - 1}, got {exit_depth}")
        self.exit_depth, self.hook = exit_depth, hook
        self.lanes: dict[int, list[BatchLane]] = {}
        self.cycles = self.discarded = 0

    def drop(self, slot: int) -> None:
        """The slot leaves the pipeline (finished, or plain rows take over): its lanes are
        abandoned (their KV lies past its committed length)."""
        if self.lanes.pop(slot, None) is not None:
            self.gen.hold(slot, 0)

    def step(self, pending: dict[int, int], limits: dict[int, int]) -> dict[int, SlotOutcome]:
        """One call over the slots of ``pending`` (slot -> its pending token, at position n_b);
        ``limits``: slot -> the last position a lane may be spawned at. Commits each finished
        position (``gen.advance``); the caller emits the outcome's token."""
        gen, R, e = self.gen, self.loops, self.exit_depth
        rows = {}
        for slot, token in pending.items():
            lanes = self.lanes.get(slot)
            n = gen.lengths[slot]
            if not lanes or (lanes[0].position, lanes[0].token) != (n, token):
                self.discarded += len(lanes or ())
                lanes = self.lanes[slot] = [BatchLane(n, token)]  # a cold start from the pending token
            for lane in lanes:
                rows[(lane.depth, slot)] = (lane.position, lane.token if lane.depth == 0 else lane.state)
        ids, states = self.cycle.run(rows)
        self.cycles += 1
        outcomes = {}
        for slot in pending:
            lanes, out = self.lanes[slot], SlotOutcome()
            argmax = {}
            for lane in lanes:
                i = self.cycle.row(lane.depth, slot)
                argmax[lane.depth] = int(ids[i])
                lane.state = states[i]
                lane.depth += 1
            youngest, draft = lanes[-1], None
            if youngest.depth == e and youngest.position + 1 <= limits[slot]:
                token = argmax[e - 1]
                if self.hook is not None:
                    token = int(self.hook(slot, [lane.token for lane in lanes[1:]], token))
                draft = BatchLane(youngest.position + 1, token)
            if lanes[0].depth == R:
                lanes.pop(0)
                out.token = argmax[R - 1]
                gen.advance(slot, 1)
                if lanes:
                    out.verified = 1
                    out.accepted = int(lanes[0].token == out.token)
                    if not out.accepted:
                        out.discarded = len(lanes)
                        self.discarded += len(lanes)
                        lanes.clear()
            if draft is not None and lanes and lanes[-1] is youngest:
                lanes.append(draft)
            gen.hold(slot, lanes[-1].position + 1 - gen.lengths[slot] if lanes else 0)
            outcomes[slot] = out
        return outcomes

    def close(self) -> None:
        self.cycle.close()
