"""A graph kind's IO binding: fixed buffers bound once, one captured CUDA graph slot per binding.

Everything a step touches is allocated when the binding is made (docs/architecture.md §5): the
KV buffers are bound as both past and present of every graph that reads the slot (the attention
op updates them in place), and a step only writes its inputs into the bound buffers and runs.
Running (eager, or capture / replay with the eager fallback) is the binding's
``CapturedRunner`` (ort_runtime/binding/graph_runner.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np
import onnxruntime as ort
from loopcast.ort_runtime.binding.graph_runner import CapturedRunner, GraphSlot
from loopcast.ort_runtime.loading import device_memory
from loopcast.ort_runtime.loading.artifact import LoadedModel

from loopcast.manifest import DRAFT, LOGIT_ROWS, LOGIT_START, PREFILL, TREE_DRAFT, GraphSpec
from loopcast.vocab import GraphKind

EXITS = GraphKind.EXITS

_NP_DTYPES = {"fp32": np.float32, "fp16": np.float16, "bf16": ml_dtypes.bfloat16}
_ONNX_BFLOAT16 = 16  # TensorProto.BFLOAT16: ORT's numpy bridge has no bf16, so bf16 moves as raw uint16
_EXACT_BYTES = (
    1 << 20
)  # device buffers from this size on get exact allocations (ort_runtime/loading/device_memory.py)


def run_bound(binding: ort.IOBinding, run, inputs: dict, outputs: list[str], device: str) -> list:
    """Bind ``inputs`` (OrtValues as they are, numpy arrays from the host) and ``outputs`` (on
    ``device``: "cpu" for what the host reads, such as a coda's ids and logits), call ``run()``
    (the session's run_with_iobinding of ``binding``), and return the new outputs (the present
    KV, bound first, come before them)."""
    for name, value in inputs.items():
        if isinstance(value, ort.OrtValue):
            binding.bind_ortvalue_input(name, value)
        else:
            binding.bind_cpu_input(name, value)
    for name in outputs:
        binding.bind_output(name, device)
    run()
    values = binding.get_outputs()
    return list(values[len(values) - len(outputs) :])


def host_copy(value: ort.OrtValue | np.ndarray) -> np.ndarray:
    """A host copy of a state in its own dtype (bf16 through its bits: ORT's numpy bridge has none)."""
    if isinstance(value, np.ndarray):
        return value.copy()
    if value.data_type() == "tensor(bfloat16)":
        bits = np.empty(value.shape(), np.uint16)
        ort.OrtValue.ortvalue_from_numpy_with_onnx_type(bits, _ONNX_BFLOAT16).update_inplace(value)
        return bits.view(ml_dtypes.bfloat16)
    array = value.numpy()
    return array.view(ml_dtypes.bfloat16) if array.dtype == np.uint16 else array.copy()


def _logit_rows_input(session: ort.InferenceSession, rows: int) -> tuple[str, ort.OrtValue]:
    """The prefill input that asks for logits of the last ``rows`` rows: ``logit_start`` = -rows,
    or ``logit_rows`` = rows in graphs exported before it."""
    names = {v.name for v in session.get_overridable_initializers()}
    name, value = (LOGIT_START, -rows) if LOGIT_START in names else (LOGIT_ROWS, rows)
    return name, ort.OrtValue.ortvalue_from_numpy(np.array([value], np.int64))


class _Buffer:
    """A fixed host array and the OrtValue bound to it (on CPU they share memory)."""

    def __init__(self, shape: tuple[int, ...], dtype, device: str) -> None:
        self.host = np.zeros(shape, dtype)
        self.device = device
        bf16 = np.dtype(dtype) == np.dtype(ml_dtypes.bfloat16)
        self._raw = self.host.view(np.uint16) if bf16 else self.host
        self._mirror = (
            ort.OrtValue.ortvalue_from_numpy_with_onnx_type(self._raw, _ONNX_BFLOAT16) if bf16 else None
        )
        if device == "cpu":
            self.value = self._mirror if bf16 else ort.OrtValue.ortvalue_from_numpy(self.host)
        elif self.host.nbytes >= _EXACT_BYTES and device_memory.available():
            # KV buffers: exact allocations (ORT's arena would grow in powers of two)
            onnx_type = _ONNX_BFLOAT16 if bf16 else device_memory.onnx_type_of(dtype)
            self.value = device_memory.device_value(shape, onnx_type, self._raw)
        else:
            self.value = ort.OrtValue.ortvalue_from_shape_and_type(
                shape, _ONNX_BFLOAT16 if bf16 else dtype, "cuda", 0
            )
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


@dataclass(frozen=True)
class StepOutput:
    next_ids: np.ndarray  # [rows] int64, argmax of each row
    logits: np.ndarray | None  # [rows, V] float32, a view of the bound buffer (None: not pulled)
    hidden: np.ndarray | None = None  # draft only: [1, H] state at the draft depth
    top2_gap: float | None = None  # draft only
    top2_ids: np.ndarray | None = None  # tree_draft only: [2] the two most likely tokens
    top2_probs: np.ndarray | None = None  # tree_draft only: [2] their softmax probabilities
    gates: np.ndarray | None = None  # exits only: [R] each loop's exit-gate logit


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

    variable_rows = False  # runs only the rows a call passes (bind_rows); fixed width otherwise

    def __init__(
        self,
        session: ort.InferenceSession,
        spec: GraphSpec,
        kv: dict[int, tuple[_Buffer, _Buffer]],
        model: LoadedModel,
        dtype,
        key: str | None = None,
    ) -> None:
        cfg, device = model.config, model.device
        self.spec = spec
        self.key = key or spec.kind  # the manifest's name: the kind, or kind@k (static depth)
        rows = spec.rows or 1
        # prefill: the last row; exits: the head of every loop of its one row
        out_rows = 1 if spec.kind == PREFILL else cfg.num_loops if spec.kind == EXITS else rows
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
        self.gates = _Buffer((1, cfg.num_loops), np.float32, device) if spec.kind == EXITS else None
        # verify on prefill's session (the CPU: ort_runtime/loading/artifact.py) asks for logits of its
        # last rows: all of them (decode's one row is the default)
        self.logit_rows: tuple[str, ort.OrtValue] | None = None
        if model.shared_sessions.get(self.key, "").partition("@")[0] == PREFILL and rows > 1:
            self.logit_rows = _logit_rows_input(session, rows)
        # Prefill's session takes any row count, so a verify on it runs only the rows a round
        # uses (a round of k drafts costs k + 1 rows, not the width): the same computation at
        # fewer rows, which the kernels keep row-invariant (exact_verify probes every count). Not
        # where a graph is captured: it bakes in its shapes, and its fallback binds the full width.
        self._row_views: dict[int, list[tuple[str, ort.OrtValue]]] = {}
        self._bound_rows = rows
        self._kv = kv
        self._open(session, model)
        self.variable_rows = self.logit_rows is not None and device == "cpu" and self.slot is None

    def bind_rows(self, used: int) -> None:
        """A variable-rows binding: bind the first ``used`` rows of the fixed buffers (views,
        made once per row count) as the ids, the logit rows and the outputs."""
        if used == self._bound_rows:
            return
        views = self._row_views.get(used)
        if views is None:
            views = [
                ("input_ids_BS", ort.OrtValue.ortvalue_from_numpy(self.ids.host[:, :used])),
                _logit_rows_input(self.session, used),
                ("next_token_ids_BS", ort.OrtValue.ortvalue_from_numpy(self.next_ids.host[:, :used])),
                ("logits_BSV", ort.OrtValue.ortvalue_from_numpy(self.logits.host[:, :used])),
            ]
            self._row_views[used] = views
        binding = self.binding
        for name, value in views[:2]:
            binding.bind_ortvalue_input(name, value)
        for name, value in views[2:]:
            binding.bind_ortvalue_output(name, value)
        self._bound_rows = used

    def _open(self, session: ort.InferenceSession, model: LoadedModel) -> None:
        """The runner: the session, an IO binding of this binding's buffers and, when the kind is
        captured, a graph id from the kind's pool (returned when the runner is closed or dropped)."""
        kind = getattr(self, "key", self.spec.kind)  # the cycle's halves carry no key of their own
        captured = kind in model.graph_kinds
        self.runner = CapturedRunner(
            kind,
            session,
            self._bind,
            pool=model.graph_ids(kind) if captured else None,
            eager_session=lambda: model.eager_session(kind),
        )

    @property
    def session(self) -> ort.InferenceSession:
        return self.runner.session

    @property
    def binding(self) -> ort.IOBinding:
        return self.runner.binding

    @property
    def slot(self) -> GraphSlot | None:
        return self.runner.slot

    def _bind(self, b: ort.IOBinding) -> None:
        spec, kv = self.spec, self._kv
        if self.ids is not None and spec.rows is not None:
            b.bind_ortvalue_input("input_ids_BS", self.ids.value)
        if self.hidden is not None:
            b.bind_ortvalue_input("hidden_BSH", self.hidden.value)
        b.bind_ortvalue_input("seqlens_k", self.seqlens.value)
        b.bind_ortvalue_input("total_sequence_length", self.total.value)
        if self.logit_rows is not None:
            b.bind_ortvalue_input(*self.logit_rows)
        _bind_kv(b, kv, spec.kv_slots)
        b.bind_ortvalue_output("next_token_ids_BS", self.next_ids.value)
        b.bind_ortvalue_output("logits_BSV", self.logits.value)
        if self.gap is not None:
            b.bind_ortvalue_output("top2_gap_BS", self.gap.value)
            b.bind_ortvalue_output("hidden_BSH_out", self.hidden_out.value)
        if self.gates is not None:
            b.bind_ortvalue_output("exit_gates_BR", self.gates.value)

    def bound_objects(self) -> list[object]:
        """Every buffer this binding holds (tests assert they never change identity)."""
        bufs = [
            self.ids,
            self.hidden,
            self.seqlens,
            self.total,
            self.next_ids,
            self.logits,
            self.gap,
            self.hidden_out,
        ]
        return [x for b in bufs if b is not None for x in (b.host, b.value)] + [self.binding]

    def execute(self, model: LoadedModel | None = None) -> bool:
        """Run once (the runner holds its sessions; ``model`` is not needed). Returns whether the
        run was a steady one, which the cost measurements keep (graph_runner.py)."""
        return self.runner.run()

    def close(self) -> None:
        """Give this binding's graph id back to its pool; the binding cannot run after."""
        self.runner.close()


class _RowsBinding(_KindBinding):
    """A tree kind (docs/architecture.md §5, "Alternate suffix"): rows carry their own address
    (cache position, masked key range) in one int32 input instead of the step's lengths."""

    def __init__(
        self,
        session: ort.InferenceSession,
        spec: GraphSpec,
        kv: dict[int, tuple[_Buffer, _Buffer]],
        model: LoadedModel,
        dtype,
    ) -> None:
        cfg, device, rows = model.config, model.device, spec.rows
        self.spec = spec
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
        self._open(session, model)

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
        bufs = [
            self.ids,
            self.hidden,
            self.address,
            self.next_ids,
            self.logits,
            self.hidden_out,
            self.top2_probs,
            self.top2_ids,
        ]
        return [x for b in bufs if b is not None for x in (b.host, b.value)] + [self.binding]
