"""One request at a time on one Generator: the batching engine's interface, the baseline.

``SequentialEngine`` serves an artifact without batched graphs (or ``loopcast serve
--sequential``): each request runs through the one-sequence engine
(ort_runtime/decoding/speculate.py) with every generation option it takes, so it serves every
speculative mode the artifact's graphs allow (``speculative_modes``), each under its own gate.
The load generator compares the batching engine against it.
"""

from __future__ import annotations

from loopcast.ort_runtime.batching.admission import EngineBase
from loopcast.ort_runtime.batching.requests import Completion
from loopcast.ort_runtime.decoding.stats import GenerationStats

# GenerationStats' adaptive-depth fields a completion carries (the response's and /metrics' source)
DEPTH_STATS = ("exit_histogram", "mean_loops", "core_calls_per_token", "core_passes", "kv_policy")


class SequentialEngine(EngineBase):
    """One request at a time on one Generator (``ort_runtime/speculate.stream``): the baseline."""

    def __init__(self, model, *, max_waiting: int = 256) -> None:
        self.model = model  # a LoopcastModel (api.py, the layer above, builds and passes it)
        self.generator = self.model.new_generator()
        super().__init__(self.generator.max_length, max_waiting)
        self._current: Completion | None = None
        self.stats = {"proposed": 0, "accepted": 0}
        # the family declares what it serves (ort_runtime/decoding/families.py)
        self.speculative_modes = model.decoding.speculative_modes(model.loaded)

    kind = "one-request-at-a-time engine"
    modes_note = " (the artifact's graphs)"

    @property
    def running(self) -> int:
        return int(self._current is not None)

    def _active_completions(self) -> list[Completion]:
        return [self._current] if self._current is not None else []

    def _loop(self) -> None:
        while self._idle_wait():
            completion = self._take_waiting()
            if completion is None:
                continue
            if completion.cancelled:
                completion._emit("done", "cancelled")
                continue
            self._current, request = completion, completion.request
            try:
                self.generator.rewind(0)
                mode = request.speculative
                if mode != "none" and not self.model.loaded.exact_verify:
                    mode, completion.speculative = "none", "none (verify rows are not exact on this device)"
                else:
                    completion.speculative = (
                        mode  # the engine's own gate (ort_runtime/decoding/gates.py) decides per step
                    )
                stats = GenerationStats()
                tokens = self.model.stream_ids(
                    request.ids,
                    request.max_new_tokens,
                    config=request.config,  # every option of one-sequence generation
                    stop_ids=request.stop_ids,
                    generator=self.generator,
                    sampling=request.sampling,
                    speculative=mode,
                    stats=stats,
                )
                reason = None
                for token in tokens:
                    completion._emit("token", token)
                    self.steps += 1
                    if completion.cancelled:
                        tokens.close()
                        reason = "cancelled"
                        break
                if reason is None:
                    reason = (
                        "eos" if completion.tokens and completion.tokens[-1] in request.stop_ids else "length"
                    )
                completion.proposed, completion.accepted = stats.proposed, stats.accepted
                completion.depth = {k: getattr(stats, k) for k in DEPTH_STATS}
                self.stats["proposed"] += stats.proposed
                self.stats["accepted"] += stats.accepted
                completion._emit("done", reason)
            except Exception as exc:
                completion._emit("error", f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}")
            finally:
                self.generator.rewind(0)
                self._current = None
