"""A graph kind's IO binding: fixed buffers bound once, one captured CUDA graph slot per binding.

Everything a step touches is allocated when the binding is made (docs/architecture.md §5): the
KV buffers are bound as both past and present of every graph that reads the slot (the attention
op updates them in place), and a step only writes its inputs into the bound buffers and runs.
"""

from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np
import onnxruntime as ort
from loopcast.ort_runtime.loading import device_memory
from loopcast.ort_runtime.loading.artifact import LoadedModel

from loopcast.errors import ArtifactError
from loopcast.manifest import DRAFT, LOGIT_ROWS, PREFILL, TREE_DRAFT, GraphSpec

_NP_DTYPES = {"fp32": np.float32, "fp16": np.float16, "bf16": ml_dtypes.bfloat16}
_ONNX_BFLOAT16 = 16  # TensorProto.BFLOAT16: ORT's numpy bridge has no bf16, so bf16 moves as raw uint16
_EXACT_BYTES = (
    1 << 20
)  # device buffers from this size on get exact allocations (ort_runtime/loading/device_memory.py)


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
        return {
            "graph_id": self.graph_id,
            "warmups": self.warmups,
            "captures": self.captures,
            "replays": self.replays,
            "fallbacks": self.fallbacks,
            "failure": self.failure,
        }


@dataclass(frozen=True)
class StepOutput:
    next_ids: np.ndarray  # [rows] int64, argmax of each row
    logits: np.ndarray | None  # [rows, V] float32, a view of the bound buffer (None: not pulled)
    hidden: np.ndarray | None = None  # draft only: [1, H] state at the draft depth
    top2_gap: float | None = None  # draft only
    top2_ids: np.ndarray | None = None  # tree_draft only: [2] the two most likely tokens
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

    def __init__(
        self,
        session: ort.InferenceSession,
        spec: GraphSpec,
        kv: dict[int, tuple[_Buffer, _Buffer]],
        model: LoadedModel,
        dtype,
    ) -> None:
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
        # verify on prefill's session (the CPU: ort_runtime/loading/artifact.py) asks for logits of its
        # last ``logit_rows`` rows: all of them (decode's one row is the default)
        self.logit_rows = (
            ort.OrtValue.ortvalue_from_numpy(np.array([rows], np.int64))
            if model.shared_sessions.get(spec.kind) == PREFILL and rows > 1
            else None
        )
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
            raise ArtifactError(
                f"the '{self.spec.kind}' graph failed on its first run ({str(exc).splitlines()[0][:300]})"
            ) from None
        self.session, self.binding = session, binding
        self.slot.failure = reason
        self.slot.fallbacks += 1


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
