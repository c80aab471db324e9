"""The loaded model's sessions by graph kind, some made on first use.

On the CPU every session of the stock MatMul op sets keeps its own prepacked copy of the
weights (ORT's Python binding cannot share one: ort_runtime/loading/artifact.py). The kinds that only a
speculative mode runs (draft, verify_tail, cycle, tree kinds) therefore get their session when
a generation first asks for them, so plain decoding and prompt lookup hold one packed copy.
Their graphs are still checked at load, on a session that does not prepack and is then
dropped, so a broken file is an error of ``open_artifact``, not of some later generation.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Mapping

import onnxruntime as ort


class SessionTable(Mapping):
    """kind -> session. A deferred kind's session is made by its factory on the first lookup
    (once, under a lock: generators may be made from several threads); ``in``, ``len`` and
    iteration cover every kind without making any."""

    def __init__(
        self,
        made: dict[str, ort.InferenceSession],
        deferred: dict[str, Callable[[], ort.InferenceSession]] | None = None,
        order: list[str] | None = None,
    ) -> None:
        self._made = dict(made)
        self._deferred = dict(deferred or {})
        self._order = list(order) if order is not None else [*self._made, *self._deferred]
        self._lock = threading.RLock()  # a shared kind's factory looks up its host (decode@k: prefill@k)

    def __getitem__(self, kind: str) -> ort.InferenceSession:
        session = self._made.get(kind)
        if session is not None:
            return session
        if kind not in self._deferred:
            raise KeyError(kind)
        with self._lock:
            if kind not in self._made:
                self._made[kind] = self._deferred[kind]()
            return self._made[kind]

    def __contains__(self, kind: object) -> bool:
        return kind in self._made or kind in self._deferred

    def __iter__(self) -> Iterator[str]:
        return iter(self._order)

    def __len__(self) -> int:
        return len(self._order)

    def pending(self, kind: str) -> bool:
        """Whether ``kind``'s session has not been made yet (it will be on first lookup)."""
        return kind in self._deferred and kind not in self._made

    def made(self) -> dict[str, ort.InferenceSession]:
        """The sessions made so far (what is resident), by kind."""
        return {kind: self._made[kind] for kind in self._order if kind in self._made}
