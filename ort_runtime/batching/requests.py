"""A request to a serving engine and its completion (ort_runtime/batching/engine.py, sequential.py).

``BatchRequest`` is what a caller submits (validated where it is built); ``Completion`` is the
submitted request as it runs: its tokens so far, how it finished, its speculation counts and a
cancel switch. Events reach ``on_event(kind, value)`` from the engine thread: ``("token", id)``,
then one ``("done", finish_reason)`` or ``("error", message)``; ``Completion.events`` is a
blocking iterator over them.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from loopcast.ort_runtime.decoding.generation_config import GenerationConfig
from loopcast.ort_runtime.decoding.sampling import SamplingParams

from loopcast.errors import RequestError
from loopcast.vocab import SpeculativeMode

EventSink = Callable[[str, object], None]
# Modes a request may name; each engine says which of them it runs (``speculative_modes``).
REQUEST_MODES = tuple(m.value for m in SpeculativeMode if m != SpeculativeMode.CUSTOM)


@dataclass(frozen=True)
class BatchRequest:
    ids: list[int]
    max_new_tokens: int = 64
    stop_ids: tuple[int, ...] = ()
    sampling: SamplingParams | None = None
    speculative: str = "none"  # one of the engine's speculative_modes
    # the request's other generation options (num_draft_tokens, min_ngram, ...); an engine refuses
    # a set option it does not honour (ort_runtime/batching/options.py)
    config: GenerationConfig = GenerationConfig()

    def __post_init__(self) -> None:
        if self.speculative not in REQUEST_MODES:
            raise RequestError(
                f"speculative must be one of {', '.join(REQUEST_MODES)}, got {self.speculative!r}",
                parameter="speculative",
            )
        if not isinstance(self.config, GenerationConfig):
            raise RequestError(f"config must be a GenerationConfig, got {type(self.config).__name__}")
        if not self.ids:
            raise RequestError("prompt is empty: give at least one token")
        if self.max_new_tokens < 1:
            raise RequestError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.sampling is not None and not isinstance(self.sampling, SamplingParams):
            raise RequestError(
                f"sampling must be a SamplingParams or None, got {type(self.sampling).__name__}"
            )


@dataclass(eq=False)
class Completion:
    """One submitted request: its tokens so far, how it finished, and a cancel switch."""

    request: BatchRequest
    on_event: EventSink | None = None
    id: int = 0
    tokens: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None
    speculative: str = "none"
    proposed: int = 0  # drafts offered by this request's proposer and verified
    accepted: int = 0
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    # adaptive depth (docs/adaptive-depth.md), where the engine reports it (the one-request
    # engine): exit_histogram, mean_loops, core_calls_per_token, core_passes, kv_policy
    depth: dict = field(default_factory=dict)
    submitted: float = field(default_factory=time.perf_counter)
    token_times: list[float] = field(default_factory=list)
    _cancel: threading.Event = field(default_factory=threading.Event)
    _events: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)
    _done: threading.Event = field(default_factory=threading.Event)

    def cancel(self) -> None:
        self._cancel.set()

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    def _emit(self, kind: str, value) -> None:
        if kind == "token":
            self.tokens.append(value)
            self.token_times.append(time.perf_counter())
        elif kind == "done":
            self.finish_reason = value
        else:
            self.error = value
        self._events.put((kind, value))
        if self.on_event is not None:
            self.on_event(kind, value)
        if kind != "token":
            self._done.set()

    def events(self, timeout: float | None = None) -> Iterator[tuple[str, object]]:
        """Blocking iterator over this request's events, ending after "done"/"error"."""
        while True:
            kind, value = self._events.get(timeout=timeout)
            yield kind, value
            if kind != "token":
                return

    def result(self, timeout: float | None = None) -> list[int]:
        """Wait for the end; the tokens, or RequestError if the request failed."""
        if not self._done.wait(timeout):
            raise TimeoutError("request did not finish in time")
        if self.error is not None:
            raise RequestError(self.error)
        return list(self.tokens)
