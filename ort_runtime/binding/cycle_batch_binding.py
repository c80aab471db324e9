"""The batched pipeline cycle's binding (graphs/batched_cycle.py): one IO binding over every
sequence slot of a BatchGenerator's KV buffers, bound in place (past = present), and fixed input
and output buffers of the graph's W = R·P rows. Row r·P + b is sequence slot b's lane at depth r
(``row``); the host fills the rows' addresses, the entering tokens and the carried states, runs
the call and reads each row's argmax and normed state. On CUDA with captured graphs the one
width is captured like the other batched kinds (its buffers' addresses are fixed)."""

from __future__ import annotations

import time

import numpy as np
from loopcast.ort_runtime.binding.bindings import _Buffer
from loopcast.ort_runtime.binding.graph_runner import CapturedRunner

from loopcast.errors import ArtifactError
from loopcast.manifest import CYCLE_BATCH


class CycleBatch:
    """``gen``: the BatchGenerator whose KV buffers (and lengths) the rows address."""

    def __init__(self, gen) -> None:
        model = gen.model
        if CYCLE_BATCH not in model.sessions:
            raise ArtifactError(
                f"{model.path}: the batched pipeline needs the cycle_batch graph (export with --max-batch, "
                "a looped model without prelude or coda, the loopcast attention op)"
            )
        spec, cfg, device = model.manifest.graphs[CYCLE_BATCH], model.config, model.device
        self.gen, self.loops, self.rows = gen, cfg.num_loops, spec.rows
        self.lanes = spec.rows // cfg.num_loops  # P: one lane per depth per sequence slot
        P, W, H, dtype = self.lanes, self.rows, cfg.hidden_size, gen._dtype.type
        self.tokens = _Buffer((1, P), np.int64, device)
        self.carried = _Buffer((1, W - P, H), dtype, device)
        self.address = _Buffer((W, 2), np.int32, device)
        self.next_ids = _Buffer((1, W), np.int64, device)
        self.logits = _Buffer((1, W, cfg.vocab_size), np.float32, device)
        self.hidden = _Buffer((1, W, H), dtype, device)
        self._slots = spec.kv_slots
        captured = gen.captured and model.capture_session(CYCLE_BATCH)
        session = captured or model.sessions[CYCLE_BATCH]
        self.runner = CapturedRunner(
            CYCLE_BATCH,
            session,
            self._bind,
            pool=model.graph_ids(CYCLE_BATCH) if captured else None,
            eager_session=lambda: model.sessions[CYCLE_BATCH],
        )

    def _bind(self, binding) -> None:
        gen = self.gen
        for name, buf in (
            ("input_ids_BS", self.tokens),
            ("carried_BWH", self.carried),
            ("row_address_W2", self.address),
        ):
            gen._bind_prefix(binding, name, buf, list(buf.host.shape), False)
        gen._bind_kv(binding, 0, gen.max_batch, self._slots)
        for name, buf in (
            ("next_token_ids_BS", self.next_ids),
            ("logits_BSV", self.logits),
            ("hidden_BWH_out", self.hidden),
        ):
            gen._bind_prefix(binding, name, buf, list(buf.host.shape), True)

    def row(self, depth: int, slot: int) -> int:
        return depth * self.lanes + slot

    def run(self, rows: dict[tuple[int, int], tuple[int, int | np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
        """``rows``: (depth, slot) -> (position, entering token at depth 0 / carried state
        after it). Returns every row's argmax [W] and normed state [W, H] (host copies)."""
        P = self.lanes
        address, tokens, carried = self.address.host, self.tokens.host, self.carried.host
        address[:, 0], address[:, 1] = 0, -1  # unused rows: no position, write nothing
        tokens[...] = 0
        for (depth, slot), (position, given) in rows.items():
            i = self.row(depth, slot)
            address[i] = (slot, position)
            if depth == 0:
                tokens[0, slot] = int(given)
            else:
                carried[0, i - P] = given
        for buf in (self.address, self.tokens, self.carried):
            buf.push()
        t0 = time.perf_counter()
        steady = self.runner.run()
        self.gen.clock.record(CYCLE_BATCH, time.perf_counter() - t0, steady=steady)
        self.gen.rows_run += self.rows
        return self.next_ids.pull()[0].copy(), self.hidden.pull()[0].copy()

    def close(self) -> None:
        self.runner.close()
