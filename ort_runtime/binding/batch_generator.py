"""A batch generator: the KV buffers, IO bindings and lengths of up to ``max_batch`` sequences.

KV slot model (docs/serving.md): every per-(loop, layer) K and V buffer is one
``[max_batch, H_kv, S_max, D]`` array; *sequence slot* b owns batch entry b of every one of them
and has its own committed length ``n_b`` (docs/architecture.md §2, per entry). Entry b is a
contiguous ``[1, H_kv, S_max, D]`` block, so

- a joining sequence is prefilled **in place**: the ordinary one-sequence prefill graph runs
  with its past/present buffers bound to entry b's block (a pointer and a shape; nothing is
  copied, and the prefill is exactly the one ``loopcast generate`` runs);
- a decode step runs the ``decode_batch`` graph over the occupied prefix ``0..w-1`` of the
  slots (w = highest occupied slot + 1; the batch dimension is symbolic), with the buffers bound
  as ``[w, ...]`` views of the same arrays. One IO binding per (kind, width), made on first use
  and reused: nothing is bound or allocated per token.
- a verify step runs ``verify_batch``: W rows per slot (the pending token and up to W-1 drafts,
  padded by repeating the last) at positions n_b..n_b+W-1, and does not commit; the caller
  commits the accepted rows with ``advance``. Rows past the accepted ones hold stale KV that the
  next step rewrites before any row reads it (the speculation invariant of
  ort_runtime/decoding/speculate.py, per entry).
- self-speculation of several sequences (ort_runtime/batching/self_round.py): ``draft`` runs one
  ``draft_batch`` row per slot at position n_b + offset_b (loops 0..d-1; the row's draft token
  and its depth-d state), ``verify_tail`` runs ``verify_tail_batch``: each slot's depth-d states
  (padded by repeating the last) through loops d..R-1 at positions n_b..n_b+W-1. Neither
  commits. Each kind binds only the KV slots of its loops.

CUDA graphs (opt-in, ``cuda_graphs=True``; loopcast-op artifacts, whose attention reads every
length on the device): each (kind, width) binding is a ``CapturedRunner``
(ort_runtime/binding/graph_runner.py) with its own ``gpu_graph_id`` on a capture session of the
kind, so ORT warms up and captures a width's graph on its first run and replays it after (the
buffers' addresses are fixed per width). If a width's first captured run fails, that width runs
eagerly from then on, with the same kernels and so the same tokens, and the kind's later widths
are made eager (``graph_fallbacks`` says why); widths already captured keep replaying (slots
never evict each other). ``close()`` (or garbage collection) gives the graph ids back.

A free slot inside the prefix runs a dummy row (id 0) at position ``keep_b`` of its own entry
(0 unless the slot was released with ``keep``): that row writes only the free entry, past the
``keep_b`` positions a prefix cache keeps there (ort_runtime/batching/prefix_cache.py), which the
next prefill there rewrites before any row reads it. ``release(b, keep)`` only sets ``n_b = 0``,
as rewind does. ``prefill(b, ids, start=k)`` continues after ``k`` positions already in entry b
(a cached prefix, kept in place or copied there by ``copy_prefix``).
"""

from __future__ import annotations

import time
from collections.abc import Mapping

import numpy as np
import onnxruntime as ort
from loopcast.ort_runtime.binding.batch_kv import BatchStepOutput, DeviceKV, bind_type, entry_ptr, slots_of
from loopcast.ort_runtime.binding.batch_slots import SlotCaps
from loopcast.ort_runtime.binding.bindings import _NP_DTYPES, _Buffer
from loopcast.ort_runtime.binding.device_move import load_device_move
from loopcast.ort_runtime.binding.graph_runner import CapturedRunner
from loopcast.ort_runtime.binding.step_clock import StepClock
from loopcast.ort_runtime.loading.artifact import LoadedModel

from loopcast.errors import ArtifactError, RequestError
from loopcast.manifest import DECODE_BATCH, DRAFT_BATCH, PREFILL, VERIFY_BATCH, VERIFY_TAIL_BATCH


class BatchGenerator:
    """Up to ``max_batch`` sequences stepped together. Not thread-safe: one thread drives it
    (ort_runtime/batching/engine.py's engine loop)."""

    caps = SlotCaps()  # prefixes reused where rows are exact (the engine's check); no options of its own

    def __init__(
        self,
        model: LoadedModel,
        max_batch: int | None = None,
        *,
        cuda_graphs: bool | str = False,
        prefill_rows: int | None = None,
    ) -> None:
        """``cuda_graphs``: capture the batched kinds per width on CUDA (loopcast-op artifacts);
        "always" also off CUDA (tests, with stand-in sessions that ignore ``gpu_graph_id``).
        ``prefill_rows``: with captured graphs, a prefill call of exactly this many tokens replays
        a graph captured per slot (``prefill_rows`` is then set; the engine sizes its prompt
        chunks to it): an uncaptured prefill is one launch per node, many decode steps' time."""
        manifest = model.manifest
        self.max_batch = slots_of(model, (PREFILL, DECODE_BATCH), DECODE_BATCH, "batched decoding", max_batch)
        cfg, device, B = model.config, model.device, self.max_batch
        self.model, self.max_length, self.vocab = model, manifest.max_length, cfg.vocab_size
        self._dtype = np.dtype(_NP_DTYPES[manifest.dtype])
        self._entry_shape = (cfg.num_kv_heads, self.max_length, manifest.kv_head_size)
        self._entry_bytes = int(np.prod(self._entry_shape)) * self._dtype.itemsize
        kv_buffer = _Buffer if device == "cpu" else DeviceKV  # on the CPU the array is the buffer
        self._kv = {
            s: (
                kv_buffer((B, *self._entry_shape), self._dtype.type, device),
                kv_buffer((B, *self._entry_shape), self._dtype.type, device),
            )
            for s in range(cfg.num_kv_slots)
        }
        lengths_device = device if manifest.device_lengths else "cpu"
        # batched kinds' inputs/outputs: fixed buffers of max_batch entries, bound as [w, ...] prefixes
        self.verify_width = manifest.graphs[VERIFY_BATCH].rows if VERIFY_BATCH in model.sessions else None
        # the self-speculation kinds' width (None: the artifact or the load has none)
        self.tail_width = (
            manifest.graphs[VERIFY_TAIL_BATCH].rows
            if VERIFY_TAIL_BATCH in model.sessions and DRAFT_BATCH in model.sessions
            else None
        )
        self._seqlens = _Buffer((B,), np.int32, device)
        self._total = _Buffer((), np.int32, lengths_device)
        H = cfg.hidden_size
        # per kind: (input: ids [B, rows] or hidden [B, rows, H], next ids, logits, hidden out or None)
        self._io = {
            kind: (
                _Buffer((B, rows, H), self._dtype.type, device)
                if kind == VERIFY_TAIL_BATCH
                else _Buffer((B, rows), np.int64, device),
                _Buffer((B, rows), np.int64, device),
                _Buffer((B, rows, self.vocab), np.float32, device),
                _Buffer((B, rows, H), self._dtype.type, device) if kind == DRAFT_BATCH else None,
            )
            for kind, rows in (
                (DECODE_BATCH, 1),
                (VERIFY_BATCH, self.verify_width),
                (DRAFT_BATCH, 1 if self.tail_width else None),
                (VERIFY_TAIL_BATCH, self.tail_width),
            )
            if rows
        }
        self._kv_slots = {kind: manifest.graphs[kind].kv_slots for kind in self._io}
        # prefill of one slot: its own small buffers
        self._p_seqlens = _Buffer((1,), np.int32, device)
        self._p_total = _Buffer((), np.int32, lengths_device)
        self._p_next = _Buffer((1, 1), np.int64, device)
        self._p_logits = _Buffer((1, 1, self.vocab), np.float32, device)
        self._runners: dict[tuple[str, int], CapturedRunner] = {}  # (kind, width) -> its runner
        self._sessions = {kind: model.sessions[kind] for kind in self._io}
        self.captured: set[str] = set()  # kinds whose widths are made as captured CUDA graphs
        self.graph_fallbacks: dict[str, str] = {}
        self._closed = False
        if cuda_graphs == "always" or (cuda_graphs and device == "cuda" and manifest.device_lengths):
            for kind in self._io:
                session = model.capture_session(kind)
                if session is not None:
                    self._sessions[kind] = session
                    self.captured.add(kind)
                else:
                    self.graph_fallbacks[kind] = model.graph_fallbacks.get(kind, "no capture session")
        # captured prefill calls of a fixed row count, one graph per slot (its KV entry)
        self.prefill_rows: int | None = None
        self._prefill_runners: dict[int, CapturedRunner] = {}
        if prefill_rows is not None and not 1 <= prefill_rows <= self.max_length:
            raise RequestError(f"prefill_rows must be in 1..{self.max_length}, got {prefill_rows}")
        if prefill_rows and self.captured:
            self._p_session = model.capture_session(PREFILL)
            if self._p_session is None:
                self.graph_fallbacks[PREFILL] = model.graph_fallbacks.get(PREFILL, "no capture session")
            else:
                self.prefill_rows = prefill_rows
                self._p_ids = _Buffer((1, prefill_rows), np.int64, device)
        self._move = None  # CUDA: the op library's device KV copy (copy_prefix), loaded on first use
        self.lengths = [0] * B  # n_b: tokens whose KV is committed in slot b
        self._keep = [0] * B  # free slot b: its dummy rows write at positions keep_b..
        # pipeline lanes in flight past n_b (ort_runtime/batching/pipeline_lanes.py): the slot's
        # dummy rows write past them, at n_b + held_b..
        self._held = [0] * B
        self.clock = StepClock()
        self.rows_run = 0  # decode rows computed, occupied or not

    # -- binding helpers -------------------------------------------------------------------
    def _bind_kv(self, binding: ort.IOBinding, first: int, count: int, kv_slots=None) -> None:
        device = self.model.device
        shape = [count, *self._entry_shape]
        for slot, (key, value) in self._kv.items():
            if kv_slots is not None and slot not in kv_slots:
                continue
            for name, buf in ((f"key.{slot}", key), (f"value.{slot}", value)):
                ptr = entry_ptr(buf, first * self._entry_bytes)
                binding.bind_input(f"past_{name}", device, 0, bind_type(self._dtype), shape, ptr)
                binding.bind_output(f"present_{name}", device, 0, bind_type(self._dtype), shape, ptr)

    @staticmethod
    def _bind_prefix(binding: ort.IOBinding, name: str, buf: _Buffer, shape: list[int], output: bool) -> None:
        bind = binding.bind_output if output else binding.bind_input
        bind(name, buf.device, 0, bind_type(buf.host.dtype), shape, entry_ptr(buf))

    def _bind_step(self, kind: str, width: int, binding) -> None:
        """A batched kind over the occupied prefix 0..width-1 of every buffer."""
        inputs, next_ids, logits, hidden_out = self._io[kind]
        rows = inputs.host.shape[1]
        if kind == VERIFY_TAIL_BATCH:
            self._bind_prefix(binding, "hidden_BSH", inputs, [width, *inputs.host.shape[1:]], False)
        else:
            self._bind_prefix(binding, "input_ids_BS", inputs, [width, rows], False)
        self._bind_prefix(binding, "seqlens_k", self._seqlens, [width], False)
        self._bind_prefix(binding, "total_sequence_length", self._total, [], False)
        self._bind_kv(binding, 0, width, self._kv_slots[kind])
        self._bind_prefix(binding, "next_token_ids_BS", next_ids, [width, rows], True)
        self._bind_prefix(binding, "logits_BSV", logits, [width, rows, self.vocab], True)
        if hidden_out is not None:
            shape = [width, *hidden_out.host.shape[1:]]
            self._bind_prefix(binding, "hidden_BSH_out", hidden_out, shape, True)

    def _runner(self, kind: str, width: int) -> CapturedRunner:
        runner = self._runners.get((kind, width))
        if runner is None:
            model, captured = self.model, kind in self.captured
            # a captured graph bakes in this width's shapes and addresses: one graph id per width
            runner = self._runners[(kind, width)] = CapturedRunner(
                kind,
                self._sessions[kind] if captured else model.sessions[kind],
                lambda binding: self._bind_step(kind, width, binding),
                pool=model.graph_ids(kind) if captured else None,
                eager_session=lambda: model.sessions[kind],
            )
        return runner

    def _run(self, kind: str, width: int) -> bool:
        runner = self._runner(kind, width)
        steady = runner.run()
        failure = runner.slot.failure if runner.slot is not None else None
        if failure is not None and kind in self.captured:  # the kind's later widths run eagerly
            self.graph_fallbacks[kind] = failure
            self.captured.discard(kind)
        return steady

    @property
    def graph_runs(self) -> dict[tuple[str, int], int]:
        """(kind, width) -> runs of its binding."""
        return {key: runner.runs for key, runner in self._runners.items()}

    def close(self) -> None:
        """Give every binding's graph id back to its pool; the generator cannot step after."""
        for runner in [*self._runners.values(), *self._prefill_runners.values()]:
            runner.close()
        self._runners.clear()
        self._prefill_runners.clear()
        self.captured.clear()
        self._closed = True

    # -- steps -----------------------------------------------------------------------------
    def prefill(
        self, slot: int, ids: list[int], *, start: int = 0, want_logits: bool = False
    ) -> tuple[int, np.ndarray | None]:
        """Write ``ids`` at positions start.. of ``slot`` (a fresh sequence whose first ``start``
        positions already hold its prefix's KV), commit them and return the next token (and its
        logits row when asked)."""
        if not 0 <= slot < self.max_batch:
            raise RequestError(f"slot {slot} outside 0..{self.max_batch - 1}")
        if not ids:
            raise RequestError("prompt is empty: give at least one token")
        bad = [t for t in ids if not 0 <= int(t) < self.vocab]
        if bad:
            raise RequestError(f"token id {bad[0]} is outside the vocabulary [0, {self.vocab})")
        if start < 0 or start + len(ids) > self.max_length:
            raise RequestError(
                f"prompt of {start} + {len(ids)} tokens is longer than the max length {self.max_length}"
            )
        self._p_seqlens.host[0] = start + len(ids) - 1
        self._p_seqlens.push()
        self._p_total.host[...] = start + len(ids)
        self._p_total.push()
        t0 = time.perf_counter()
        steady = False
        if len(ids) == self.prefill_rows:
            self._p_ids.host[0] = ids
            self._p_ids.push()
            steady = self._prefill_run(slot)
        else:
            binding = self.model.sessions[PREFILL].io_binding()
            binding.bind_cpu_input("input_ids_BS", np.asarray([ids], dtype=np.int64))
            self._bind_prefill(binding, slot)
            self.model.sessions[PREFILL].run_with_iobinding(binding)
        self.clock.record(PREFILL, time.perf_counter() - t0, steady=steady)
        self.lengths[slot], self._keep[slot] = start + len(ids), 0
        logits = self._p_logits.pull()[0, 0].copy() if want_logits else None
        return int(self._p_next.pull()[0, 0]), logits

    def _bind_prefill(self, binding, slot: int) -> None:
        """A prefill call's lengths, slot ``slot``'s KV entry and the outputs (not the ids)."""
        self._bind_prefix(binding, "seqlens_k", self._p_seqlens, [1], False)
        self._bind_prefix(binding, "total_sequence_length", self._p_total, [], False)
        self._bind_kv(binding, slot, 1)
        self._bind_prefix(binding, "next_token_ids_BS", self._p_next, [1, 1], True)
        self._bind_prefix(binding, "logits_BSV", self._p_logits, [1, 1, self.vocab], True)

    def _prefill_run(self, slot: int) -> bool:
        """The captured prefill of ``prefill_rows`` ids (in ``_p_ids``) into ``slot``; after a
        failed capture, prefill calls go back to their exact lengths (``prefill_rows = None``)."""
        runner = self._prefill_runners.get(slot)
        if runner is None:
            model, rows = self.model, self.prefill_rows

            def bind(binding) -> None:
                self._bind_prefix(binding, "input_ids_BS", self._p_ids, [1, rows], False)
                self._bind_prefill(binding, slot)

            runner = self._prefill_runners[slot] = CapturedRunner(
                PREFILL,
                self._p_session,
                bind,
                pool=model.graph_ids(PREFILL),
                eager_session=lambda: model.sessions[PREFILL],
            )
        steady = runner.run()
        if runner.slot is not None and runner.slot.failure is not None:
            self.graph_fallbacks[PREFILL] = runner.slot.failure
            self.prefill_rows = None
        return steady

    def decode(self, tokens: dict[int, int], *, want_logits: bool = False) -> BatchStepOutput:
        """One row per slot in ``tokens`` (slot -> its pending token, written at position n_b);
        commits each and returns each slot's next token."""
        out, logits, _ = self._step(DECODE_BATCH, {s: [t] for s, t in tokens.items()}, want_logits)
        for slot in tokens:
            self.lengths[slot] += 1
        return BatchStepOutput(
            {s: ids[0] for s, ids in out.items()},
            {s: rows[0] for s, rows in logits.items()} if logits is not None else None,
        )

    def verify(
        self, rows: dict[int, list[int]], *, want_logits: bool = False
    ) -> tuple[dict[int, list[int]], dict[int, np.ndarray] | None]:
        """W rows per slot (slot -> pending token + drafts, 1..W ids) at positions n_b..; returns each
        slot's argmax per given row (and [rows, V] logits when asked). Commits nothing: ``advance``."""
        if self.verify_width is None:
            raise RequestError(
                "this artifact has no verify_batch graph (export with --max-batch and a verify width)"
            )
        for _slot, ids in rows.items():
            if not 1 <= len(ids) <= self.verify_width:
                raise RequestError(f"verify takes 1..{self.verify_width} rows per sequence, got {len(ids)}")
        out, logits, _ = self._step(VERIFY_BATCH, rows, want_logits)
        return out, logits

    def draft(
        self, tokens: dict[int, int], offsets: dict[int, int], *, want_logits: bool = False
    ) -> BatchStepOutput:
        """One ``draft_batch`` row per slot (slot -> token, written at position n_b + offsets[slot]
        in loops 0..d-1): each slot's draft token, its depth-d state (and logits when asked).
        Commits nothing."""
        self._need_tail()
        out, logits, hidden = self._step(
            DRAFT_BATCH, {s: [t] for s, t in tokens.items()}, want_logits, offsets=offsets
        )
        return BatchStepOutput(
            {s: ids[0] for s, ids in out.items()},
            {s: rows[0] for s, rows in logits.items()} if logits is not None else None,
            {s: rows[0] for s, rows in hidden.items()},
        )

    def verify_tail(
        self, hidden: dict[int, np.ndarray], *, want_logits: bool = False
    ) -> tuple[dict[int, list[int]], dict[int, np.ndarray] | None]:
        """``verify_tail_batch``: slot -> its [rows, H] depth-d states (the pending row and its
        drafts, 1..W rows) at positions n_b.. through loops d..R-1; each slot's argmax per given row
        (and logits when asked). Commits nothing: ``advance``."""
        self._need_tail()
        for states in hidden.values():
            if not 1 <= len(states) <= self.tail_width:
                raise RequestError(
                    f"verify_tail takes 1..{self.tail_width} rows per sequence, got {len(states)}"
                )
        out, logits, _ = self._step(VERIFY_TAIL_BATCH, hidden, want_logits)
        return out, logits

    def _need_tail(self) -> None:
        if self.tail_width is None:
            raise RequestError(
                "this artifact has no draft_batch/verify_tail_batch graphs (export with --max-batch, "
                "a verify width and a draft depth, from a looped model)"
            )

    def advance(self, slot: int, count: int) -> None:
        """Commit the first ``count`` rows of ``slot``'s last verify (or verify_tail) step."""
        most = max(self.verify_width or 1, self.tail_width or 1)
        if not 0 <= count <= most or self.lengths[slot] + count > self.max_length:
            raise RequestError(f"cannot commit {count} rows on slot {slot} at length {self.lengths[slot]}")
        self.lengths[slot] += count

    def _step(self, kind: str, rows: dict, want_logits: bool, offsets: dict[int, int] | None = None):
        """``rows``: slot -> token ids (or, for verify_tail_batch, [rows, H] states); ``offsets``:
        slot -> its rows' first position past n_b (draft rows). Returns (argmax per given row,
        logits rows when asked, hidden rows of draft_batch)."""
        if self._closed:
            raise RequestError("this batch generator was closed; make a new one")
        if not rows:
            raise RequestError("a step needs at least one sequence")
        in_buf, next_buf, logits_buf, hidden_buf = self._io[kind]
        width_rows = in_buf.host.shape[1]
        offsets = offsets or {}
        for slot, ids in rows.items():
            if not 0 <= slot < self.max_batch:
                raise RequestError(f"slot {slot} outside 0..{self.max_batch - 1}")
            at = self.lengths[slot] + offsets.get(slot, 0)
            if self.lengths[slot] < 1 or at + width_rows > self.max_length:
                raise RequestError(
                    f"slot {slot} has {self.lengths[slot]} committed tokens; a {kind} step needs a "
                    f"prefilled sequence with room for {width_rows} more at position {at} (max length "
                    f"{self.max_length})"
                )
            if kind != VERIFY_TAIL_BATCH:
                bad = [t for t in ids if not 0 <= int(t) < self.vocab]
                if bad:
                    raise RequestError(f"token id {bad[0]} is outside the vocabulary [0, {self.vocab})")
        width = max(rows) + 1
        inputs, seqlens = in_buf.host, self._seqlens.host
        self._idle_rows(kind, width)
        for slot, given in rows.items():
            inputs[slot, : len(given)] = given
            inputs[slot, len(given) :] = given[-1]  # padding rows repeat the last (as verify does)
            seqlens[slot] = self.lengths[slot] + offsets.get(slot, 0) + width_rows - 1
        self._total.host[...] = int(seqlens[:width].max()) + 1
        for buf in (in_buf, self._seqlens, self._total):
            buf.push()
        t0 = time.perf_counter()
        steady = self._run(kind, width)
        self.clock.record(kind, time.perf_counter() - t0, steady=steady)
        self.rows_run += width * width_rows
        next_ids = next_buf.pull()[:width]
        logits = logits_buf.pull() if want_logits else None
        hidden = hidden_buf.pull() if hidden_buf is not None else None
        out = {s: [int(t) for t in next_ids[s, : len(given)]] for s, given in rows.items()}
        return (
            out,
            {s: logits[s, : len(given)].copy() for s, given in rows.items()} if logits is not None else None,
            {s: hidden[s, : len(given)].copy() for s, given in rows.items()} if hidden is not None else None,
        )

    def _idle_rows(self, kind: str, width: int) -> None:
        """Dummy rows for slots 0..width-1 of ``kind``'s call (a step then fills its own rows):
        slots in the prefix without rows (free, or a prompt being prefilled) run id 0 at
        positions max(n_b + held_b, keep_b).. of their own entry, past every position that holds KV."""
        in_buf = self._io[kind][0]
        width_rows = in_buf.host.shape[1]
        in_buf.host[:width] = 0
        idle = np.maximum(np.add(self.lengths[:width], self._held[:width]), self._keep[:width])
        self._seqlens.host[:width] = np.minimum(idle, self.max_length - width_rows) + width_rows - 1

    def warm_up(self, kinds: tuple[str, ...] | None = None) -> int:
        """Run each width 1..max_batch of the captured ``kinds`` (default: every captured kind,
        and the captured prefill on every empty slot) once with dummy rows only, so that their
        CUDA graphs are captured now rather than inside a request's step (a width's first
        captured run is warm-up plus capture: many steps' time, a latency spike for every request
        in the batch). Dummy rows write only past what each slot holds, as a step's free slots
        do, and nothing is committed, so it can run between any two steps. These runs stay out
        of the step clock. On the CPU it also writes every idle slot's KV entries (below).
        Returns the runs made."""
        made = 0
        if kinds is None and self.model.device == "cpu":
            self._fault_in_idle_kv()
        for kind in kinds if kinds is not None else sorted(self.captured):
            if kind not in self.captured:
                continue
            for width in range(1, self.max_batch + 1):
                if (kind, width) in self._runners:
                    continue  # already ran: captured, or eager after a failed capture
                self._idle_rows(kind, width)
                self._total.host[...] = int(self._seqlens.host[:width].max()) + 1
                for buf in (self._io[kind][0], self._seqlens, self._total):
                    buf.push()
                self._run(kind, width)
                made += 1
        # the captured prefill's graph per slot, on slots that hold nothing (its rows write
        # positions 0..prefill_rows-1, which a slot's first prefill rewrites before any row reads)
        for slot in range(self.max_batch) if self.prefill_rows and kinds is None else ():
            if slot in self._prefill_runners or self.lengths[slot] or self._keep[slot] or self._held[slot]:
                continue
            self._p_ids.host[...] = 0
            self._p_seqlens.host[0], self._p_total.host[...] = self.prefill_rows - 1, self.prefill_rows
            for buf in (self._p_ids, self._p_seqlens, self._p_total):
                buf.push()
            self._prefill_run(slot)
            made += 1
        return made

    def _fault_in_idle_kv(self) -> None:
        """Write zeros over the KV entries of the slots that hold nothing. The arrays come from
        np.zeros, whose pages the OS maps on first write, and a slot's first prefill paid for
        its whole entry's: 160-180 ms per slot for the demo at 1024 positions on the CPU VM,
        16 times a prefill's cost, a stall on every running request's next token. An idle slot's
        entries hold nothing a row reads (its next prefill writes before any row reads)."""
        for slot in range(self.max_batch):
            if self.lengths[slot] or self._keep[slot] or self._held[slot]:
                continue
            for key, value in self._kv.values():
                key.host[slot].fill(0)
                value.host[slot].fill(0)

    def release(self, slot: int, keep: int = 0) -> int:
        """Free ``slot``: only its length is reset (its KV is rewritten by the next prefill). Its
        first ``keep`` positions are left untouched until the next prefill there (dummy rows write
        past them); returns the positions kept, ``keep`` capped so that any step's dummy rows fit."""
        rows = max(self.verify_width or 1, self.tail_width or 1)
        self.lengths[slot], self._held[slot] = 0, 0
        self._keep[slot] = max(0, min(keep, self.max_length - rows))
        return self._keep[slot]

    def check_options(self, options: Mapping[str, object]) -> None:
        """Nothing to refuse: every option this generator's requests set is the engine's."""

    def prefills_whole(self, slot: int) -> bool:
        """A prompt may be prefilled in chunks (where rows are exact: the engine's choice)."""
        return False

    def depth_stats(self, slot: int, emitted: int) -> dict:
        """No per-request depth: every token runs every loop."""
        return {}

    def begin(self, slot: int, start: int = 0, options: Mapping[str, object] | None = None) -> None:
        """``slot`` starts a sequence whose first ``start`` positions already hold its prefix's KV
        (kept there or copied by ``copy_prefix``): n_b = start; ``prefill(start=...)`` continues it.
        ``options``: the request's options of ``caps.request_options`` (none: it has no options)."""
        if not 0 <= start < self.max_length:
            raise RequestError(f"begin: {start} cached positions outside the KV capacity {self.max_length}")
        self.lengths[slot], self._keep[slot], self._held[slot] = start, 0, 0

    def hold(self, slot: int, count: int) -> None:
        """Positions n_b..n_b+count-1 of ``slot`` hold KV of pipeline lanes in flight (not
        committed yet): the slot's dummy rows in steps it has no row in write past them. The
        caller keeps n_b + count + the widest step's rows within the KV capacity."""
        if count < 0 or self.lengths[slot] + count > self.max_length:
            raise RequestError(f"hold: {count} positions past length {self.lengths[slot]} of slot {slot}")
        self._held[slot] = count

    def copy_prefix(self, src: int, dst: int, count: int) -> None:
        """Copy positions 0..count-1 of sequence slot ``src`` into ``dst`` in every KV slot (K and
        V): a cached prefix into a joining sequence's entry. 2 · slots · H_kv · count · D values, a
        host memcpy on the CPU; on CUDA the op library's device copy, one call per (buffer, head)
        (ort_runtime/binding/device_move.py). The rows are copied as they are: the copy is exact."""
        if not (0 <= src < self.max_batch and 0 <= dst < self.max_batch) or src == dst:
            raise RequestError(
                f"copy_prefix: slots {src} -> {dst} must differ and lie in 0..{self.max_batch - 1}"
            )
        if not 0 <= count <= self.max_length:
            raise RequestError(f"copy_prefix: {count} positions outside the KV capacity {self.max_length}")
        if self.model.device == "cpu":
            for key, value in self._kv.values():
                for buf in (key, value):
                    buf.host[dst, :, :count] = buf.host[src, :, :count]
            return
        if self._move is None:
            self._move = load_device_move(self.model)
        H, S, _ = self._entry_shape
        row_bytes = self._entry_bytes // (H * S)
        # the buffer as one plane of B·H·S positions: entry b, head h starts at (b·H + h)·S
        capacity = self.max_batch * H * S
        for key, value in self._kv.values():
            for buf in (key, value):
                ptr = buf.value.dataentry_ptr()
                for h in range(H):
                    first, to = (src * H + h) * S, (dst * H + h) * S
                    code = self._move(ptr, 1, capacity, row_bytes, first, to, count, None)
                    if code:
                        raise ArtifactError(
                            f"copying KV rows on {self.model.device} failed (CUDA error {code})"
                        )

    def kv_arrays(self, kv_slot: int, slot: int) -> tuple[np.ndarray, np.ndarray]:
        """Host copies of one sequence slot's K and V ``[1, H_kv, S_max, D]`` in one KV slot (checks)."""
        key, value = self._kv[kv_slot]
        return key.pull()[slot : slot + 1].copy(), value.pull()[slot : slot + 1].copy()
