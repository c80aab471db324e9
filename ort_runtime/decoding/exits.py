"""Ouro's exit gate on the runtime (docs/adaptive-depth.md): each token is read at its exit loop.

A row runs its loops one call at a time (loop_embed, loop_step × loops, exit_head: graphs/
loop_steps.py) and the host decides after each loop, from that loop's exit-gate logit, whether
it is the row's exit loop e (``exit_loop``'s rule); the head runs once, on loop e's state.
Under KV policy ``full`` the row's deeper loops still run for the KV (Ouro's release, exact to
the model); under ``last-exited`` a decode row stops after loop e, and loop e's K/V is copied
into the deeper loops' slots at the row's position (``Generator.fill_deeper_kv``): what
exporter/reference_depth.py's row, stopped at e, leaves. Prompt rows run every loop under both
policies; the gate picks the token of its exit loop. With ``speculative='pipeline'`` (policy
``full``) the decode rows are the pipeline's lanes (ort_runtime/decoding/exit_lanes.py), which
decide by the same rule (``ExitGate.after_loop``) on the cycle graph's gates.

KV invariant: every committed position holds, in every loop's slot, the K/V its policy says
(``full``: its own loop's; ``last-exited``: the exit loop's in the deeper slots), written
before ``n`` passes it, so every later row reads exactly what the reference's rows read.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from loopcast.ort_runtime.decoding.generation_config import GenerationConfig

from loopcast.errors import RequestError
from loopcast.vocab import KVPolicy


def exit_loop(gate_logits: Sequence[float], threshold: float, lo: int, hi: int) -> int:
    """The 0-based exit loop from one row's gate logits at loops 0..R-1: λ_r = σ(g_r),
    p_r = λ_r·Π_{s<r}(1-λ_s) for r < R-1, the last loop the rest (in float64); the first r whose
    cumulative probability reaches ``threshold``, clamped to lo..hi."""
    R = len(gate_logits)
    survive, cumulative = 1.0, 0.0
    first = R - 1
    for r in range(R - 1):
        survive, cumulative = exit_mass(float(gate_logits[r]), survive, cumulative)
        if cumulative >= threshold:
            first = r
            break
    return min(max(first, lo), hi)


def exit_mass(gate_logit: float, survive: float, cumulative: float) -> tuple[float, float]:
    """One loop (not the last) of the exit distribution: (survival after it, cumulative exit
    probability through it), from the survival and cumulative probability before it."""
    if gate_logit >= 0:  # σ without overflow for logits of any size
        lam = 1.0 / (1.0 + math.exp(-gate_logit))
    else:
        z = math.exp(gate_logit)
        lam = z / (1.0 + z)
    return survive * (1.0 - lam), cumulative + lam * survive


@dataclass(frozen=True)
class ExitGate:
    """A generation's gate: threshold q, the clamp lo..hi (0-based loops) and the KV policy."""

    threshold: float
    lo: int
    hi: int
    policy: KVPolicy

    @classmethod
    def of(cls, config: GenerationConfig, num_loops: int) -> ExitGate:
        lo = (config.min_loops or 1) - 1
        hi = (config.max_loops or num_loops) - 1
        for name, value in (("min_loops", config.min_loops), ("max_loops", config.max_loops)):
            if value is not None and value > num_loops:
                raise RequestError(f"{name} must be in 1..{num_loops} (the model's loops), got {value}")
        assert config.exit_threshold is not None
        return cls(config.exit_threshold, lo, hi, config.kv_policy)

    def after_loop(self, r: int, gate_logit: float, mass: ExitMass, num_loops: int) -> bool:
        """Whether loop r (0-based) is the row's exit, given its gate logit and the row's exit
        distribution before it (``mass``, advanced in place): r ≥ lo and (r = hi or the
        cumulative probability through r reaches q). That probability grows with r and does not
        depend on the deeper loops' gates, so the first loop this says yes to is ``exit_loop``'s
        answer (the caller stops asking after it)."""
        if r < num_loops - 1:  # exit_loop's arithmetic, loop by loop
            mass.survive, mass.cumulative = exit_mass(gate_logit, mass.survive, mass.cumulative)
        return r >= self.lo and (r == self.hi or mass.cumulative >= self.threshold)


@dataclass
class ExitMass:
    """One row's exit distribution through the loops run so far (float64, as ``exit_loop``)."""

    survive: float = 1.0
    cumulative: float = 0.0


class GatedAcceptor:
    """Greedy decoding read at each row's exit loop (the engine's plain round calls it).

    A row runs its loops one call at a time (ort_runtime/binding/loop_steps.py) and reads the
    head at the first loop the gate makes final (``ExitGate.after_loop``). Under
    ``last-exited`` a decode row then stops (the loops after its exit never run) and loop e's
    K/V fills the deeper slots; otherwise its remaining loops run for the KV only."""

    sampled = False

    def __init__(self, gate: ExitGate) -> None:
        self.gate = gate
        self.loops: list[int] = []  # loops each emitted token was read at (the gated lanes' too)

    def _row(self, gen, token: int, skip: bool) -> int:
        if gen.n + 1 > gen.max_length:
            raise RequestError(f"a row at position {gen.n} passes the KV capacity {gen.max_length}")
        steps, gate = gen.loop_steps, self.gate
        R = steps.num_loops
        steps.embed(token, gen.n)
        mass = ExitMass()
        exit_r, next_id = -1, -1
        for r in range(R):
            g = steps.loop(r)
            if exit_r >= 0:
                continue  # a loop past the exit: its KV only (policy full, or a prompt row)
            if gate.after_loop(r, g, mass, R):
                exit_r, next_id = r, steps.head(r)
                if skip:
                    break
        if skip and exit_r < R - 1:
            gen.fill_deeper_kv(gen.n, exit_r)
        gen.commit([token])
        self.loops.append(exit_r + 1)
        return next_id

    def first(self, gen, ids: list[int]) -> int:
        if len(ids) > 1:
            gen.prefill(ids[:-1])
        return self._row(gen, ids[-1], skip=False)

    def decode(self, gen, pending: int, context: Sequence[int]) -> int:
        return self._row(gen, pending, skip=self.gate.policy == KVPolicy.LAST_EXITED)
