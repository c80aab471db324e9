"""The batched pipeline cycle's binding (graphs/batched_cycle.py): IO bindings over every
sequence slot of a BatchGenerator's KV buffers, bound in place (past = present), and input and
output buffers of the graph's most rows, R·max_batch. Row slot·R + depth is sequence slot
``slot``'s lane at ``depth`` (``row``); a call over the occupied slots 0..w-1 binds the first
w·R rows (one binding per width, made on first use; on CUDA with captured graphs, each width is
captured like the other batched kinds: its shapes and addresses are fixed). The host fills the
rows' addresses, the entering tokens and the carried states, runs the call and reads each row's
argmax and normed state."""

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
        W, H, dtype = self.rows, cfg.hidden_size, gen._dtype.type
        self.tokens = _Buffer((1, W), np.int64, device)
        self.carried = _Buffer((1, W, H), dtype, device)
        self.address = _Buffer((W, 2), np.int32, device)
        self.next_ids = _Buffer((1, W), np.int64, device)
        self.logits = _Buffer((1, W, cfg.vocab_size), np.float32, device)
        self.hidden = _Buffer((1, W, H), dtype, device)
        self._slots = spec.kv_slots
        self._captured = gen.captured and model.capture_session(CYCLE_BATCH)
        self._runners: dict[int, CapturedRunner] = {}

    @property
    def captured(self) -> bool:
        """Whether the widths run as captured CUDA graphs (a capture session was made)."""
        return bool(self._captured)

    def _runner(self, width: int) -> CapturedRunner:
        runner = self._runners.get(width)
        if runner is None:
            model, captured = self.gen.model, self._captured
            runner = self._runners[width] = CapturedRunner(
                CYCLE_BATCH,
                captured or model.sessions[CYCLE_BATCH],
                lambda binding: self._bind(binding, width * self.loops),
                pool=model.graph_ids(CYCLE_BATCH) if captured else None,
                eager_session=lambda: model.sessions[CYCLE_BATCH],
            )
        return runner

    def _bind(self, binding, n: int) -> None:
        gen, H = self.gen, self.carried.host.shape[2]
        for name, buf, shape in (
            ("input_ids_BS", self.tokens, [1, n]),
            ("carried_BWH", self.carried, [1, n, H]),
            ("row_address_W2", self.address, [n, 2]),
        ):
            gen._bind_prefix(binding, name, buf, shape, False)
        gen._bind_kv(binding, 0, gen.max_batch, self._slots)
        for name, buf, shape in (
            ("next_token_ids_BS", self.next_ids, [1, n]),
            ("logits_BSV", self.logits, [1, n, self.logits.host.shape[2]]),
            ("hidden_BWH_out", self.hidden, [1, n, H]),
        ):
            gen._bind_prefix(binding, name, buf, shape, True)

    def row(self, depth: int, slot: int) -> int:
        return slot * self.loops + depth

    def run(
        self, rows: dict[tuple[int, int], tuple[int, int | np.ndarray]], width: int | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """``rows``: (depth, slot) -> (position, entering token at depth 0 / carried state
        after it), over slots below ``width`` (default: the highest slot named, plus one).
        Returns the call's rows' argmax [w·R] and normed states [w·R, H] (host copies)."""
        width = width or max(slot for _, slot in rows) + 1
        if not 1 <= width <= self.lanes:
            raise ValueError(f"cycle_batch width {width} is not in 1..{self.lanes}")
        n = width * self.loops
        address, tokens, carried = self.address.host, self.tokens.host, self.carried.host
        self._unused_rows(n)
        for (depth, slot), (position, given) in rows.items():
            i = self.row(depth, slot)
            if i >= n:
                raise ValueError(f"slot {slot} is outside the call's width {width}")
            address[i] = (slot, position)
            if depth == 0:
                tokens[0, i] = int(given)
            else:
                carried[0, i] = given
        for buf in (self.address, self.tokens, self.carried):
            buf.push()
        t0 = time.perf_counter()
        steady = self._runner(width).run()
        self.gen.clock.record(CYCLE_BATCH, time.perf_counter() - t0, steady=steady)
        self.gen.rows_run += n
        return self.next_ids.pull()[0, :n].copy(), self.hidden.pull()[0, :n].copy()

    def _unused_rows(self, n: int) -> None:
        self.address.host[:n, 0], self.address.host[:n, 1] = 0, -1  # no position: write nothing
        self.tokens.host[0, :n] = 0

    def warm_up(self) -> int:
        """Capture every width's graph now (captured kinds only; BatchGenerator.warm_up says why):
        one call per width with every row unused, which reads and writes no KV. Returns the runs."""
        made = 0
        # widths past the generator's slots never run (the graph may hold more: its --max-batch)
        for width in range(1, min(self.lanes, self.gen.max_batch) + 1) if self._captured else ():
            if width not in self._runners:
                self._unused_rows(width * self.loops)
                for buf in (self.address, self.tokens, self.carried):
                    buf.push()
                self._runner(width).run()
                made += 1
        return made

    def close(self) -> None:
        for runner in self._runners.values():
            runner.close()
