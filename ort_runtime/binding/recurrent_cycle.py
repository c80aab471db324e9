"""The recurrent-depth pipeline's binding (graphs/recurrent_cycles.py): one cycle per call.

The lanes' carried rows ([state, prelude output] per row) stay on the device between calls: two
buffers alternate as input and output, each direction its own IO binding (and its own captured
graph on CUDA: a captured graph bakes in its buffers' addresses). The KV buffers are the
generator's, bound as past and present: prelude slots, core slots (k, l) for every step k < R
(row k's) and coda slots.
"""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
from loopcast.ort_runtime.binding.bindings import _bind_kv, _Buffer, _KindBinding
from loopcast.ort_runtime.loading.artifact import LoadedModel

from loopcast.manifest import RECURRENT_LANE_HEADER as LANE_HEADER
from loopcast.manifest import GraphSpec
from loopcast.vocab import GraphKind


class _Direction(_KindBinding):
    """The cycle graph bound one way round: carried rows in from ``carried_in``, out to ``carried_out``."""

    def __init__(
        self, session, spec: GraphSpec, kv, model: LoadedModel, io, carried_in: _Buffer, carried_out: _Buffer
    ) -> None:
        self.spec = spec
        self._kv, self.io, self.carried_in, self.carried_out = kv, io, carried_in, carried_out
        self._open(session, model)

    def _bind(self, b: ort.IOBinding) -> None:
        io = self.io
        b.bind_ortvalue_input("lanes_N", io.lanes.value)
        b.bind_ortvalue_input("state_0_BSH", io.state_0.value)
        b.bind_ortvalue_input("carried_BW2H", self.carried_in.value)
        _bind_kv(b, self._kv, self.spec.kv_slots)
        b.bind_ortvalue_output("carried_BW2H_out", self.carried_out.value)
        b.bind_ortvalue_output("next_token_ids_BS", io.next_ids.value)
        b.bind_ortvalue_output("logits_BSV", io.logits.value)


class RecurrentCycleBinding:
    """``run(token, leaving_row, positions, state_0)``: one cycle; returns the leaving row's argmax."""

    def __init__(self, model: LoadedModel, kv: dict[int, tuple[_Buffer, _Buffer]], dtype) -> None:
        spec = model.manifest.graphs[GraphKind.RECURRENT_CYCLE]
        session = model.sessions[GraphKind.RECURRENT_CYCLE]
        cfg, device = model.config, model.device
        self.rows = R = spec.rows
        self.lanes = _Buffer((LANE_HEADER + R,), np.int32, device)
        self.state_0 = _Buffer((1, 1, cfg.hidden_size), dtype, device)
        self.next_ids = _Buffer((1, 1), np.int64, device)
        self.logits = _Buffer((1, 1, cfg.vocab_size), np.float32, device)
        carried = tuple(_Buffer((1, R, 2 * cfg.hidden_size), dtype, device) for _ in range(2))
        self.directions = (
            _Direction(session, spec, kv, model, self, carried[0], carried[1]),
            _Direction(session, spec, kv, model, self, carried[1], carried[0]),
        )
        self.turn = 0  # the direction whose input holds the last call's rows
        self._last_out = carried[1]

    def run(self, token: int, leaving_row: int, positions: list[int], state_0: np.ndarray) -> int:
        host = self.lanes.host
        host[0], host[1] = token, leaving_row
        host[LANE_HEADER:] = positions
        self.lanes.push()
        self.state_0.host[0, 0] = state_0
        self.state_0.push()
        direction = self.directions[self.turn]
        direction.execute()
        self._last_out = direction.carried_out
        self.turn ^= 1
        return int(self.next_ids.pull()[0, 0])

    def pull_states(self) -> np.ndarray:
        """A host copy of the last call's states ``[R, H]``, row k the lane that ran step k (the
        KL exit's coda checks run on them)."""
        H = self._last_out.host.shape[-1] // 2
        return self._last_out.pull()[0, :, :H].copy()

    def pull_logits(self) -> np.ndarray:
        """The last call's leaving-row logits ``[V]`` (tests, the tie guard)."""
        return self.logits.pull()[0, 0]

    def close(self) -> None:
        for direction in self.directions:
            direction.close()
