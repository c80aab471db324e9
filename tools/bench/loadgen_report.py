"""Where a batched load level's time went (tools/bench/loadgen.py): the garbage collector's
pauses, the engine loop's stalls with the slow graph runs inside them, and the per-level
timing line (graph runs, token-gap tail, the engine loop's worst phases)."""

from __future__ import annotations

import gc
import time


class GcPauses:
    """The garbage collector's pauses (gc.callbacks): a full collection stops every thread, the
    engine's included, so it shows in the token gaps."""

    def __init__(self) -> None:
        self.pauses: list[tuple[int, float]] = []
        self._t0: float | None = None
        gc.callbacks.append(self)

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        elif self._t0 is not None:
            self.pauses.append((info["generation"], time.perf_counter() - self._t0))
            self._t0 = None

    def summary(self) -> dict:
        full = [s for g, s in self.pauses if g == 2]
        return {
            "gc_collections": len(self.pauses),
            "gc_full_collections": len(full),
            "gc_pause_ms_max": round(1e3 * max((s for _, s in self.pauses), default=0.0), 2),
        }


def stalls(engine, start: float, end: float) -> list[dict]:
    """The engine loop's passes between ``start`` and ``end`` (perf_counter) that took over 3x
    the mean step, each with the slow graph runs that ended inside it: a stall whose time is one
    graph run's is inside ORT's run (the device or the provider), one without is the host's work.
    ``at_s``: seconds from ``start``, whose spacing tells a periodic stall from a random one."""
    steps = engine.phase_runs.get("step", 0)
    if not steps:
        return []
    limit = 3.0 * engine.phase_ms.get("step", 0.0) / steps
    runs = [r for r in engine.gen.clock.slow if start <= r[0] <= end]
    found = []
    for t, phase, ms in engine.slow_phases:
        if not start <= t <= end or ms <= limit:
            continue
        inside = [(kind, s) for r_t, kind, s in runs if t - ms / 1e3 <= r_t <= t]
        found.append(
            {
                "at_s": round(t - start, 3),
                "phase": phase,
                "ms": round(ms, 2),
                "graph_runs": [{"kind": k, "ms": round(1e3 * s, 2)} for k, s in inside],
            }
        )
    return found


def stall_line(found: list[dict]) -> str:
    if not found:
        return "  stalls (engine passes over 3x the mean step): none"
    in_graph = sum(1 for f in found if sum(g["ms"] for g in f["graph_runs"]) >= 0.5 * f["ms"])
    kinds = sorted({g["kind"] for f in found for g in f["graph_runs"]})
    at = ", ".join(f"{f['at_s']:.2f}s {f['phase']} {f['ms']:.0f}" for f in found[:12])
    return (
        f"  stalls (engine passes over 3x the mean step): {len(found)}, {in_graph} of them mostly one "
        f"slow graph run ({', '.join(kinds) or 'none'}); at {at}{' ...' if len(found) > 12 else ''}"
    )


def timing_line(level: dict) -> str:
    """Where a batched level's time went: graph runs and their mean ms, the token gaps' tail,
    and the engine loop's worst phase (admit, prefill, step): a stall inside a graph's run shows in
    its worst, one in the host's work only in the engine's."""
    ms = level["graph_ms_mean"]
    slowest = level.get("graph_ms_worst", {})
    runs = ", ".join(
        f"{k} {n} x {ms[k]:.2f} ms (worst {slowest.get(k, 0):.1f})" for k, n in level["graph_runs"].items()
    )
    tail = "/".join(f"{level[f'token_latency_ms_{q}'] or 0:.1f}" for q in ("p90", "p95", "max"))
    worst = ", ".join(f"{k[:-4]} {v:.1f}" for k, v in level["engine_phase_ms"].items() if k.endswith("_max"))
    gc_note = (
        f"; gc {level['gc_collections']} ({level['gc_full_collections']} full), "
        f"worst {level['gc_pause_ms_max']} ms"
    )
    return f"  {runs}; token p90/p95/max {tail} ms; engine worst ms {worst}{gc_note}"
