"""One generator's bindings of the loop-skipping kinds (graphs/loop_steps.py): a row's loops run
one call at a time, so the exit gate can stop a token after its exit loop.

    embed(token)      loop_embed          → state[0]
    loop(r)           loop_step, binding r: state[r % 2] → state[(r+1) % 2], gate r;
                      KV slots r*L + l bound to the graph's loop-0 names (as past and present)
    head(r)           exit_head on state[(r+1) % 2] (the state after loop r) → the argmax

Every buffer is allocated and bound once (docs/architecture.md §5): two state buffers used in
turn, one gate buffer per loop, the lengths shared by every loop's binding. All loops run on
the one loop_step session (one copy of the core's weights for every loop).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import onnxruntime as ort
from loopcast.ort_runtime.binding.bindings import _bind_kv, _Buffer
from loopcast.ort_runtime.loading.artifact import LoadedModel

from loopcast.vocab import GraphKind

LOOP_EMBED, LOOP_STEP, EXIT_HEAD = GraphKind.LOOP_EMBED, GraphKind.LOOP_STEP, GraphKind.EXIT_HEAD


class _Run:
    """A session and one IO binding of it (the generator's step clock times ``execute``)."""

    def __init__(self, session: ort.InferenceSession, bind: Callable[[ort.IOBinding], None]) -> None:
        self.session, self.binding = session, session.io_binding()
        bind(self.binding)

    def execute(self, model: LoadedModel | None = None) -> bool:
        self.session.run_with_iobinding(self.binding)
        return True


class LoopSteps:
    """The loop-skipping path of one sequence: its KV buffers are the generator's."""

    def __init__(
        self,
        model: LoadedModel,
        kv: dict[int, tuple[_Buffer, _Buffer]],
        dtype,
        execute: Callable[[str, _Run], None],
    ) -> None:
        cfg, device = model.config, model.device
        self._execute = execute
        self.num_loops = R = cfg.num_loops
        hidden = (1, 1, cfg.hidden_size)
        self.states = (_Buffer(hidden, dtype, device), _Buffer(hidden, dtype, device))
        self.ids = _Buffer((1, 1), np.int64, device)
        self.seqlens = _Buffer((1,), np.int32, device)
        self.total = _Buffer((), np.int32, device if model.manifest.device_lengths else "cpu")
        self.gates = [_Buffer((1, 1), np.float32, device) for _ in range(R)]
        self.next_ids = _Buffer((1, 1), np.int64, device)
        self.logits = _Buffer((1, 1, cfg.vocab_size), np.float32, device)

        def bind_embed(b: ort.IOBinding) -> None:
            b.bind_ortvalue_input("input_ids_BS", self.ids.value)
            b.bind_ortvalue_output("embedded_BSH", self.states[0].value)

        def bind_loop(r: int) -> Callable[[ort.IOBinding], None]:
            def bind(b: ort.IOBinding) -> None:
                b.bind_ortvalue_input("hidden_BSH", self.states[r % 2].value)
                b.bind_ortvalue_input("seqlens_k", self.seqlens.value)
                b.bind_ortvalue_input("total_sequence_length", self.total.value)
                # loop r's buffers under loop 0's names
                _bind_kv(
                    b,
                    {cfg.core_slot(0, l): kv[cfg.core_slot(r, l)] for l in range(cfg.num_layers)},
                    [cfg.core_slot(0, l) for l in range(cfg.num_layers)],
                )
                b.bind_ortvalue_output("hidden_BSH_out", self.states[(r + 1) % 2].value)
                b.bind_ortvalue_output("exit_gates_BR", self.gates[r].value)

            return bind

        def bind_head(i: int) -> Callable[[ort.IOBinding], None]:
            def bind(b: ort.IOBinding) -> None:
                b.bind_ortvalue_input("hidden_BSH", self.states[i].value)
                b.bind_ortvalue_output("next_token_ids_BS", self.next_ids.value)
                b.bind_ortvalue_output("logits_BSV", self.logits.value)

            return bind

        sessions = model.sessions
        self._embed = _Run(sessions[LOOP_EMBED], bind_embed)
        self._loops = [_Run(sessions[LOOP_STEP], bind_loop(r)) for r in range(R)]
        self._heads = [_Run(sessions[EXIT_HEAD], bind_head(i)) for i in range(2)]

    def embed(self, token: int, position: int) -> None:
        """Start a row at ``position``: its token's embedding into the first state buffer."""
        self.ids.host[0, 0] = token
        self.ids.push()
        self.seqlens.host[0] = position
        self.seqlens.push()
        self.total.host[...] = position + 1
        self.total.push()
        self._execute(LOOP_EMBED, self._embed)

    def loop(self, r: int) -> float:
        """Loop r of the row (writes loop r's KV at its position); returns its exit-gate logit."""
        self._execute(LOOP_STEP, self._loops[r])
        return float(self.gates[r].pull()[0, 0])

    def head(self, r: int) -> int:
        """The argmax of the head on the state after loop r (the last loop run, or the one before
        it: the two state buffers hold the last two loops' states)."""
        self._execute(EXIT_HEAD, self._heads[(r + 1) % 2])
        return int(self.next_ids.pull()[0, 0])
