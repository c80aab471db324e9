"""One IO binding's runs: eager, or a captured CUDA graph with an eager fallback (docs/architecture.md §5).

A ``CapturedRunner`` owns one session, one IO binding and, when its kind is captured, one graph
slot: a ``gpu_graph_id`` taken from the kind's pool (ort_runtime/loading/artifact.py,
``GraphIdPool``). ORT's CUDA provider warms up and captures inside a graph id's first ``Run``
and replays from the second on, so:

- the first run of a slot is warm-up + capture, every later one a replay;
- if that first run raises, the same graph runs on the kind's eager session with a binding of
  the same buffers (the same kernels, so the same tokens) and the slot stays eager for good
  (``slot.failure`` says why, ``slot.fallbacks`` counts the eager runs); if the eager run fails
  too, the error is not about capture and is raised, naming the kind;
- a run is *steady* unless it is a slot's first run or an eager binding's first run (which
  follows the binding's, and maybe its session's, creation, and ORT allocates on a session's
  first run): the cost gate's timers keep steady runs only.

The runner's graph id goes back to the pool when it is closed or garbage-collected, together
with the buffers it was bound to (the pool's reuse rule says why).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Hashable
from dataclasses import dataclass

import onnxruntime as ort
from loopcast.ort_runtime.loading.graph_ids import GraphIdPool

from loopcast.errors import ArtifactError, RequestError


@dataclass
class GraphSlot:
    """One binding's captured CUDA graph (docs/architecture.md §5), and what happened to it.

    The counters follow ORT's rule per graph id (warm-up and capture inside the first ``Run``,
    replays after); they are derived, ORT does not report them. A recycled id whose graph ORT
    still holds replays already on its first run; the slot counts that run as its capture all
    the same (it is not a steady one either way). ``fallbacks`` counts runs that went to the
    eager session after the first run failed with graphs but succeeded without.
    """

    graph_id: int
    runs: int = 0
    warmups: int = 0
    captures: int = 0
    replays: int = 0
    fallbacks: int = 0
    failure: str | None = None

    def as_dict(self) -> dict:
        return {
            "graph_id": self.graph_id,
            "warmups": self.warmups,
            "captures": self.captures,
            "replays": self.replays,
            "fallbacks": self.fallbacks,
            "failure": self.failure,
        }


class _Recorder:
    """An IO binding that notes every buffer bound, by name, address and shape: what a captured
    graph bakes in, and so the key under which its graph id may be recycled."""

    def __init__(self, binding) -> None:
        self._binding = binding
        self.bound: list[tuple] = []

    def bind_ortvalue_input(self, name: str, value) -> None:
        self.bound.append((name, value.data_ptr(), tuple(value.shape())))
        self._binding.bind_ortvalue_input(name, value)

    def bind_ortvalue_output(self, name: str, value) -> None:
        self.bound.append((name, value.data_ptr(), tuple(value.shape())))
        self._binding.bind_ortvalue_output(name, value)

    def bind_input(self, name: str, device: str, device_id: int, dtype, shape, ptr: int) -> None:
        self.bound.append((name, ptr, tuple(shape)))
        self._binding.bind_input(name, device, device_id, dtype, shape, ptr)

    def bind_output(self, name: str, device: str, device_id: int, dtype, shape, ptr: int) -> None:
        self.bound.append((name, ptr, tuple(shape)))
        self._binding.bind_output(name, device, device_id, dtype, shape, ptr)

    def bind_cpu_input(self, name: str, array) -> None:
        self.bound.append((name, array.ctypes.data, tuple(array.shape)))
        self._binding.bind_cpu_input(name, array)

    def key(self) -> Hashable:
        return tuple(sorted(self.bound))


class _Lease:
    """A runner's graph id on loan from its pool. Holds no reference to the runner, so the
    runner's finalizer can return it."""

    def __init__(self, pool: GraphIdPool, buffers: Hashable) -> None:
        self.pool, self.buffers = pool, buffers
        self.graph_id = pool.acquire(buffers)
        self.ran = False

    def give_back(self) -> None:
        # an id that never ran holds no graph: any binding may take it
        self.pool.release(self.graph_id, self.buffers if self.ran else None)


def _reason(exc: BaseException) -> str:
    text = str(exc)
    return text.splitlines()[0][:300] if text.strip() else type(exc).__name__


class CapturedRunner:
    """One (session, IO binding, optional graph slot). ``bind`` binds every input and output of
    the graph onto the IO binding it is given (called once here, and once more on a fallback);
    ``pool`` is the kind's graph-id pool, None for an eager binding; ``eager_session`` gives the
    kind's uncaptured session (called only on a fallback)."""

    def __init__(
        self,
        kind: str,
        session: ort.InferenceSession,
        bind: Callable[[object], None],
        *,
        pool: GraphIdPool | None = None,
        eager_session: Callable[[], ort.InferenceSession] | None = None,
    ) -> None:
        self.kind, self.session, self._bind, self._eager_session = kind, session, bind, eager_session
        self.binding = session.io_binding()
        recorder = _Recorder(self.binding)
        bind(recorder)
        self.runs = 0  # every run, captured or eager
        self._warm = False  # an eager binding's first run is not a steady one
        self._closed = False
        self.slot: GraphSlot | None = None
        self._options: ort.RunOptions | None = None
        self._lease: _Lease | None = None
        if pool is not None:
            self._lease = _Lease(pool, recorder.key())
            self._finalizer = weakref.finalize(self, self._lease.give_back)
            self.slot = GraphSlot(self._lease.graph_id)
            self._options = ort.RunOptions()
            self._options.add_run_config_entry("gpu_graph_id", str(self.slot.graph_id))

    def run(self) -> bool:
        """Run once: eagerly, or as this slot's warm-up + capture / replay. Returns whether the
        run was a steady one (not a slot's first run, not an eager binding's first run)."""
        if self._closed:
            raise RequestError(f"the '{self.kind}' binding was closed; make a new generator")
        steady = self._run()
        self.runs += 1
        return steady

    def _run(self) -> bool:
        slot = self.slot
        if slot is None:
            self.session.run_with_iobinding(self.binding)
            warm, self._warm = self._warm, True
            return warm
        if slot.failure is not None:
            slot.fallbacks += 1
            self.session.run_with_iobinding(self.binding)
            return True
        self._lease.ran = True
        try:
            self.session.run_with_iobinding(self.binding, self._options)
        except Exception as exc:
            if slot.runs:  # a replay failing is not a capture problem: surface it
                raise
            self._fall_back(_reason(exc))
            return False
        slot.runs += 1
        if slot.runs == 1:
            slot.warmups += 1
            slot.captures += 1
            return False
        slot.replays += 1
        return True

    def _fall_back(self, reason: str) -> None:
        """The first run failed with graphs: try the same graph eagerly (the same kernels, so the
        same tokens). Only if that works does this slot stay eager; otherwise the error is not a
        capture problem and is raised, naming the kind."""
        session = self._eager_session()
        binding = session.io_binding()
        self._bind(binding)
        try:
            session.run_with_iobinding(binding)
        except Exception as exc:
            raise ArtifactError(f"the '{self.kind}' graph failed on its first run ({_reason(exc)})") from None
        self.session, self.binding = session, binding
        self.slot.failure = reason
        self.slot.fallbacks += 1

    def close(self) -> None:
        """Give the graph id back to its pool (also done when the runner is garbage-collected)."""
        self._closed = True
        if self._lease is not None:
            self._finalizer()
