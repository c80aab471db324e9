"""Ouro's exit gate on the runtime (docs/adaptive-depth.md): each token is read at its exit loop.

The exits graph runs a row through every loop and returns each loop's argmax and exit-gate
logit; the host picks the exit loop e (``exit_loop``) and commits loop e's argmax. Under KV
policy ``full`` the deeper loops' KV is the graph's own (every loop ran: Ouro's release, exact
to the model); under ``last-exited`` loop e's K/V is then copied into the deeper loops' slots
at the row's position (``Generator.fill_deeper_kv``), which is what a row that stopped at loop
e and left its KV there would leave (exporter/reference_depth.py runs it that way). Prompt rows
run every loop under both policies; the gate picks the token of the last one.

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
        lam = 1.0 / (1.0 + math.exp(-float(gate_logits[r])))
        cumulative += lam * survive
        survive *= 1.0 - lam
        if cumulative >= threshold:
            first = r
            break
    return min(max(first, lo), hi)


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


class GatedAcceptor:
    """Greedy decoding read at each row's exit loop (the engine's plain round calls it)."""

    sampled = False

    def __init__(self, gate: ExitGate) -> None:
        self.gate = gate
        self.loops: list[int] = []  # loops each emitted token was read at

    def _row(self, gen, token: int, skip: bool) -> int:
        out = gen.run_exits(token)
        e = exit_loop(out.gates, self.gate.threshold, self.gate.lo, self.gate.hi)
        if skip and e < gen.model.config.num_loops - 1:
            gen.fill_deeper_kv(gen.n, e)
        gen.commit([token])
        self.loops.append(e + 1)
        return int(out.next_ids[e])

    def first(self, gen, ids: list[int]) -> int:
        if len(ids) > 1:
            gen.prefill(ids[:-1])
        return self._row(gen, ids[-1], skip=False)

    def decode(self, gen, pending: int, context: Sequence[int]) -> int:
        return self._row(gen, pending, skip=self.gate.policy == KVPolicy.LAST_EXITED)
