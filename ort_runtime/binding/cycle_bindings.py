"""The pipeline's bindings (docs/architecture.md §5, "Pipeline cycle"): the cycle graph, one
cycle per call, and the cycle run, K cycles per call with the lane schedule on the device.

Both hand the lanes' hidden states from one call to the next on the device: two state buffers
alternate as input and output, each direction its own binding (and its own captured graph on
CUDA: a captured graph bakes in its buffers' addresses).
"""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
from loopcast.ort_runtime.binding.bindings import _bind_kv, _Buffer, _KindBinding
from loopcast.ort_runtime.loading.artifact import LoadedModel

from loopcast.manifest import GraphSpec, lane_record_length, lane_state_length

EXIT_GATES = "exit_gates_BR"  # the cycle graph's per-row exit-gate logits (graphs/cycles.py)


class _Half(_KindBinding):
    """A pipeline graph bound one way round: lane states in from ``carried_in``, out to ``carried_out``."""

    def __init__(
        self, session, spec: GraphSpec, kv, model: LoadedModel, io, carried_in: _Buffer, carried_out: _Buffer
    ) -> None:
        self.spec = spec
        self._kv, self.io, self.carried_in, self.carried_out = kv, io, carried_in, carried_out
        self._open(session, model)

    def _bind(self, b: ort.IOBinding) -> None:
        b.bind_ortvalue_input("carried_BWH", self.carried_in.value)
        b.bind_ortvalue_output("carried_BWH_out", self.carried_out.value)
        self.io.bind(b, self._kv)


class LaneStates:
    """The lanes' hidden states between calls: two buffers that alternate as input and output
    (the graph shifts row r to row r+1, so the states never cross to the host). The cycle and the
    cycle run share one pair and one turn, so a generation can hand its lanes from one to the
    other (a cold start's first round runs cycle by cycle, the rounds after it K per call)."""

    def __init__(self, rows: int, model: LoadedModel, dtype) -> None:
        shape = (1, rows, model.config.hidden_size)
        self.buffers = (_Buffer(shape, dtype, model.device), _Buffer(shape, dtype, model.device))
        self.turn = 0


class _LaneStates:
    """A pipeline graph's binding for each direction of the shared lane states."""

    def _halves(
        self, session, spec: GraphSpec, kv, model: LoadedModel, dtype, shared: LaneStates | None
    ) -> None:
        self._slots = spec.kv_slots
        self.shared = shared or LaneStates(spec.rows, model, dtype)
        self.states = states = self.shared.buffers
        self.halves = (
            _Half(session, spec, kv, model, self, states[0], states[1]),
            _Half(session, spec, kv, model, self, states[1], states[0]),
        )

    def execute(self, model: LoadedModel) -> bool:
        """Run the half whose input holds the last call's states; the next call runs the other."""
        shared = self.shared
        steady = self.halves[shared.turn].execute(model)
        shared.turn ^= 1
        return steady

    def close(self) -> None:
        for half in self.halves:
            half.close()

    def _buffers(self) -> list[_Buffer]:
        raise NotImplementedError

    def bound_objects(self) -> list[object]:
        bufs = [*self._buffers(), *self.states]
        return [x for b in bufs for x in (b.host, b.value)] + [h.binding for h in self.halves]


class CycleBinding(_LaneStates):
    """The cycle graph, one cycle per call: the entering token with the rows' positions (one int32
    vector, one copy to the device per cycle) in, argmax and logits per row out, and each row's
    exit-gate logit where the artifact declares it (``gates``; None without)."""

    def __init__(
        self, session, spec: GraphSpec, kv, model: LoadedModel, dtype, shared: LaneStates | None = None
    ) -> None:
        cfg, device, R = model.config, model.device, spec.rows
        self.rows = R
        self.lanes = _Buffer((R + 1,), np.int32, device)
        self.next_ids = _Buffer((1, R), np.int64, device)
        self.logits = _Buffer((1, R, cfg.vocab_size), np.float32, device)
        self.gates = _Buffer((1, R), np.float32, device) if EXIT_GATES in spec.outputs else None
        self._halves(session, spec, kv, model, dtype, shared)

    def bind(self, b: ort.IOBinding, kv) -> None:
        b.bind_ortvalue_input("lanes_W1", self.lanes.value)
        _bind_kv(b, kv, self._slots)
        b.bind_ortvalue_output("next_token_ids_BS", self.next_ids.value)
        b.bind_ortvalue_output("logits_BSV", self.logits.value)
        if self.gates is not None:
            b.bind_ortvalue_output(EXIT_GATES, self.gates.value)

    def load(self, token: int, positions: list[int]) -> None:
        host = self.lanes.host
        host[0] = token
        host[1:] = positions
        self.lanes.push()

    def _buffers(self) -> list[_Buffer]:
        return [self.lanes, self.next_ids, self.logits] + ([self.gates] if self.gates is not None else [])


class CycleRunBinding(_LaneStates):
    """The cycle run, K cycles per call (graphs/cycles.py::build_cycle_run): the lane state in
    (one copy per call), the log of the K cycles and the state after them out (one copy back).
    Its KV buffers are bound as inputs only: the graph writes them in place."""

    def __init__(
        self, session, spec: GraphSpec, kv, model: LoadedModel, dtype, shared: LaneStates | None = None
    ) -> None:
        device, R = model.device, spec.rows
        self.rows = R
        log_len = next(o.shape[0] for o in session.get_outputs() if o.name == "lane_log_N")
        self.cycles = (log_len - lane_state_length(R)) // lane_record_length(R)
        self.state = _Buffer((lane_state_length(R),), np.int32, device)
        self.log = _Buffer((log_len,), np.int32, device)
        self._halves(session, spec, kv, model, dtype, shared)

    def bind(self, b: ort.IOBinding, kv) -> None:
        b.bind_ortvalue_input("lane_state_N", self.state.value)
        for slot in self._slots:
            key, value = kv[slot]
            b.bind_ortvalue_input(f"past_key.{slot}", key.value)
            b.bind_ortvalue_input(f"past_value.{slot}", value.value)
        b.bind_ortvalue_output("lane_log_N", self.log.value)

    def _buffers(self) -> list[_Buffer]:
        return [self.state, self.log]
