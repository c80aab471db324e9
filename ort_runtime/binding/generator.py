"""A generator: KV buffers, IO bindings and the committed length ``n`` of one sequence.

Everything a step touches is allocated once, when the generator is made: one K and one V
buffer per slot ``[1, H_kv, S_max, D]`` bound as both past and present of every graph that
reads the slot (GroupQueryAttention updates it in place), and per graph kind fixed input and
output buffers bound once. A step writes its inputs into those buffers and runs; nothing is
allocated per token. Prefill (dynamic rows) rebinds its token ids per call; it is not hot.

The host owns ``n`` (docs/architecture.md §2): a step over M rows at positions s..s+M-1 writes exactly those
positions of the slots it binds. ``rewind(n')`` only moves ``n``; data past ``n`` is never read
again before it is rewritten, because every row attends only to positions ≤ its own.
"""

from __future__ import annotations

import time

import numpy as np
from loopcast.ort_runtime.binding.bindings import _NP_DTYPES, StepOutput, _Buffer, _KindBinding, _RowsBinding
from loopcast.ort_runtime.binding.cycle_bindings import CycleBinding, CycleRunBinding
from loopcast.ort_runtime.binding.device_move import load_device_copy, load_device_move
from loopcast.ort_runtime.binding.loop_steps import LoopSteps
from loopcast.ort_runtime.binding.step_clock import StepClock, rows_timer
from loopcast.ort_runtime.loading.artifact import LoadedModel
from loopcast.ort_runtime.loading.session_table import SessionTable

from loopcast.errors import ArtifactError, RequestError
from loopcast.manifest import (
    BATCH_KINDS,
    CYCLE,
    CYCLE_RUN,
    DECODE,
    DRAFT,
    PREFILL,
    TREE_DRAFT,
    TREE_KINDS,
    VERIFY,
)
from loopcast.vocab import LOOP_STEP_KINDS

_PIPELINE_KINDS = (CYCLE, CYCLE_RUN)


class _Bindings(dict):
    """kind -> binding, for the given kinds; a binding is made on its first lookup."""

    def __init__(self, kinds: list[str], make) -> None:
        super().__init__()
        self.kinds, self._make = list(kinds), make

    def __contains__(self, kind: object) -> bool:
        return kind in self.kinds

    def __missing__(self, kind: str):
        if kind not in self.kinds:
            raise KeyError(kind)
        self[kind] = binding = self._make(kind)
        return binding

    def made(self) -> list[str]:
        return [kind for kind in self.kinds if dict.__contains__(self, kind)]


class Generator:
    """One sequence's state on a loaded model; several generators share the model's sessions."""

    def __init__(self, model: LoadedModel) -> None:
        manifest = model.manifest
        if manifest.dtype not in _NP_DTYPES:
            raise ArtifactError(f"{model.path}: unknown dtype {manifest.dtype!r} in the manifest")
        if manifest.dtype != "fp32" and model.device == "cpu":
            raise ArtifactError(
                f"{model.path}: {manifest.dtype} artifacts need the CUDA device (the CPU "
                "execution provider lacks kernels for these graphs); export fp32 for the CPU"
            )
        cfg = model.config
        self.model = model
        self.max_length = manifest.max_length
        dtype = _NP_DTYPES[manifest.dtype]
        shape = (1, cfg.num_kv_heads, self.max_length, manifest.kv_head_size)  # padded heads: stored size
        self._kv = {
            s: (_Buffer(shape, dtype, model.device), _Buffer(shape, dtype, model.device))
            for s in range(cfg.num_kv_slots)
        }

        # The batched kinds belong to a BatchGenerator (ort_runtime/binding/batch_generator.py). A kind
        # whose session is still deferred (ort_runtime/loading/session_table.py) is bound on first use.
        def bind(kind: str):
            if kind in _PIPELINE_KINDS:  # two bindings each, on one pair of lane-state buffers
                cls = CycleBinding if kind == CYCLE else CycleRunBinding
                other = [dict.get(self._cycle, k) for k in _PIPELINE_KINDS if k != kind]
                return cls(
                    model.sessions[kind],
                    manifest.graphs[kind],
                    self._kv,
                    model,
                    dtype,
                    other[0].shared if other[0] is not None else None,
                )
            if kind in TREE_KINDS:
                return _RowsBinding(model.sessions[kind], manifest.graphs[kind], self._kv, model, dtype)
            return _KindBinding(model.sessions[kind], manifest.graphs[kind], self._kv, model, dtype, kind)

        self._kinds = _Bindings(
            [
                k
                for k in model.sessions
                if k not in _PIPELINE_KINDS and k not in BATCH_KINDS and k not in LOOP_STEP_KINDS
            ],
            bind,
        )
        self._cycle = _Bindings([k for k in _PIPELINE_KINDS if k in model.sessions], bind)
        sessions = model.sessions
        pending = sessions.pending if isinstance(sessions, SessionTable) else (lambda kind: False)
        for kind in [*self._kinds.kinds, *self._cycle.kinds]:
            if not pending(kind):
                (self._cycle if kind in _PIPELINE_KINDS else self._kinds)[kind]
        self._tokens: list[int] = []  # ids whose KV is committed; len == n
        self._depth: int | None = None  # static depth of the generation (set_depth); None: R
        self._kv_depth = cfg.num_loops  # the fewest loops any committed token's KV was written with
        self._move = None  # CUDA: the op library's KV position move (move_kv)
        self._copy = None  # CUDA: the op library's KV copy between buffers (fill_deeper_kv)
        self._loop_steps: LoopSteps | None = None  # the exit gate's, made on first use
        self.clock = StepClock()  # every run's time; the gates' means and memory (step_clock.py)

    # -- state -------------------------------------------------------------------------------
    @property
    def n(self) -> int:
        return len(self._tokens)

    @property
    def tokens(self) -> list[int]:
        return list(self._tokens)

    def close(self) -> None:
        """Give this generator's captured-graph ids back (its bindings' runners; garbage
        collection does the same). The generator is not usable afterwards."""
        for bindings in (self._kinds, self._cycle):
            for kind in bindings.made():
                dict.__getitem__(bindings, kind).close()

    @property
    def depth(self) -> int:
        """The loops a prefill, decode or verify step runs (``set_depth``)."""
        return self._depth if self._depth is not None else self.model.config.num_loops

    def set_depth(self, loops: int | None) -> None:
        """Run prefill, decode and verify steps at static depth ``loops`` (loops 0..loops-1,
        the artifact's ``prefill@k`` graphs; None or R: every loop) until set again.

        KV invariant (docs/adaptive-depth.md): a step at depth k writes loops 0..k-1's slots at
        its positions and leaves the deeper slots as they were. A generation keeps one depth
        from its first prompt token on, and loop j only reads slot j, so no step ever reads a
        deeper slot that its sequence did not write at the same depth. A sequence continued at
        a greater depth than its committed tokens were written with would read such slots:
        refused here."""
        R = self.model.config.num_loops
        if self.n and (loops or R) > self._kv_depth:
            raise RequestError(
                f"loops={loops or R}: the {self.n} committed tokens were written at depth "
                f"{self._kv_depth}, so their deeper loops' KV is missing; start a new sequence"
            )
        if loops is None or loops == R:
            self._depth = None
            return
        from loopcast.vocab import depth_key

        if not 1 <= loops <= R or depth_key(PREFILL, loops) not in self._kinds:
            have = [*self.model.manifest.exit_depths, R]
            raise RequestError(
                f"loops must be one of {', '.join(map(str, have))} on this artifact (static depths "
                f"with graphs, manifest exit_depths; R={R}), got {loops}"
            )
        self._depth = loops

    def resolve(self, kind: str) -> str:
        """The graph a step of ``kind`` runs at the generation's depth (``decode@2``, or ``kind``)."""
        if self._depth is None or kind not in (PREFILL, DECODE, VERIFY):
            return kind
        return f"{kind}@{self._depth}"

    def rewind(self, n: int) -> None:
        """Forget everything after the first ``n`` committed tokens. Never copies KV."""
        if not 0 <= n <= self.n:
            raise RequestError(f"rewind({n}) outside 0..{self.n} (the committed length)")
        del self._tokens[n:]
        if not n:
            self._kv_depth = self.model.config.num_loops

    def commit(self, ids: list[int]) -> None:
        """Declare that the KV of ``ids`` at positions n.. has been written by a step."""
        if self.n + len(ids) > self.max_length:
            raise RequestError(f"commit past the KV capacity {self.max_length}")
        self._tokens.extend(int(t) for t in ids)
        if ids:
            self._kv_depth = min(self._kv_depth, self.depth)

    @property
    def cycle(self) -> CycleBinding | None:
        """The pipeline's cycle binding (made on first use where its session is deferred)."""
        # dict.get first: the pipeline reads this three times a cycle
        return dict.get(self._cycle, CYCLE) or (self._cycle[CYCLE] if CYCLE in self._cycle else None)

    @property
    def cycle_run(self) -> CycleRunBinding | None:
        """The pipeline's cycle-run binding (K cycles per call), where the artifact has the graph."""
        return dict.get(self._cycle, CYCLE_RUN) or (
            self._cycle[CYCLE_RUN] if CYCLE_RUN in self._cycle else None
        )

    def has_kind(self, kind: str) -> bool:
        kind = self.resolve(kind)
        if kind in LOOP_STEP_KINDS:
            return kind in self.model.sessions
        return kind in self._kinds or kind in self._cycle

    @property
    def loop_steps(self) -> LoopSteps:
        """The exit gate's loop-skipping bindings (ort_runtime/binding/loop_steps.py), made on
        first use (their sessions with them, where deferred)."""
        if self._loop_steps is None:
            if not all(kind in self.model.sessions for kind in LOOP_STEP_KINDS):
                raise RequestError(
                    "the exit gate needs the exits graphs (loop_embed, loop_step, exit_head); this "
                    "artifact has none (a looped model with an exit gate, exported by this loopcast, "
                    "has them)"
                )
            dtype = _NP_DTYPES[self.model.manifest.dtype]
            self._loop_steps = LoopSteps(self.model, self._kv, dtype, self._execute)
        return self._loop_steps

    def rows(self, kind: str) -> int | None:
        return self.model.manifest.graphs[self.resolve(kind)].rows

    def kv_arrays(self, slot: int) -> tuple[np.ndarray, np.ndarray]:
        """Host copies of one slot's K and V buffers ``[1, H_kv, S_max, D]`` (for checks)."""
        key, value = self._kv[slot]
        return key.pull().copy(), value.pull().copy()

    def graph_slots(self) -> dict[str, dict]:
        """Per kind: this generator's CUDA-graph counters (empty when nothing is captured)."""
        slots = {kind: kb.slot.as_dict() for kind, kb in sorted(self._kinds.items()) if kb.slot is not None}
        for kind in self._cycle.made():
            slots.update(
                {
                    f"{kind}/{i}": h.slot.as_dict()
                    for i, h in enumerate(self._cycle[kind].halves)
                    if h.slot is not None
                }
            )
        return slots

    def bound_objects(self) -> list[object]:
        objs = [x for k, v in self._kv.values() for x in (k.host, k.value, v.host, v.value)]
        for kind in sorted(self._kinds.made()):
            objs += self._kinds[kind].bound_objects()
        for kind in self._cycle.made():
            objs += self._cycle[kind].bound_objects()
        return objs

    # -- steps (write KV at positions start.., never move n) ---------------------------------
    def run(
        self,
        kind: str,
        start: int,
        *,
        tokens: list[int] | None = None,
        hidden: np.ndarray | None = None,
        want_logits: bool = True,
    ) -> StepOutput:
        """Run one graph over rows at positions ``start..``; padded rows repeat the last input.

        ``next_ids`` is a copy; ``logits`` is a view of the bound buffer that the next step
        overwrites (``want_logits=False`` skips the device→host copy on CUDA).
        """
        if kind in TREE_KINDS:
            raise RequestError(f"{kind} rows carry their own addresses: run it with run_rows()")
        kind = self.resolve(kind)
        kb = self._kinds[kind]
        used = len(tokens) if tokens is not None else hidden.shape[0]
        rows = kb.spec.rows or used
        if used < 1 or used > rows:
            raise RequestError(f"{kind} takes 1..{rows} rows, got {used}")
        variable = kb.variable_rows and tokens is not None
        if variable:  # verify on prefill's CPU session: only the rows this call uses
            rows = used
            kb.bind_rows(used)
        if start + rows > self.max_length:
            raise RequestError(
                f"{kind} at position {start} with {rows} rows passes the KV capacity {self.max_length}"
            )
        if tokens is not None:
            if kb.spec.rows is None:  # prefill: dynamic rows, bound per call
                ids = np.asarray([tokens], dtype=np.int64)
                kb.binding.bind_cpu_input("input_ids_BS", ids)
            else:
                kb.ids.host[0, :used] = tokens
                kb.ids.host[0, used:] = tokens[-1]
                kb.ids.push()
        else:
            kb.hidden.host[0, :used] = hidden
            kb.hidden.host[0, used:] = hidden[-1]
            kb.hidden.push()
        kb.seqlens.host[0] = start + rows - 1
        kb.seqlens.push()
        kb.total.host[...] = start + rows
        kb.total.push()
        elapsed, steady = self._execute(kind, kb)
        if variable and steady:
            self.clock.add(rows_timer(kind, used), elapsed)  # what a round of this many rows costs
        out_rows = 1 if kb.spec.kind == PREFILL else used
        next_ids = kb.next_ids.pull()[0, :out_rows].copy()
        logits = kb.logits.pull()[0, :out_rows] if want_logits or kb.logits.device == "cpu" else None
        if kind == DRAFT:
            return StepOutput(next_ids, logits, kb.hidden_out.pull()[0].copy(), float(kb.gap.pull()[0, 0]))
        return StepOutput(next_ids, logits)

    def _execute(self, kind: str, runner) -> tuple[float, bool]:
        t0 = time.perf_counter()
        steady = bool(runner.execute(self.model))
        elapsed = time.perf_counter() - t0
        self.clock.record(kind, elapsed, steady)
        return elapsed, steady

    def variable_rows(self, kind: str) -> bool:
        """Whether ``kind`` runs only the rows a call passes (verify on prefill's CPU session),
        so its cost depends on the row count (``rows_timer``)."""
        kind = self.resolve(kind)
        return kind in self._kinds.kinds and self._kinds[kind].variable_rows

    def run_rows(
        self,
        kind: str,
        addresses: list[tuple[int, int, int]],
        *,
        tokens: list[int] | None = None,
        hidden: np.ndarray | None = None,
        want_logits: bool = False,
    ) -> StepOutput:
        """Run a tree kind over rows at their own addresses (cache position, masked lo, masked hi):
        row i writes its KV at its position and attends to keys 0..position outside [lo, hi),
        rotated at its position less the masked keys below it (docs/architecture.md §5,
        "Alternate suffix"). Rows past ``addresses`` are inactive: they write nothing."""
        kb = self._kinds[kind]
        used, rows = len(addresses), kb.spec.rows
        if not 1 <= used <= rows or used != (len(tokens) if tokens is not None else len(hidden)):
            raise RequestError(f"{kind} takes 1..{rows} rows, one address each; got {used} addresses")
        for p, _lo, _hi in addresses:
            if not 0 <= p < self.max_length:
                raise RequestError(f"{kind} row at position {p} is outside the KV capacity {self.max_length}")
        if tokens is not None:
            kb.ids.host[0, :used] = tokens
            kb.ids.host[0, used:] = 0
            kb.ids.push()
        else:
            kb.hidden.host[0, :used] = hidden
            kb.hidden.host[0, used:] = 0
            kb.hidden.push()
        kb.address.host[:used] = addresses
        kb.address.host[used:] = (-1, 0, 0)
        kb.address.push()
        self._execute(kind, kb)
        next_ids = kb.next_ids.pull()[0, :used].copy()
        logits = kb.logits.pull()[0, :used] if want_logits or kb.logits.device == "cpu" else None
        if kind != TREE_DRAFT:
            return StepOutput(next_ids, logits)
        return StepOutput(
            next_ids,
            logits,
            kb.hidden_out.pull()[0, :used].copy(),
            top2_ids=kb.top2_ids.pull()[0, 0].copy(),
            top2_probs=kb.top2_probs.pull()[0, 0].copy(),
        )

    def move_kv(self, src: int, dst: int, count: int) -> None:
        """Copy the K and V of positions src..src+count-1 to dst.. in every slot: a surviving
        branch's rows, written at scratch positions, into place (already rotated at their logical
        positions, so the copy is exact). 2 · slots · H_kv · count · D values: a host memcpy on the
        CPU, one device copy per buffer on CUDA (the op library's loopcast_cuda_move_positions)."""
        if (
            min(src, dst) < 0
            or max(src, dst) + count > self.max_length
            or (src < dst + count and dst < src + count)
        ):
            raise RequestError(
                f"move_kv({src}, {dst}, {count}): ranges must be disjoint and inside the KV "
                f"capacity {self.max_length}"
            )
        if self.model.device == "cpu":
            for key, value in self._kv.values():
                for buf in (key, value):
                    buf.host[:, :, dst : dst + count] = buf.host[:, :, src : src + count]
            return
        move, cfg, manifest = self._device_move(), self.model.config, self.model.manifest
        row_bytes = manifest.kv_head_size * np.dtype(_NP_DTYPES[manifest.dtype]).itemsize
        for key, value in self._kv.values():
            for buf in (key, value):
                code = move(
                    buf.value.data_ptr(), cfg.num_kv_heads, self.max_length, row_bytes, src, dst, count, None
                )
                if code:
                    raise ArtifactError(
                        f"moving KV positions on {self.model.device} failed (CUDA error {code})"
                    )

    def _device_move(self):
        """The op library's device copy (ort_runtime/binding/device_move.py), loaded once."""
        if self._move is None:
            self._move = load_device_move(self.model)
        return self._move

    def run_cycle(self, token: int, positions: list[int]) -> np.ndarray:
        """One pipeline cycle (docs/architecture.md §5): the lane entering loop 0 reads ``token``;
        row r runs loop r at ``positions[r]`` (-1: no lane). Returns each row's argmax [R]."""
        cycle = self.cycle
        if min(positions) < -1 or max(positions) >= self.max_length:
            raise RequestError(
                f"cycle rows at positions {positions} outside the KV capacity {self.max_length}"
            )
        cycle.load(token, positions)
        self._execute(CYCLE, cycle)
        return cycle.next_ids.pull()[0]

    def run_cycles(self, state: np.ndarray) -> np.ndarray:
        """K pipeline cycles in one call (docs/architecture.md §5): ``state`` is the lanes' state
        (manifest.lane_state_length); returns the log (K records, then the state after them)."""
        run = self.cycle_run
        positions = state[: run.rows]
        limit = int(state[2 * run.rows])
        if positions.min() < -1 or positions.max() >= self.max_length or not -1 <= limit < self.max_length:
            raise RequestError(
                f"cycle run lanes at positions {positions.tolist()} (limit {limit}) outside the "
                f"KV capacity {self.max_length}"
            )
        run.state.host[...] = state
        run.state.push()
        self._execute(CYCLE_RUN, run)
        return run.log.pull()

    # -- committing steps --------------------------------------------------------------------
    def prefill(self, ids: list[int], chunk: int | None = None) -> int:
        """Write ``ids`` at n.. (in chunks of ``chunk`` rows if given), commit, return the next token."""
        if not ids:
            raise RequestError("prompt is empty: give at least one token")
        if self.model.config.recurrent_depth:
            raise RequestError(
                "recurrent-depth (huginn_raven) artifacts run through RecurrentGenerator "
                "(ort_runtime/binding/recurrent_generator.py); this generation path does not run them yet"
            )
        if self.resolve(PREFILL) not in self._kinds:
            raise RequestError(
                "this model was opened without the prefill graph (kinds=...); generation needs it"
            )
        chunk = chunk or len(ids)
        out = None
        for i in range(0, len(ids), chunk):
            part = ids[i : i + chunk]
            out = self.run(PREFILL, self.n, tokens=part, want_logits=False)
            self.commit(part)
        return int(out.next_ids[-1])

    def run_exits(self, token: int, want_logits: bool = False) -> StepOutput:
        """The exits graph at position ``n`` (writes every loop's KV there, commits nothing):
        ``next_ids`` [R] is each loop's argmax, ``logits`` [R, V] (on request), ``gates`` [R]
        each loop's exit-gate logit."""
        from loopcast.vocab import GraphKind

        kind = GraphKind.EXITS
        if kind not in self._kinds:
            raise RequestError(
                "the exit gate needs the exits graph; this artifact has none (a looped model with an "
                "exit gate, exported by this loopcast, has it)"
            )
        if self.n + 1 > self.max_length:
            raise RequestError(f"exits at position {self.n} passes the KV capacity {self.max_length}")
        kb = self._kinds[kind]
        kb.ids.host[0, 0] = token
        kb.ids.push()
        kb.seqlens.host[0] = self.n
        kb.seqlens.push()
        kb.total.host[...] = self.n + 1
        kb.total.push()
        self._execute(kind, kb)
        logits = kb.logits.pull()[0] if want_logits or kb.logits.device == "cpu" else None
        return StepOutput(kb.next_ids.pull()[0].copy(), logits, gates=kb.gates.pull()[0].copy())

    def fill_deeper_kv(self, position: int, exit_loop: int) -> None:
        """KV policy last-exited: loop ``exit_loop``'s K/V at ``position`` copied into the slots of
        the deeper loops (every core layer), so later tokens read it there: a host copy on the
        CPU, one device copy per buffer on CUDA (the op library's loopcast_cuda_copy_positions)."""
        cfg = self.model.config
        if not 0 <= position < self.max_length:
            raise RequestError(
                f"fill_deeper_kv at position {position}: outside the KV capacity {self.max_length}"
            )
        copy = None if self.model.device == "cpu" else self._device_copy()
        manifest = self.model.manifest
        row_bytes = manifest.kv_head_size * np.dtype(_NP_DTYPES[manifest.dtype]).itemsize
        for layer in range(cfg.num_layers):
            src_k, src_v = self._kv[cfg.core_slot(exit_loop, layer)]
            for loop in range(exit_loop + 1, cfg.num_loops):
                dst_k, dst_v = self._kv[cfg.core_slot(loop, layer)]
                for src, dst in ((src_k, dst_k), (src_v, dst_v)):
                    if copy is None:
                        dst.host[:, :, position] = src.host[:, :, position]
                        continue
                    code = copy(
                        dst.value.data_ptr(),
                        src.value.data_ptr(),
                        cfg.num_kv_heads,
                        self.max_length,
                        row_bytes,
                        position,
                        1,
                        None,
                    )
                    if code:
                        raise ArtifactError(f"copying KV on {self.model.device} failed (CUDA error {code})")

    def _device_copy(self):
        """The op library's copy between KV buffers (ort_runtime/binding/device_move.py), loaded once."""
        if self._copy is None:
            self._copy = load_device_copy(self.model)
        return self._copy

    def decode(self, token: int) -> int:
        out = self.run(DECODE, self.n, tokens=[token], want_logits=False)
        self.commit([token])
        return int(out.next_ids[0])

    def validate_ids(self, ids: list[int]) -> None:
        vocab = self.model.config.vocab_size
        bad = [t for t in ids if not isinstance(t, (int, np.integer)) or not 0 <= int(t) < vocab]
        if bad:
            raise RequestError(f"token id {bad[0]} is outside the vocabulary [0, {vocab})")
        if self.n + len(ids) > self.max_length:
            raise RequestError(
                f"prompt of {len(ids)} tokens after {self.n} committed ones is longer than "
                f"the max length {self.max_length}"
            )
