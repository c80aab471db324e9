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
from collections import defaultdict
from dataclasses import dataclass

import ml_dtypes
import numpy as np
import onnxruntime as ort

from loopcast.errors import ArtifactError, RequestError
from loopcast.manifest import BATCH_KINDS, CYCLE, DECODE, DRAFT, LOGIT_ROWS, PREFILL, TREE_DRAFT, TREE_KINDS, GraphSpec
from loopcast.ort_runtime.artifact import LoadedModel
from loopcast.ort_runtime import device_memory

_NP_DTYPES = {"fp32": np.float32, "fp16": np.float16, "bf16": ml_dtypes.bfloat16}
_ONNX_BFLOAT16 = 16  # TensorProto.BFLOAT16: ORT's numpy bridge has no bf16, so bf16 moves as raw uint16
_EXACT_BYTES = 1 << 20  # device buffers from this size on get exact allocations (ort_runtime/device_memory.py)


class _Buffer:
    """A fixed host array and the OrtValue bound to it (on CPU they share memory)."""

    def __init__(self, shape: tuple[int, ...], dtype, device: str) -> None:
        self.host = np.zeros(shape, dtype)
        self.device = device
        bf16 = np.dtype(dtype) == np.dtype(ml_dtypes.bfloat16)
        self._raw = self.host.view(np.uint16) if bf16 else self.host
        self._mirror = ort.OrtValue.ortvalue_from_numpy_with_onnx_type(self._raw, _ONNX_BFLOAT16) if bf16 else None
        if device == "cpu":
            self.value = self._mirror if bf16 else ort.OrtValue.ortvalue_from_numpy(self.host)
        elif self.host.nbytes >= _EXACT_BYTES and device_memory.available():
            # KV buffers: exact allocations (ORT's arena would grow in powers of two)
            onnx_type = _ONNX_BFLOAT16 if bf16 else device_memory.onnx_type_of(dtype)
            self.value = device_memory.device_value(shape, onnx_type, self._raw)
        else:
            self.value = ort.OrtValue.ortvalue_from_shape_and_type(
                shape, _ONNX_BFLOAT16 if bf16 else dtype, "cuda", 0)
            self.value.update_inplace(self._raw)

    def push(self) -> None:
        """Make the device copy current after ``host`` was written (no-op on CPU)."""
        if self.device != "cpu":
            self.value.update_inplace(self._raw)

    def pull(self) -> np.ndarray:
        if self.device != "cpu":
            if self._mirror is not None:
                self._mirror.update_inplace(self.value)  # device -> the host array's memory
            else:
                self.host[...] = self.value.numpy()
        return self.host


@dataclass
class GraphSlot:
    """One generator's captured CUDA graph of one kind (docs/architecture.md §5), and what happened to it.

    ORT's CUDA provider does the warm-up run and the capture inside a graph id's first
    ``Run`` (it re-runs itself until the graph is captured) and replays from the second call
    on; the counters follow that rule per id — they are derived, ORT does not report them.
    ``fallbacks`` counts runs that went to the eager session after the first run failed with
    graphs but succeeded without.
    """

    graph_id: int
    runs: int = 0
    warmups: int = 0
    captures: int = 0
    replays: int = 0
    fallbacks: int = 0
    failure: str | None = None

    def as_dict(self) -> dict:
        return {"graph_id": self.graph_id, "warmups": self.warmups, "captures": self.captures,
                "replays": self.replays, "fallbacks": self.fallbacks, "failure": self.failure}


@dataclass(frozen=True)
class StepOutput:
    next_ids: np.ndarray            # [rows] int64, argmax of each row
    logits: np.ndarray | None       # [rows, V] float32, a view of the bound buffer (None: not pulled)
    hidden: np.ndarray | None = None  # draft only: [1, H] state at the draft depth
    top2_gap: float | None = None     # draft only
    top2_ids: np.ndarray | None = None    # tree_draft only: [2] the two most likely tokens
    top2_probs: np.ndarray | None = None  # tree_draft only: [2] their softmax probabilities


def _bind_kv(b: ort.IOBinding, kv: dict[int, tuple[_Buffer, _Buffer]], slots) -> None:
    """Each slot's K and V buffer bound as past and present (the graph updates them in place)."""
    for slot in slots:
        key, value = kv[slot]
        b.bind_ortvalue_input(f"past_key.{slot}", key.value)
        b.bind_ortvalue_input(f"past_value.{slot}", value.value)
        b.bind_ortvalue_output(f"present_key.{slot}", key.value)
        b.bind_ortvalue_output(f"present_value.{slot}", value.value)


class _KindBinding:
    """One graph kind's session, IO binding and fixed buffers."""

    def __init__(self, session: ort.InferenceSession, spec: GraphSpec, kv: dict[int, tuple[_Buffer, _Buffer]],
                 model: LoadedModel, dtype) -> None:
        cfg, device = model.config, model.device
        self._open(session, spec, model)
        rows = spec.rows or 1
        out_rows = 1 if spec.kind == PREFILL else rows
        self.ids = _Buffer((1, rows), np.int64, device) if spec.first_loop == 0 else None
        self.hidden = _Buffer((1, rows, cfg.hidden_size), dtype, device) if spec.first_loop > 0 else None
        # GroupQueryAttention reads seqlens_k on the device and total_sequence_length on the
        # host; the loopcast attention op reads both on the device (nothing host-side to freeze
        # into a captured graph).
        custom_attention = model.manifest.device_lengths
        self.seqlens = _Buffer((1,), np.int32, device)
        self.total = _Buffer((), np.int32, device if custom_attention else "cpu")
        self.next_ids = _Buffer((1, out_rows), np.int64, device)
        self.logits = _Buffer((1, out_rows, cfg.vocab_size), np.float32, device)
        self.gap = _Buffer((1, 1), np.float32, device) if spec.kind == DRAFT else None
        self.hidden_out = _Buffer((1, 1, cfg.hidden_size), dtype, device) if spec.kind == DRAFT else None
        # verify on prefill's session (the CPU: ort_runtime/artifact.py) asks for logits of its
        # last ``logit_rows`` rows: all of them (decode's one row is the default)
        self.logit_rows = (ort.OrtValue.ortvalue_from_numpy(np.array([rows], np.int64))
                           if model.shared_sessions.get(spec.kind) == PREFILL and rows > 1 else None)
        self._kv = kv
        self._bind(self.binding)

    def _open(self, session: ort.InferenceSession, spec: GraphSpec, model: LoadedModel) -> None:
        """The session, its IO binding and, when the kind is captured, this binding's graph id."""
        self.spec, self.session = spec, session
        self.binding = session.io_binding()
        self.slot = GraphSlot(model.allocate_graph_id(spec.kind)) if spec.kind in model.graph_kinds else None
        self.run_options = None
        # An eager binding's first run is not a steady one either: it follows the binding's
        # (and, for a kind made on first use, its session's) creation inside the same round,
        # and ORT allocates on a session's first run; the cost gate's timers must not see it.
        self._warm = False
        if self.slot is not None:
            self.run_options = ort.RunOptions()
            self.run_options.add_run_config_entry("gpu_graph_id", str(self.slot.graph_id))

    def _bind(self, b: ort.IOBinding) -> None:
        spec, kv = self.spec, self._kv
        if self.ids is not None and spec.rows is not None:
            b.bind_ortvalue_input("input_ids_BS", self.ids.value)
        if self.hidden is not None:
            b.bind_ortvalue_input("hidden_BSH", self.hidden.value)
        b.bind_ortvalue_input("seqlens_k", self.seqlens.value)
        b.bind_ortvalue_input("total_sequence_length", self.total.value)
        if self.logit_rows is not None:
            b.bind_ortvalue_input(LOGIT_ROWS, self.logit_rows)
        _bind_kv(b, kv, spec.kv_slots)
        b.bind_ortvalue_output("next_token_ids_BS", self.next_ids.value)
        b.bind_ortvalue_output("logits_BSV", self.logits.value)
        if self.gap is not None:
            b.bind_ortvalue_output("top2_gap_BS", self.gap.value)
            b.bind_ortvalue_output("hidden_BSH_out", self.hidden_out.value)

    def bound_objects(self) -> list[object]:
        """Every buffer this binding holds (tests assert they never change identity)."""
        bufs = [self.ids, self.hidden, self.seqlens, self.total, self.next_ids, self.logits, self.gap, self.hidden_out]
        return [x for b in bufs if b is not None for x in (b.host, b.value)] + [self.binding]

    def execute(self, model: LoadedModel) -> bool:
        """Run once: eagerly, or as this slot's warm-up + capture / replay. Returns whether the
        run was a steady one (not a slot's first run), which the cost measurements keep."""
        slot = self.slot
        if slot is None:
            self.session.run_with_iobinding(self.binding)
            warm, self._warm = self._warm, True
            return warm
        if slot.failure is not None:
            slot.fallbacks += 1
            self.session.run_with_iobinding(self.binding)
            return True
        try:
            self.session.run_with_iobinding(self.binding, self.run_options)
        except Exception as exc:
            if slot.runs:  # a replay failing is not a capture problem: surface it
                raise
            self._fall_back(model, str(exc).splitlines()[0][:300])
            return False
        slot.runs += 1
        if slot.runs == 1:
            slot.warmups += 1
            slot.captures += 1
            return False
        slot.replays += 1
        return True

    def _fall_back(self, model: LoadedModel, reason: str) -> None:
        """The first run failed with graphs: try the same graph eagerly (the same kernels, so
        the same tokens). Only if that works does this slot stay eager; otherwise the error is
        not a capture problem and is raised, naming the kind."""
        session = model.eager_session(self.spec.kind)
        binding = session.io_binding()
        self._bind(binding)
        try:
            session.run_with_iobinding(binding)
        except Exception as exc:
            raise ArtifactError(f"the '{self.spec.kind}' graph failed on its first run "
                                f"({str(exc).splitlines()[0][:300]})") from None
        self.session, self.binding = session, binding
        self.slot.failure = reason
        self.slot.fallbacks += 1


class _RowsBinding(_KindBinding):
    """A tree kind (docs/architecture.md §5, "Alternate suffix"): rows carry their own address
    (cache position, masked key range) in one int32 input instead of the step's lengths."""

    def __init__(self, session: ort.InferenceSession, spec: GraphSpec, kv: dict[int, tuple[_Buffer, _Buffer]],
                 model: LoadedModel, dtype) -> None:
        cfg, device, rows = model.config, model.device, spec.rows
        self._open(session, spec, model)
        self.ids = _Buffer((1, rows), np.int64, device) if spec.first_loop == 0 else None
        self.hidden = _Buffer((1, rows, cfg.hidden_size), dtype, device) if spec.first_loop > 0 else None
        self.address = _Buffer((rows, 3), np.int32, device)
        self.next_ids = _Buffer((1, rows), np.int64, device)
        self.logits = _Buffer((1, rows, cfg.vocab_size), np.float32, device)
        drafts = spec.kind == TREE_DRAFT
        self.hidden_out = _Buffer((1, rows, cfg.hidden_size), dtype, device) if drafts else None
        self.top2_probs = _Buffer((1, rows, 2), np.float32, device) if drafts else None
        self.top2_ids = _Buffer((1, rows, 2), np.int64, device) if drafts else None
        self._kv = kv
        self._bind(self.binding)

    def _bind(self, b: ort.IOBinding) -> None:
        if self.ids is not None:
            b.bind_ortvalue_input("input_ids_BS", self.ids.value)
        if self.hidden is not None:
            b.bind_ortvalue_input("hidden_BSH", self.hidden.value)
        b.bind_ortvalue_input("row_address_S3", self.address.value)
        _bind_kv(b, self._kv, self.spec.kv_slots)
        b.bind_ortvalue_output("next_token_ids_BS", self.next_ids.value)
        b.bind_ortvalue_output("logits_BSV", self.logits.value)
        if self.hidden_out is not None:
            b.bind_ortvalue_output("hidden_BSH_out", self.hidden_out.value)
            b.bind_ortvalue_output("top2_probs_BS2", self.top2_probs.value)
            b.bind_ortvalue_output("top2_ids_BS2", self.top2_ids.value)

    def bound_objects(self) -> list[object]:
        bufs = [self.ids, self.hidden, self.address, self.next_ids, self.logits, self.hidden_out, self.top2_probs,
                self.top2_ids]
        return [x for b in bufs if b is not None for x in (b.host, b.value)] + [self.binding]


class _CycleHalf(_KindBinding):
    """The cycle graph bound one way round: lane states in from ``carried_in``, out to ``carried_out``
    (its own captured graph on CUDA: a captured graph bakes in its buffers' addresses)."""

    def __init__(self, session, spec: GraphSpec, kv, model: LoadedModel, io: CycleBinding, carried_in: _Buffer,
                 carried_out: _Buffer) -> None:
        self._open(session, spec, model)
        self._kv, self.io, self.carried_in, self.carried_out = kv, io, carried_in, carried_out
        self._bind(self.binding)

    def _bind(self, b: ort.IOBinding) -> None:
        io = self.io
        b.bind_ortvalue_input("lanes_W1", io.lanes.value)
        b.bind_ortvalue_input("carried_BWH", self.carried_in.value)
        _bind_kv(b, self._kv, self.spec.kv_slots)
        b.bind_ortvalue_output("next_token_ids_BS", io.next_ids.value)
        b.bind_ortvalue_output("logits_BSV", io.logits.value)
        b.bind_ortvalue_output("carried_BWH_out", self.carried_out.value)


class CycleBinding:
    """The pipeline cycle's buffers (docs/architecture.md §5): the entering token with the rows'
    positions (one int32 vector, one copy to the device per cycle), two lane-state buffers that
    alternate as input and output (the graph shifts row r to row r+1, so the states never cross
    to the host), argmax and logits per row."""

    def __init__(self, session, spec: GraphSpec, kv, model: LoadedModel, dtype) -> None:
        cfg, device, R = model.config, model.device, spec.rows
        self.rows = R
        self.lanes = _Buffer((R + 1,), np.int32, device)
        self.next_ids = _Buffer((1, R), np.int64, device)
        self.logits = _Buffer((1, R, cfg.vocab_size), np.float32, device)
        states = (_Buffer((1, R, cfg.hidden_size), dtype, device), _Buffer((1, R, cfg.hidden_size), dtype, device))
        self.states = states
        self.halves = (_CycleHalf(session, spec, kv, model, self, states[0], states[1]),
                       _CycleHalf(session, spec, kv, model, self, states[1], states[0]))
        self.turn = 0

    def load(self, token: int, positions: list[int]) -> None:
        host = self.lanes.host
        host[0] = token
        host[1:] = positions
        self.lanes.push()

    def execute(self, model: LoadedModel) -> bool:
        """Run the half whose input holds the last cycle's states; the next cycle runs the other."""
        steady = self.halves[self.turn].execute(model)
        self.turn ^= 1
        return steady

    def bound_objects(self) -> list[object]:
        bufs = [self.lanes, self.next_ids, self.logits, *self.states]
        return [x for b in bufs for x in (b.host, b.value)] + [h.binding for h in self.halves]


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
            raise ArtifactError(f"{model.path}: {manifest.dtype} artifacts need the CUDA device (the CPU "
                                "execution provider lacks kernels for these graphs); export fp32 for the CPU")
        cfg = model.config
        self.model = model
        self.max_length = manifest.max_length
        dtype = _NP_DTYPES[manifest.dtype]
        shape = (1, cfg.num_kv_heads, self.max_length, cfg.head_dim)
        self._kv = {s: (_Buffer(shape, dtype, model.device), _Buffer(shape, dtype, model.device))
                    for s in range(cfg.num_kv_slots)}
        # The batched kinds belong to a BatchGenerator (ort_runtime/batch_generator.py). A kind
        # whose session is still deferred (ort_runtime/session_table.py) is bound on first use.
        def bind(kind: str):
            if kind == CYCLE:  # the pipeline's: two bindings that hand the lanes' states to each other
                return CycleBinding(model.sessions[CYCLE], manifest.graphs[CYCLE], self._kv, model, dtype)
            cls = _RowsBinding if kind in TREE_KINDS else _KindBinding
            return cls(model.sessions[kind], manifest.graphs[kind], self._kv, model, dtype)

        self._kinds = _Bindings([k for k in model.sessions if k != CYCLE and k not in BATCH_KINDS], bind)
        self._cycle = _Bindings([CYCLE] if CYCLE in model.sessions else [], bind)
        pending = getattr(model.sessions, "pending", lambda kind: False)
        for kind in [*self._kinds.kinds, *self._cycle.kinds]:
            if not pending(kind):
                (self._cycle if kind == CYCLE else self._kinds)[kind]
        self._tokens: list[int] = []          # ids whose KV is committed; len == n
        self._move = None                     # CUDA: the op library's KV position copy (move_kv)
        self.step_counts: dict[str, int] = defaultdict(int)
        self.step_seconds: dict[str, float] = defaultdict(float)
        # Steady runs only (no warm-up/capture, no fallback set-up): what the cost gate averages.
        self.timed_counts: dict[str, int] = defaultdict(int)
        self.timed_seconds: dict[str, float] = defaultdict(float)
        # What the speculation gates learned on this generator ((gate, proposer, strategy) -> state),
        # carried from one generation to the next like the step timers.
        self.gate_memory: dict[tuple[str, str, str], dict] = {}

    # -- state -------------------------------------------------------------------------------
    @property
    def n(self) -> int:
        return len(self._tokens)

    @property
    def tokens(self) -> list[int]:
        return list(self._tokens)

    def rewind(self, n: int) -> None:
        """Forget everything after the first ``n`` committed tokens. Never copies KV."""
        if not 0 <= n <= self.n:
            raise RequestError(f"rewind({n}) outside 0..{self.n} (the committed length)")
        del self._tokens[n:]

    def commit(self, ids: list[int]) -> None:
        """Declare that the KV of ``ids`` at positions n.. has been written by a step."""
        if self.n + len(ids) > self.max_length:
            raise RequestError(f"commit past the KV capacity {self.max_length}")
        self._tokens.extend(int(t) for t in ids)

    @property
    def cycle(self) -> CycleBinding | None:
        """The pipeline's cycle binding (made on first use where its session is deferred)."""
        # dict.get first: the pipeline reads this three times a cycle
        return dict.get(self._cycle, CYCLE) or (self._cycle[CYCLE] if CYCLE in self._cycle else None)

    def has_kind(self, kind: str) -> bool:
        return kind in self._kinds or kind in self._cycle

    def rows(self, kind: str) -> int | None:
        return self.model.manifest.graphs[kind].rows

    def kv_arrays(self, slot: int) -> tuple[np.ndarray, np.ndarray]:
        """Host copies of one slot's K and V buffers ``[1, H_kv, S_max, D]`` (for checks)."""
        key, value = self._kv[slot]
        return key.pull().copy(), value.pull().copy()

    def graph_slots(self) -> dict[str, dict]:
        """Per kind: this generator's CUDA-graph counters (empty when nothing is captured)."""
        slots = {kind: kb.slot.as_dict() for kind, kb in sorted(self._kinds.items()) if kb.slot is not None}
        if CYCLE in self._cycle.made():
            slots.update({f"{CYCLE}/{i}": h.slot.as_dict() for i, h in enumerate(self.cycle.halves)
                          if h.slot is not None})
        return slots

    def bound_objects(self) -> list[object]:
        objs = [x for k, v in self._kv.values() for x in (k.host, k.value, v.host, v.value)]
        for kind in sorted(self._kinds.made()):
            objs += self._kinds[kind].bound_objects()
        if CYCLE in self._cycle.made():
            objs += self.cycle.bound_objects()
        return objs

    # -- steps (write KV at positions start.., never move n) ---------------------------------
    def run(self, kind: str, start: int, *, tokens: list[int] | None = None,
            hidden: np.ndarray | None = None, want_logits: bool = True) -> StepOutput:
        """Run one graph over rows at positions ``start..``; padded rows repeat the last input.

        ``next_ids`` is a copy; ``logits`` is a view of the bound buffer that the next step
        overwrites (``want_logits=False`` skips the device→host copy on CUDA).
        """
        kb = self._kinds[kind]
        if kind in TREE_KINDS:
            raise RequestError(f"{kind} rows carry their own addresses: run it with run_rows()")
        used = len(tokens) if tokens is not None else hidden.shape[0]
        rows = kb.spec.rows or used
        if used < 1 or used > rows:
            raise RequestError(f"{kind} takes 1..{rows} rows, got {used}")
        if start + rows > self.max_length:
            raise RequestError(f"{kind} at position {start} with {rows} rows passes the KV capacity "
                               f"{self.max_length}")
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
        self._execute(kind, kb)
        out_rows = 1 if kind == PREFILL else used
        next_ids = kb.next_ids.pull()[0, :out_rows].copy()
        logits = kb.logits.pull()[0, :out_rows] if want_logits or kb.logits.device == "cpu" else None
        if kind == DRAFT:
            return StepOutput(next_ids, logits, kb.hidden_out.pull()[0].copy(), float(kb.gap.pull()[0, 0]))
        return StepOutput(next_ids, logits)

    def _execute(self, kind: str, runner) -> None:
        t0 = time.perf_counter()
        steady = runner.execute(self.model)
        elapsed = time.perf_counter() - t0
        self.step_seconds[kind] += elapsed
        self.step_counts[kind] += 1
        if steady:
            self.timed_seconds[kind] += elapsed
            self.timed_counts[kind] += 1

    def run_rows(self, kind: str, addresses: list[tuple[int, int, int]], *, tokens: list[int] | None = None,
                 hidden: np.ndarray | None = None, want_logits: bool = False) -> StepOutput:
        """Run a tree kind over rows at their own addresses (cache position, masked lo, masked hi):
        row i writes its KV at its position and attends to keys 0..position outside [lo, hi),
        rotated at its position less the masked keys below it (docs/architecture.md §5,
        "Alternate suffix"). Rows past ``addresses`` are inactive: they write nothing."""
        kb = self._kinds[kind]
        used, rows = len(addresses), kb.spec.rows
        if not 1 <= used <= rows or used != (len(tokens) if tokens is not None else len(hidden)):
            raise RequestError(f"{kind} takes 1..{rows} rows, one address each; got {used} addresses")
        for p, lo, hi in addresses:
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
        return StepOutput(next_ids, logits, kb.hidden_out.pull()[0, :used].copy(),
                          top2_ids=kb.top2_ids.pull()[0, 0].copy(), top2_probs=kb.top2_probs.pull()[0, 0].copy())

    def move_kv(self, src: int, dst: int, count: int) -> None:
        """Copy the K and V of positions src..src+count-1 to dst.. in every slot: a surviving
        branch's rows, written at scratch positions, into place (already rotated at their logical
        positions, so the copy is exact). 2 · slots · H_kv · count · D values: a host memcpy on the
        CPU, one device copy per buffer on CUDA (the op library's loopcast_cuda_move_positions)."""
        if min(src, dst) < 0 or max(src, dst) + count > self.max_length or (src < dst + count and dst < src + count):
            raise RequestError(f"move_kv({src}, {dst}, {count}): ranges must be disjoint and inside the KV "
                               f"capacity {self.max_length}")
        if self.model.device == "cpu":
            for key, value in self._kv.values():
                for buf in (key, value):
                    buf.host[:, :, dst:dst + count] = buf.host[:, :, src:src + count]
            return
        move, cfg = self._device_move(), self.model.config
        row_bytes = cfg.head_dim * np.dtype(_NP_DTYPES[self.model.manifest.dtype]).itemsize
        for key, value in self._kv.values():
            for buf in (key, value):
                code = move(buf.value.data_ptr(), cfg.num_kv_heads, self.max_length, row_bytes, src, dst, count, None)
                if code:
                    raise ArtifactError(f"moving KV positions on {self.model.device} failed (CUDA error {code})")

    def _device_move(self):
        """The op library's device copy (already loaded by the sessions: the graphs that write
        branch rows need it, so it passed the trust rule, docs/trust.md)."""
        if self._move is None:
            import ctypes

            from loopcast.manifest import resolve_inside
            manifest = self.model.manifest
            if not manifest.custom_op_library:
                raise RequestError("moving KV on the device needs the artifact's custom-op library")
            path = resolve_inside(self.model.path, manifest.custom_op_library, "custom-op library").resolve()
            fn = getattr(ctypes.CDLL(str(path)), "loopcast_cuda_move_positions", None)
            if fn is None:
                raise RequestError(f"{path}: this op library has no device KV move; re-export the artifact "
                                   "with this loopcast")
            fn.argtypes = [ctypes.c_void_p] + [ctypes.c_int64] * 6 + [ctypes.c_void_p]
            fn.restype = ctypes.c_int
            self._move = fn
        return self._move

    def run_cycle(self, token: int, positions: list[int]) -> np.ndarray:
        """One pipeline cycle (docs/architecture.md §5): the lane entering loop 0 reads ``token``;
        row r runs loop r at ``positions[r]`` (-1: no lane). Returns each row's argmax [R]."""
        cycle = self.cycle
        if min(positions) < -1 or max(positions) >= self.max_length:
            raise RequestError(f"cycle rows at positions {positions} outside the KV capacity {self.max_length}")
        cycle.load(token, positions)
        self._execute(CYCLE, cycle)
        return cycle.next_ids.pull()[0]

    # -- committing steps --------------------------------------------------------------------
    def prefill(self, ids: list[int], chunk: int | None = None) -> int:
        """Write ``ids`` at n.. (in chunks of ``chunk`` rows if given), commit, return the next token."""
        if not ids:
            raise RequestError("prompt is empty: give at least one token")
        if PREFILL not in self._kinds:
            raise RequestError("this model was opened without the prefill graph (kinds=...); "
                               "generation needs it")
        chunk = chunk or len(ids)
        out = None
        for i in range(0, len(ids), chunk):
            part = ids[i:i + chunk]
            out = self.run(PREFILL, self.n, tokens=part, want_logits=False)
            self.commit(part)
        return int(out.next_ids[-1])

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
            raise RequestError(f"prompt of {len(ids)} tokens after {self.n} committed ones is longer than "
                               f"the max length {self.max_length}")

