"""The part every serving engine shares: a bounded FIFO of waiting requests and one engine thread.

``submit`` checks a request against the engine (``check``: the modes and options it serves) and
the KV capacity, and queues it, or refuses it with ``CapacityError`` when the queue is full; the
engine thread (``_loop``, each engine's own) takes requests with ``_take_waiting``;
``shutdown`` stops admitting, lets running requests finish and cancels the rest.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque

from loopcast.ort_runtime.batching.requests import BatchRequest, Completion, EventSink

from loopcast.errors import LoopcastError, RequestError


class CapacityError(LoopcastError):
    """Every slot is busy and the waiting queue is full: retry later (HTTP 503)."""


class EngineBase:
    def __init__(self, max_length: int, max_waiting: int) -> None:
        self.max_length, self.max_waiting = max_length, max_waiting
        self._waiting: deque[Completion] = deque()
        self._cv = threading.Condition()
        self._stopping = False
        self._ids = itertools.count(1)
        self._thread = threading.Thread(target=self._serve, name=type(self).__name__, daemon=True)
        self._ready = threading.Event()
        self._prepare_error: BaseException | None = None
        self.steps = 0
        self.phase_ms: dict[str, float] = {}  # the engine loop's phases: total and worst ms
        self.phase_runs: dict[str, int] = {}
        # the latest slow passes: (perf_counter at the pass's end, phase, ms) of any phase above 3x
        # the mean step, a stall that every running request's next token waits out
        self.slow_phases: deque[tuple[float, str, float]] = deque(maxlen=64)

    def _timed(self, phase: str, seconds: float) -> None:
        """One pass of an engine loop's phase (admit, prefill, step): its total and worst, in ms
        (the load generator reads them beside its token gaps: where a stall was spent)."""
        ms, steps = seconds * 1e3, self.phase_runs.get("step", 0)
        if steps >= 16 and ms > 3.0 * self.phase_ms.get("step", 0.0) / steps:
            self.slow_phases.append((time.perf_counter(), phase, ms))
        self.phase_runs[phase] = self.phase_runs.get(phase, 0) + 1
        self.phase_ms[phase] = self.phase_ms.get(phase, 0.0) + ms
        self.phase_ms[f"{phase}_max"] = max(self.phase_ms.get(f"{phase}_max", 0.0), ms)

    def reset_phase_timer(self) -> None:
        """Start the phases' totals, worsts and slow passes afresh (a load level's own)."""
        self.phase_ms.clear()
        self.phase_runs.clear()
        self.slow_phases.clear()

    def start(self):
        """Start the engine thread and wait until it is ready to serve: ``_prepare`` runs there
        first, since ORT's CUDA provider keeps captured graphs per calling thread (a graph
        captured on another thread is warmed up and captured again inside a request's step).
        An error in ``_prepare`` is raised here."""
        self._thread.start()
        self._ready.wait()
        if self._prepare_error is not None:
            self._thread.join()
            raise self._prepare_error
        return self

    def _prepare(self) -> None:
        """Work that must run on the engine thread before the first request (none here)."""

    def _serve(self) -> None:
        try:
            self._prepare()
        except BaseException as exc:  # start() raises it in the caller's thread
            self._prepare_error = exc
            return
        finally:
            self._ready.set()
        self._loop()

    speculative_modes: tuple[str, ...] = ("none",)

    def check(self, request: BatchRequest) -> None:
        """Refuse (RequestError naming the option) what this engine cannot serve."""
        if request.speculative not in self.speculative_modes:
            raise RequestError(
                f"speculative {request.speculative!r} is not served by this {self.kind}; it serves "
                f"{', '.join(self.speculative_modes)}{self.modes_note}",
                parameter="speculative",
            )

    kind = "engine"
    modes_note = ""

    def submit(self, request: BatchRequest, on_event: EventSink | None = None) -> Completion:
        self.check(request)
        if len(request.ids) >= self.max_length:
            raise RequestError(
                f"prompt of {len(request.ids)} tokens does not fit the KV capacity "
                f"({self.max_length} tokens, one of them for the first generated token)"
            )
        completion = Completion(request, on_event, next(self._ids))
        with self._cv:
            if self._stopping:
                raise CapacityError("the engine is shutting down")
            if len(self._waiting) >= self.max_waiting:
                raise CapacityError(
                    f"{len(self._waiting)} requests are already waiting for a slot "
                    f"(max_waiting={self.max_waiting}); retry later"
                )
            self._waiting.append(completion)
            self._cv.notify()
        return completion

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop admitting, let running requests finish (up to ``timeout`` s), cancel the rest."""
        with self._cv:
            self._stopping = True
            self._cv.notify()
        self._thread.join(timeout)
        if self._thread.is_alive():
            self._cancel_all()
            self._thread.join(5.0)

    def _cancel_all(self) -> None:
        with self._cv:
            waiting = list(self._waiting)
        for c in waiting + self._active_completions():
            c.cancel()

    def _take_waiting(self) -> Completion | None:
        with self._cv:
            return self._waiting.popleft() if self._waiting else None

    def _idle_wait(self) -> bool:
        """Block until there is work; False when the engine should exit."""
        with self._cv:
            while not self._waiting and not self._stopping:
                self._cv.wait(0.5)
            return not (self._stopping and not self._waiting)

    def _active_completions(self) -> list[Completion]:
        return []

    def _loop(self) -> None:
        raise NotImplementedError
