"""Captured-graph ids: one pool per capture session (graph kind), recycling an id only with the
buffers it was captured on (ORT replays a captured id without reading the binding)."""

from __future__ import annotations

import threading
from collections.abc import Hashable


class GraphIdPool:
    """The ``gpu_graph_id``s of one capture session (one graph kind): ids start at 1 (-1 means
    uncaptured to ORT, 0 is its default id); an id is held by one binding at a time.

    Reuse rule, from what ORT does with an id it has seen: its CUDA provider keeps one
    instantiated graph per id (onnxruntime/core/providers/cuda/cuda_graph.cc:
    ``CUDAGraphManager::IsGraphCaptured`` is ``cuda_graph_set_.Contains(id)``, ``Replay(id)``
    launches ``cuda_graph_set_.Get(id)``; ``CaptureEnd`` puts it there), and
    ``InferenceSession::Run`` (onnxruntime/core/session/inference_session.cc) replays a captured
    id straight away, skipping the executor and so the IO binding it was given. A reused id
    therefore replays the OLD graph, reading and writing the buffers of the binding it was
    captured on. (ORT's own Python ``run_with_iobinding`` refuses a different binding under a
    captured WebGPU id for that reason; for CUDA it checks nothing.) So a released id goes back
    with the key of the buffers it was captured on (each bound name, address and shape) and is
    handed only to a binding that binds exactly those: a later generator whose buffers landed
    where a dropped one's were replays a graph that reads and writes its own buffers. An id that
    never ran holds no graph (``buffers=None``) and goes to any binding. (ORT's
    ``InferenceSession.release_captured_graph(id)`` frees a graph where the provider supports it
    and is a no-op elsewhere, so it cannot make an id safe for other buffers; it is not used.)
    """

    def __init__(self) -> None:
        self._next = 1
        self._held: set[int] = set()
        self._free: dict[Hashable, list[int]] = {}
        self._lock = threading.Lock()

    def acquire(self, buffers: Hashable) -> int:
        """An id for a binding of ``buffers``: one released with the same buffers, else one that
        never ran, else a fresh one."""
        with self._lock:
            for key in (buffers, None):
                free = self._free.get(key)
                if free:
                    graph_id = free.pop()
                    break
            else:
                graph_id, self._next = self._next, self._next + 1
            self._held.add(graph_id)
            return graph_id

    def release(self, graph_id: int, buffers: Hashable | None) -> None:
        """Give ``graph_id`` back: ``buffers`` is the key it was captured on, None if it never ran."""
        with self._lock:
            if graph_id not in self._held:
                raise ValueError(f"graph id {graph_id} is not held (released twice?)")
            self._held.discard(graph_id)
            self._free.setdefault(buffers, []).append(graph_id)

    def held(self) -> frozenset[int]:
        with self._lock:
            return frozenset(self._held)

    def issued(self) -> int:
        """How many distinct ids this pool has handed out (the graphs ORT may hold at most)."""
        with self._lock:
            return self._next - 1
