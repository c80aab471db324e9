"""A batch of recurrent-depth (Huginn) sequences: their KV slots, lengths and per-request depth.

The batching engine's slots (ort_runtime/binding/batch_slots.py) over a recurrent-depth
artifact exported with ``--max-batch``. Every (step, layer) KV buffer, and the prelude's and
coda's, is one ``[max_batch, H_kv, S_max, D]`` array; sequence slot b owns batch entry b of each
(docs/serving.md), as in ort_runtime/binding/batch_generator.py. A decode step over the occupied
prefix 0..w-1 of the slots is

    prelude_batch(ids)                         → e           (a row per slot, at its own n_b)
    s_0 = initial_state(seed_b, n_b)           per row (loopcast/recurrent_state.py)
    core_step_batch k = 0..max_b r_b - 1       (s_k, e, active_B = [k < r_b]) → s_k+1
    coda_batch(s)                              → each row's argmax and logits

Each request keeps its own r (``loops``) and initial-state seed (``state_seed``), given at
``begin``: a row whose request runs fewer core steps than the call's longest is passed through
unchanged by the later calls (``active_B``, a selection in the graph), so its coda reads the
state after its own r steps, as a one-sequence step at that r does. Those calls still write
the row's KV at steps ≥ r_b; its request never reads them (a request's r is fixed), and a later
request in the slot prefills every step it reads. A slot's prompt runs through the
one-sequence prelude, core_step and coda graphs bound to its entry (its r, its seed): the
prefill ``RecurrentGenerator`` runs. A free slot, or one whose prompt is still being
prefilled, runs a dummy row (id 0, inactive) at position n_b of its own entry, which the next
prefill there rewrites before any row reads it.

A verify step (speculation in the batch) is the same three kinds over S rows a slot, the most
its slots give (the pending token and up to ``verify_width - 1`` drafts, padded by repeating the
last), at positions n_b..n_b+S-1, a KL request's rows then taking their exits' outputs
(recurrent_batch_exits.py); it commits nothing (``advance`` commits the accepted rows; the rows
past them hold stale KV that the slot's next step rewrites before any row reads it). Prefix
reuse is off: a prefix's KV holds the core steps its request ran, which another request at
another r or seed would read as its own. The calls run eagerly (no captured CUDA graphs).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Mapping

import numpy as np
import onnxruntime as ort
from loopcast.ort_runtime.binding.batch_kv import (
    BF16,
    BatchStepOutput,
    DeviceKV,
    bind_type,
    entry_ptr,
    slots_of,
)
from loopcast.ort_runtime.binding.batch_slots import SlotCaps
from loopcast.ort_runtime.binding.bindings import _NP_DTYPES, _Buffer, host_copy, run_bound
from loopcast.ort_runtime.binding.device_move import copy_kv_positions, load_device_copy
from loopcast.ort_runtime.binding.recurrent_batch_exits import frozen_states, kl_verify_rows
from loopcast.ort_runtime.binding.step_clock import StepClock
from loopcast.ort_runtime.loading.artifact import LoadedModel

from loopcast.errors import ArtifactError, RequestError
from loopcast.kl_exit import KLExit, step_kl, uniform_log_probs
from loopcast.recurrent_state import initial_state
from loopcast.vocab import RECURRENT_BATCH_KINDS, RECURRENT_KINDS, GraphKind, OpSet

PRELUDE, CORE_STEP, CODA = GraphKind.PRELUDE, GraphKind.CORE_STEP, GraphKind.CODA
PRELUDE_BATCH, CORE_STEP_BATCH, CODA_BATCH = RECURRENT_BATCH_KINDS
# Rows a verify step takes per sequence: the pending token and up to 4 drafts, the one-sequence
# engine's default draft count for this family (ort_runtime/decoding/recurrent_stream.py).
VERIFY_WIDTH = 5
CAPS = SlotCaps(
    request_options=frozenset(
        {"loops", "state_seed", "draft_loops", "speculative", "kl_threshold", "min_loops", "kv_policy"}
    ),
    prefix_reuse="a recurrent-depth prefix's KV holds the core steps of its request's loops and seed",
    recurrent_self=True,
)


class RecurrentBatchGenerator:
    """Up to ``max_batch`` recurrent-depth sequences stepped together; ``max_loops``: KV for
    core steps 0..max_loops-1 only (default the artifact's max_recurrence); ``verify_width``: the
    most rows a verify step takes per sequence (its pending token and drafts). Not thread-safe:
    one thread drives it (the engine loop)."""

    caps = CAPS
    tail_width: int | None = None  # no draft_batch / verify_tail_batch: self-drafts are whole tokens
    prefill_rows: int | None = None  # prompts run eagerly at their own lengths

    def __init__(
        self,
        model: LoadedModel,
        max_batch: int | None = None,
        *,
        max_loops: int | None = None,
        verify_width: int = VERIFY_WIDTH,
        cuda_graphs: bool | str = False,
        prefill_rows: int | None = None,
    ) -> None:
        manifest, cfg = model.manifest, model.config
        if not cfg.recurrent_depth:
            raise ArtifactError(f"{model.path}: RecurrentBatchGenerator runs recurrent-depth artifacts")
        needed = (*RECURRENT_KINDS, *RECURRENT_BATCH_KINDS)
        what = "batched recurrent-depth decoding"
        self.max_batch = slots_of(model, needed, PRELUDE_BATCH, what, max_batch)
        if isinstance(verify_width, bool) or not isinstance(verify_width, int) or verify_width < 2:
            raise RequestError(
                f"verify_width must be an integer >= 2, got {verify_width!r}", parameter="verify_width"
            )
        # the rows are dynamic: a verify step runs the most rows its slots give, up to this. Stock
        # attention (GroupQueryAttention) takes several rows a sequence only in a batch of one.
        self.verify_width: int | None = verify_width if OpSet(manifest.op_set).loopcast_attention else None
        self.max_loops = cfg.num_loops if max_loops is None else max_loops
        if (
            isinstance(self.max_loops, bool)
            or not isinstance(self.max_loops, int)
            or not 1 <= self.max_loops <= cfg.num_loops
        ):
            raise RequestError(
                f"max_loops must be in 1..{cfg.num_loops} (the artifact's max_recurrence), got {max_loops}",
                parameter="max_loops",
            )
        if prefill_rows is not None:
            raise RequestError(
                "prefill_rows (captured prefill chunks) is not supported for recurrent-depth artifacts: "
                "their batched calls run eagerly",
                parameter="prefill_rows",
            )
        # no captured graphs: said, not ignored (the serving state reports graph_fallbacks)
        self.captured: set[str] = set()
        self.graph_fallbacks: dict[str, str] = (
            {str(k): "the recurrent-depth batched kinds run eagerly" for k in RECURRENT_BATCH_KINDS}
            if cuda_graphs
            else {}
        )
        self.model, self.config, self.device = model, cfg, model.device
        self.max_length, self.vocab = manifest.max_length, cfg.vocab_size
        self._dtype = np.dtype(_NP_DTYPES[manifest.dtype])
        self._entry_shape = (cfg.num_kv_heads, self.max_length, manifest.kv_head_size)
        self._entry_bytes = int(np.prod(self._entry_shape)) * self._dtype.itemsize
        L, B = cfg.num_layers, self.max_batch
        used = [cfg.core_slot(k, l) for k in range(self.max_loops) for l in range(L)]
        used += [cfg.prelude_slot(l) for l in range(cfg.num_prelude_layers)]
        used += [cfg.coda_slot(l) for l in range(cfg.num_coda_layers)]
        kv_buffer = _Buffer if self.device == "cpu" else DeviceKV  # on the CPU the array is the buffer
        self._kv = {
            s: (
                kv_buffer((B, *self._entry_shape), self._dtype.type, self.device),
                kv_buffer((B, *self._entry_shape), self._dtype.type, self.device),
            )
            for s in used
        }
        # a graph's KV names -> the buffers bound to them: step k's core slots under step 0's names
        self._slot_names = {
            PRELUDE: {s: s for s in (cfg.prelude_slot(l) for l in range(cfg.num_prelude_layers))},
            CODA: {s: s for s in (cfg.coda_slot(l) for l in range(cfg.num_coda_layers))},
        }
        self._step_names = [
            {cfg.core_slot(0, l): cfg.core_slot(k, l) for l in range(L)} for k in range(self.max_loops)
        ]
        default = cfg.loops_default if cfg.loops_default <= self.max_loops else self.max_loops
        self._default_loops = default
        self.lengths = [0] * B  # n_b: tokens whose KV is committed in slot b
        self._loops = [default] * B  # r_b: the request's core steps per token
        self._seeds: list[int | None] = [None] * B  # the request's initial-state seed
        self._drafts: list[int | None] = [None] * B  # a self-speculating request's draft depth
        self._kl: list[KLExit | None] = [None] * B  # a request's KL exit
        # each committed token's core steps (r, or its KL exit): the prompt's last call, then rows
        self._prompt_exit, self._exits = [0] * B, [[] for _ in range(B)]
        self._device_copy = None  # CUDA: the op library's KV position copy (last-exited), on first use
        self._last_exits: dict[int, int] = {}  # the last step's KL exits
        self._verify_exits: dict[int, list[int]] = {}  # the last verify's KL exits, row by row
        self._bindings: dict[tuple[str, int, int], ort.IOBinding] = {}  # (kind, step, width) -> binding
        self.clock = StepClock()
        self.rows_run = 0  # decode rows computed, occupied or not
        self.core_runs = 0  # core_step(_batch) calls: passes over the core

    # -- binding -----------------------------------------------------------------------------
    def _bind_kv(self, binding: ort.IOBinding, names: dict[int, int], first: int, count: int) -> None:
        """``names``: the graph's KV name -> the buffer bound to it, entries first..first+count-1."""
        shape = [count, *self._entry_shape]
        for name, slot in names.items():
            for which, buf in zip(("key", "value"), self._kv[slot]):
                ptr = entry_ptr(buf, first * self._entry_bytes)
                kind = bind_type(self._dtype)
                binding.bind_input(f"past_{which}.{name}", self.device, 0, kind, shape, ptr)
                binding.bind_output(f"present_{which}.{name}", self.device, 0, kind, shape, ptr)

    def _names(self, kind: str, step: int) -> dict[int, int]:
        if kind in (CORE_STEP, CORE_STEP_BATCH):
            return self._step_names[step]
        return self._slot_names[PRELUDE if kind in (PRELUDE, PRELUDE_BATCH) else CODA]

    def _binding(self, kind: str, step: int, width: int) -> ort.IOBinding:
        """A batched kind's binding over entries 0..width-1 (its KV bound once, made on first use)."""
        key = (kind, step, width)
        binding = self._bindings.get(key)
        if binding is None:
            binding = self._bindings[key] = self.model.sessions[kind].io_binding()
            self._bind_kv(binding, self._names(kind, step), 0, width)
        return binding

    def _run(self, kind: str, binding: ort.IOBinding, inputs: dict, outputs: list[str], on_host=False):
        """Bind and run one call (bindings.run_bound) on the step clock: outputs on the device, or
        the host (the coda's ids and logits)."""

        def run() -> None:
            t0 = time.perf_counter()
            self.model.sessions[kind].run_with_iobinding(binding)
            self.clock.record(str(kind), time.perf_counter() - t0, steady=True)

        return run_bound(binding, run, inputs, outputs, "cpu" if on_host else self.device)

    def _value(self, array: np.ndarray) -> ort.OrtValue | np.ndarray:
        """A host state for binding (bf16 as its bits with the ONNX type)."""
        array = np.ascontiguousarray(array, dtype=self._dtype)
        if self._dtype == BF16:  # ORT's numpy bridge has no bf16: its bits, with the ONNX type
            return ort.OrtValue.ortvalue_from_numpy_with_onnx_type(
                array.view(np.uint16), bind_type(self._dtype)
            )
        return array

    # -- slots -------------------------------------------------------------------------------
    def check_options(self, options: Mapping[str, object]) -> None:
        """Refuse a request's depth this generator cannot run (before it waits for a slot)."""
        loops = options.get("loops")
        if loops is not None:
            self.check_loops(loops)
        seed = options.get("state_seed")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or seed < 0):
            raise RequestError(
                f"state_seed must be a non-negative integer or None, got {seed!r}", parameter="state_seed"
            )
        self._draft_loops_of(options)
        self._kl_exit_of(options)

    def _kl_exit_of(self, options: Mapping[str, object]) -> KLExit | None:
        """A request's KL exit (``kl_threshold``, ``min_loops``, ``kv_policy``; None: r steps);
        speculating, ``full`` KV only (as alone)."""
        threshold = options.get("kl_threshold")
        if threshold is None:
            return None
        policy = str(getattr(options.get("kv_policy"), "value", options.get("kv_policy") or "full"))
        if options.get("speculative", "none") != "none" and policy != "full":
            raise RequestError(
                "speculation with the KL exit needs kv_policy 'full': with 'last-exited' a token's "
                "skipped-step KV depends on its exit, which a verify call over several rows cannot know",
                parameter="kv_policy",
            )
        min_loops = options.get("min_loops") or 1
        assert isinstance(threshold, float | int) and isinstance(min_loops, int)
        return KLExit(float(threshold), min_loops, policy)

    def prefills_whole(self, slot: int) -> bool:
        """Whether ``slot``'s prompt must be prefilled in one call: a KL exit's prompt rows leave
        together, at the step the last row's distribution settles (as alone)."""
        return self._kl[slot] is not None

    def _draft_loops_of(self, options: Mapping[str, object]) -> int | None:
        """A self-speculating request's draft depth (``draft_loops``, default a quarter of its
        loops, as alone: ort_runtime/decoding/recurrent_stream.py); None for other requests."""
        d, mode = options.get("draft_loops"), options.get("speculative")
        if mode != "self":
            if d is not None:
                raise RequestError("draft_loops goes with speculative='self'", parameter="draft_loops")
            return None
        r = options.get("loops") or self._default_loops
        assert isinstance(r, int)
        d = max(1, r // 4) if d is None else d
        if r < 2 or isinstance(d, bool) or not isinstance(d, int) or not 1 <= d < r:
            raise RequestError(
                f"draft_loops must be in 1..{r - 1} (fewer core steps than loops={r}), got {d}"
                if r >= 2
                else "self-speculation drafts with fewer core steps than loops: it needs loops >= 2",
                parameter="draft_loops" if r >= 2 else "loops",
            )
        return d

    def begin(self, slot: int, start: int = 0, options: Mapping[str, object] | None = None) -> None:
        """``slot`` starts a request with ``options``' ``loops`` (None: the release's default r)
        and ``state_seed`` (None: a zero initial state); no prefix is reused (``start`` must be 0)."""
        if not 0 <= slot < self.max_batch:
            raise RequestError(f"slot {slot} outside 0..{self.max_batch - 1}")
        if start != 0:
            raise RequestError(
                f"begin: a cached prefix ({start} positions) cannot start a recurrent-depth slot"
            )
        options = options or {}
        self.check_options(options)
        loops = options.get("loops")
        self._loops[slot] = self.check_loops(self._default_loops if loops is None else loops)
        seed = options.get("state_seed")
        self._seeds[slot] = int(seed) if isinstance(seed, int) else None
        self._drafts[slot] = self._draft_loops_of(options)
        self._kl[slot] = self._kl_exit_of(options)
        self._prompt_exit[slot], self._exits[slot] = 0, []
        self.lengths[slot] = 0

    def check_loops(self, loops: object) -> int:
        if isinstance(loops, bool) or not isinstance(loops, int) or not 1 <= loops <= self.max_loops:
            bound = (
                "the artifact's max_recurrence" if self.max_loops == self.config.num_loops else "max_loops"
            )
            raise RequestError(
                f"loops must be an integer in 1..{self.max_loops} ({bound}), got {loops!r}", parameter="loops"
            )
        return loops

    def depth_stats(self, slot: int, emitted: int) -> dict:
        """The request's depth, as the one-request engine reports it: each emitted token's core
        steps (its exit) as a histogram and a mean, and the KL exit's kv_policy ("" without one).
        The core passes are shared by the batch's rows, so they are not per request here."""
        exits = ([self._prompt_exit[slot]] + self._exits[slot])[:emitted]
        histogram: dict[int, int] = {}
        for k in exits:
            histogram[k] = histogram.get(k, 0) + 1
        kl = self._kl[slot]
        return {
            "exit_histogram": dict(sorted(histogram.items())),
            "mean_loops": round(sum(exits) / len(exits), 4) if exits else 0.0,
            "kv_policy": kl.kv_policy if kl is not None else "",
        }

    def release(self, slot: int, keep: int = 0) -> int:
        """Free ``slot`` (only its length is reset); nothing is kept for a prefix cache."""
        self.lengths[slot] = 0
        return 0

    def warm_up(self, kinds: tuple[str, ...] | None = None) -> int:
        """Nothing is captured; on the CPU, write zeros over the idle slots' KV entries, whose
        pages the OS would otherwise map inside a request's first prefill (a latency spike for
        every running request; BatchGenerator.warm_up says more). Returns 0 runs."""
        if kinds is None and self.device == "cpu":
            for slot in range(self.max_batch):
                if not self.lengths[slot]:
                    for key, value in self._kv.values():
                        key.host[slot].fill(0)
                        value.host[slot].fill(0)
        return 0

    # -- steps -------------------------------------------------------------------------------
    def prefill(
        self, slot: int, ids: list[int], *, start: int = 0, want_logits: bool = False
    ) -> tuple[int, np.ndarray | None]:
        """Write ``ids`` at positions start.. of ``slot`` through the one-sequence prelude, the
        slot's r core steps and coda, bound to its KV entry; commit them and return the next
        token (and its logits row when asked)."""
        if not 0 <= slot < self.max_batch:
            raise RequestError(f"slot {slot} outside 0..{self.max_batch - 1}")
        if not ids:
            raise RequestError("prompt is empty: give at least one token")
        bad = [t for t in ids if not 0 <= int(t) < self.vocab]
        if bad:
            raise RequestError(f"token id {bad[0]} is outside the vocabulary [0, {self.vocab})")
        if start != self.lengths[slot] or start + len(ids) > self.max_length:
            raise RequestError(
                f"prefill of {len(ids)} tokens at {start} on slot {slot} (length {self.lengths[slot]}, "
                f"max length {self.max_length})"
            )
        m, cfg = len(ids), self.config
        lengths = {
            "seqlens_k": np.array([start + m - 1], np.int32),
            "total_sequence_length": np.array(start + m, np.int32),
        }

        def one(kind: str, step: int = 0) -> ort.IOBinding:
            binding = self.model.sessions[kind].io_binding()
            self._bind_kv(binding, self._names(kind, step), slot, 1)
            return binding

        (embedded,) = self._run(
            PRELUDE, one(PRELUDE), {"input_ids_BS": np.array([ids], np.int64), **lengths}, ["embedded_BSH"]
        )
        positions = np.arange(start, start + m)
        state = self._value(initial_state(cfg.hidden_size, cfg.state_std, positions, self._seeds[slot])[None])
        r, kl, out = self._loops[slot], self._kl[slot], None

        def core(k: int, state):
            self.core_runs += 1
            inputs = {"state_BSH": state, "embedded_BSH": embedded, **lengths}
            return self._run(CORE_STEP, one(CORE_STEP, k), inputs, ["state_BSH_out"])[0]

        def coda(state):
            inputs = {"state_BSH": state, **lengths}
            return self._run(CODA, one(CODA), inputs, ["next_token_ids_BS", "logits_BSV"], on_host=True)

        exit_loops, previous = r, uniform_log_probs(cfg.vocab_size)
        for k in range(r):  # as RecurrentGenerator.step: the rows leave at the last row's exit
            state = core(k, state)
            if kl is not None and k + 1 >= kl.min_loops:
                out = coda(state)  # the check writes the coda KV, as the release's
                value, previous = step_kl(previous, out[1].numpy()[0, -1])
                if value < kl.threshold:
                    exit_loops = k + 1
                    break
        if out is None:
            out = coda(state)
        for k in range(exit_loops, r):  # the steps the rows skipped: their KV by the policy
            if kl is not None and kl.kv_policy == "full":
                state = core(k, state)
            else:
                self._copy_step_kv(slot, exit_loops - 1, k, start, m)
        next_ids, logits = out
        self.lengths[slot], self._prompt_exit[slot] = start + m, exit_loops
        return int(next_ids.numpy()[0, -1]), logits.numpy()[0, -1].copy() if want_logits else None

    def _copy_step_kv(self, slot: int, src_step: int, dst_step: int, n: int, m: int) -> None:
        """Core step ``src_step``'s K/V at positions n..n+m-1 of ``slot`` into step ``dst_step``'s,
        every core layer (kv_policy last-exited): a host copy on the CPU, the op library's
        device copy on CUDA (ort_runtime/binding/device_move.py)."""
        cfg = self.config
        if self.device != "cpu" and self._device_copy is None:
            self._device_copy = load_device_copy(self.model)
        row_bytes = self._entry_bytes // (cfg.num_kv_heads * self.max_length)
        for l in range(cfg.num_layers):
            pairs = zip(self._kv[cfg.core_slot(src_step, l)], self._kv[cfg.core_slot(dst_step, l)])
            copy_kv_positions(
                self._device_copy,
                pairs,
                entry=slot,
                entry_bytes=self._entry_bytes,
                heads=cfg.num_kv_heads,
                capacity=self.max_length,
                row_bytes=row_bytes,
                n=n,
                m=m,
            )

    def decode(self, tokens: dict[int, int], *, want_logits: bool = False) -> BatchStepOutput:
        """One row per slot in ``tokens`` (slot -> its pending token, written at position n_b),
        each through its request's r core steps; commits each and returns each slot's next token."""
        out, logits = self._step({slot: [token] for slot, token in tokens.items()}, want_logits)
        for slot in tokens:
            self.lengths[slot] += 1
            self._exits[slot].append(self._last_exits.get(slot, self._loops[slot]))
        return BatchStepOutput(
            {s: ids[0] for s, ids in out.items()},
            {s: rows[0] for s, rows in logits.items()} if logits is not None else None,
        )

    def verify(
        self, rows: dict[int, list[int]], *, want_logits: bool = False
    ) -> tuple[dict[int, list[int]], dict[int, np.ndarray] | None]:
        """Slot -> its pending token and drafts (1..verify_width ids) at positions n_b.., each row
        through the request's r core steps; each slot's argmax per given row (and [rows, V]
        logits when asked). Commits nothing: ``advance``."""
        if self.verify_width is None:
            raise RequestError(
                "batched verify needs the loopcast attention op (this artifact has stock attention)"
            )
        for ids in rows.values():
            if not 1 <= len(ids) <= self.verify_width:
                raise RequestError(f"verify takes 1..{self.verify_width} rows per sequence, got {len(ids)}")
        out = self._step(rows, want_logits)
        if max(len(ids) for ids in rows.values()) == 1:  # one row a slot: the decode step's exits
            self._verify_exits = {s: [e] for s, e in self._last_exits.items()}
        return out

    def draft_tokens(self, tokens: dict[int, int], offsets: dict[int, int]) -> dict[int, int]:
        """One draft row per slot in ``tokens`` (slot -> the token at position n_b + offset_b, its
        self-drafted chain so far) at the request's draft depth: each slot's next draft token.
        Writes KV at those positions (steps < the draft depth), which the round's verify rewrites
        before any row reads it; commits nothing."""
        depth = {}
        for slot in tokens:
            d = self._drafts[slot] if 0 <= slot < self.max_batch else None
            if d is None:
                raise RequestError(f"slot {slot} holds no self-speculating request")
            depth[slot] = d
        out, _ = self._step({s: [t] for s, t in tokens.items()}, False, offsets=offsets, loops=depth)
        return {s: ids[0] for s, ids in out.items()}

    def advance(self, slot: int, count: int) -> None:
        """Commit the first ``count`` rows of ``slot``'s last verify step."""
        if not 0 <= count <= (self.verify_width or 1) or self.lengths[slot] + count > self.max_length:
            raise RequestError(f"cannot commit {count} rows on slot {slot} at length {self.lengths[slot]}")
        self.lengths[slot] += count
        exits = self._verify_exits.get(slot)  # KL rows: each row's exit; others run every step
        self._exits[slot] += exits[:count] if exits else [self._loops[slot]] * count

    def _step(
        self,
        rows: dict[int, list[int]],
        want_logits: bool,
        *,
        offsets: dict[int, int] | None = None,
        loops: dict[int, int] | None = None,
    ) -> tuple[dict[int, list[int]], dict[int, np.ndarray] | None]:
        """S = the most rows given (1 for a decode step) per slot of the occupied prefix, slot b's
        at positions n_b + offset_b.. (its given ids, padded by repeating the last), through
        prelude_batch, max_b r_b core_step_batch calls (``loops``: other depths, for drafts) and
        coda_batch. Commits nothing."""
        offsets, loops = offsets or {}, loops or {}
        if not rows:
            raise RequestError("a step needs at least one sequence")
        S = max(len(ids) for ids in rows.values())
        for slot, ids in rows.items():
            if not 0 <= slot < self.max_batch:
                raise RequestError(f"slot {slot} outside 0..{self.max_batch - 1}")
            at = self.lengths[slot] + offsets.get(slot, 0)
            if self.lengths[slot] < 1 or at + S > self.max_length:
                raise RequestError(
                    f"slot {slot} has {self.lengths[slot]} committed tokens; a step needs a prefilled "
                    f"sequence with room for {S} more at {at} (max length {self.max_length})"
                )
            bad = [t for t in ids if not 0 <= int(t) < self.vocab]
            if bad:
                raise RequestError(f"token id {bad[0]} is outside the vocabulary [0, {self.vocab})")
        cfg, width = self.config, max(rows) + 1
        ids_BS = np.zeros((width, S), np.int64)
        # rows sit at their slot's length: dummy rows (a free or prefilling slot) past what its entry holds
        first = np.minimum(np.asarray(self.lengths[:width], np.int32), self.max_length - S)
        depth = np.zeros(width, np.int32)  # dummy rows: no core step counts
        state = np.zeros((width, S, cfg.hidden_size), np.float32)
        for slot, given in rows.items():
            ids_BS[slot, : len(given)], ids_BS[slot, len(given) :] = given, given[-1]
            depth[slot] = loops.get(slot, self._loops[slot])
            first[slot] = self.lengths[slot] + offsets.get(slot, 0)
            positions = np.arange(first[slot], first[slot] + S)
            state[slot] = initial_state(cfg.hidden_size, cfg.state_std, positions, self._seeds[slot])
        lengths = {
            "seqlens_k": (first + S - 1).astype(np.int32),
            "total_sequence_length": np.array(int(first.max()) + S, np.int32),
        }
        (embedded,) = self._run(
            PRELUDE_BATCH,
            self._binding(PRELUDE_BATCH, 0, width),
            {"input_ids_BS": ids_BS, **lengths},
            ["embedded_BSH"],
        )
        current: ort.OrtValue | np.ndarray = self._value(state)
        coda = functools.partial(self._run, CODA_BATCH, self._binding(CODA_BATCH, 0, width))
        heads = ["next_token_ids_BS", "logits_BSV"]
        # KL-exit rows of a one-row step: slot -> its exit state; last-exited rows stop there
        kl = {s: x for s in rows if (x := self._kl[s]) is not None} if S == 1 and not loops else {}
        # KL-exit rows of a verify step: every core step's states, for the rows' coda checks
        kl_rows = {s: x for s in rows if (x := self._kl[s]) is not None} if S > 1 and not loops else {}
        by_step: dict[int, np.ndarray] = {}
        self._verify_exits = {}
        exited: dict[int, tuple[int, np.ndarray]] = {}
        previous = {s: uniform_log_probs(cfg.vocab_size) for s in kl}
        stopped = np.zeros(width, bool)
        for k in range(int(depth.max())):
            self.core_runs += 1
            (current,) = self._run(
                CORE_STEP_BATCH,
                self._binding(CORE_STEP_BATCH, k, width),
                {
                    "state_BSH": current,
                    "embedded_BSH": embedded,
                    "active_B": (depth > k) & ~stopped,
                    **lengths,
                },
                ["state_BSH_out"],
            )
            if kl_rows:
                by_step[k + 1] = host_copy(current)
            checking = [s for s, x in kl.items() if s not in exited and x.min_loops <= k + 1 <= depth[s]]
            if checking:  # the coda after this step for the rows still deciding (writes the coda KV)
                host = host_copy(current)
                _, check = coda(
                    {"state_BSH": self._value(frozen_states(host, exited)), **lengths}, heads, True
                )
                for s in checking:
                    value, previous[s] = step_kl(previous[s], check.numpy()[s, 0])
                    if value < kl[s].threshold:
                        exited[s] = (k + 1, host[s].copy())
                        stopped[s] = kl[s].kv_policy != "full"  # full runs the rest for the KV only
        if exited:  # the coda reads each exited row's state at its exit
            current = self._value(frozen_states(host_copy(current), exited))
        next_ids, logits = coda({"state_BSH": current, **lengths}, heads, True)
        self._last_exits = {s: e for s, (e, _) in exited.items()}
        for s, (e, _) in exited.items():
            for k in range(e, int(depth[s])) if stopped[s] else ():
                self._copy_step_kv(s, e - 1, k, int(first[s]), 1)
        self.rows_run += width * S
        out_ids, out_logits = next_ids.numpy(), logits.numpy() if want_logits else None
        if kl_rows:  # each KL row's coda after each checked step until its exit (recurrent_batch_exits.py)

            def coda_rows(state_W1H: np.ndarray, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
                one = {
                    "seqlens_k": positions.astype(np.int32),
                    "total_sequence_length": np.array(int(positions.max()) + 1, np.int32),
                }
                ids, row_logits = coda({"state_BSH": self._value(state_W1H), **one}, heads, True)
                return ids.numpy(), row_logits.numpy()

            out_ids, out_logits = out_ids.copy(), logits.numpy().copy()
            given = {s: len(rows[s]) for s in kl_rows}
            final = host_copy(current)
            self._verify_exits = kl_verify_rows(
                coda_rows, kl_rows, given, by_step, final, depth, first, out_ids, out_logits, cfg.vocab_size
            )
            out_logits = out_logits if want_logits else None
        out = {s: [int(t) for t in out_ids[s, : len(given)]] for s, given in rows.items()}
        kept = (
            {s: out_logits[s, : len(given)].copy() for s, given in rows.items()}
            if out_logits is not None
            else None
        )
        return out, kept
