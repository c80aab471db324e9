"""One generator's step clock: how often and how long each graph kind ran, and the wall timers
the engine keeps beside them (rounds' wall time, for the gate's host factor).

A *steady* run is one with no warm-up, capture or fallback set-up inside (a captured CUDA
graph's first runs cost many steps): only steady runs enter the means the cost gate prices
with. The clock also keeps what the gates learned from these timings on this generator, so the
next generation on it starts from there (``gate_state``).
"""

from __future__ import annotations

import time
from collections import defaultdict, deque
from dataclasses import dataclass

SLOW_FACTOR = 3.0  # a run this many times its kind's steady mean is a stall worth naming
SLOW_AFTER = 16  # steady runs of a kind before its mean is trusted for that


def rows_timer(kind: str, rows: int) -> str:
    """The timer of a variable-rows kind's steady runs at one row count (Generator.run)."""
    return f"{kind}/rows{rows}"


@dataclass(frozen=True)
class ClockReading:
    """Runs and seconds per kind at one moment (``StepClock.reading``)."""

    runs: dict[str, int]
    seconds: dict[str, float]


class StepClock:
    def __init__(self) -> None:
        self._runs: dict[str, int] = defaultdict(int)
        self._seconds: dict[str, float] = defaultdict(float)
        self._steady: dict[str, int] = defaultdict(int)
        self._steady_seconds: dict[str, float] = defaultdict(float)
        self._gates: dict[tuple[str, ...], dict] = {}
        self.worst: dict[str, float] = {}  # kind -> its slowest run's seconds (a reader clears it)
        # the latest stalls: (perf_counter at the run's end, kind, seconds), for telling a stall
        # inside ORT's run from one in the host's work around it (tools/bench/loadgen_report.py)
        self.slow: deque[tuple[float, str, float]] = deque(maxlen=64)

    # -- graph runs ------------------------------------------------------------------------------
    def record(self, kind: str, seconds: float, steady: bool) -> None:
        self._runs[kind] += 1
        self._seconds[kind] += seconds
        self.worst[kind] = max(self.worst.get(kind, 0.0), seconds)
        count = self._steady.get(kind, 0)
        if count >= SLOW_AFTER and seconds > SLOW_FACTOR * self._steady_seconds[kind] / count:
            self.slow.append((time.perf_counter(), kind, seconds))
        if steady:
            self._steady[kind] += 1
            self._steady_seconds[kind] += seconds

    def runs(self, kind: str) -> int:
        return self._runs.get(kind, 0)

    def seconds(self, kind: str) -> float:
        return self._seconds.get(kind, 0.0)

    def kinds(self) -> list[str]:
        return list(self._runs)

    # -- steady means (graph kinds and wall timers) ----------------------------------------------
    def add(self, timer: str, seconds: float, count: int = 1) -> None:
        """A wall timer (not a graph run): ``count`` steady events taking ``seconds`` in all."""
        self._steady[timer] += count
        self._steady_seconds[timer] += seconds

    def steady(self, name: str) -> int:
        return self._steady.get(name, 0)

    def steady_seconds(self, name: str) -> float:
        return self._steady_seconds.get(name, 0.0)

    def mean(self, name: str) -> float | None:
        count = self._steady.get(name, 0)
        return self._steady_seconds[name] / count if count else None

    def means_ms(self) -> dict[str, float]:
        return {k: round(1e3 * self._steady_seconds[k] / c, 4) for k, c in self._steady.items() if c}

    # -- readings --------------------------------------------------------------------------------
    def reading(self) -> ClockReading:
        return ClockReading(dict(self._runs), dict(self._seconds))

    def since(self, before: ClockReading) -> ClockReading:
        """Runs and seconds per kind since ``before``."""
        return ClockReading(
            {k: n - before.runs.get(k, 0) for k, n in self._runs.items()},
            {k: s - before.seconds.get(k, 0.0) for k, s in self._seconds.items()},
        )

    # -- what the gates learned ------------------------------------------------------------------
    def gate_state(self, key: tuple[str, ...]) -> dict:
        """The state a gate of this ``key`` (gate, proposer, strategy) left on this generator."""
        return self._gates.setdefault(key, {})
