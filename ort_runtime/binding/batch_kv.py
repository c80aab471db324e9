"""The batch generators' shared pieces: a step's output, the device KV buffer, binding helpers.

ort_runtime/binding/batch_generator.py and recurrent_batch_generator.py keep every KV buffer as
one ``[max_batch, H_kv, S_max, D]`` array and bind batch entries of it by address (a pointer and
a shape), so slot b's entry is bound without a copy.
"""

from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np
import onnxruntime as ort
from loopcast.ort_runtime.binding.bindings import _ONNX_BFLOAT16

from loopcast.errors import ArtifactError, RequestError

BF16 = np.dtype(ml_dtypes.bfloat16)


@dataclass(frozen=True)
class BatchStepOutput:
    next_ids: dict[int, int]  # slot -> argmax of its row
    logits: dict[int, np.ndarray] | None  # slot -> [V] float32 row (copies), when asked
    hidden: dict[int, np.ndarray] | None = None  # draft rows: slot -> [H] depth-d state (copies)


class DeviceKV:
    """A KV buffer on the GPU without a host mirror (a generator's ``_Buffer`` keeps one; for
    max_batch sequences that would be gigabytes of host memory copied once for nothing). Left
    uninitialised: a row reads only positions its sequence (or its dummy row) has written."""

    def __init__(self, shape: tuple[int, ...], dtype, device: str) -> None:
        self.device, self.dtype = device, np.dtype(dtype)
        self.value = ort.OrtValue.ortvalue_from_shape_and_type(list(shape), bind_type(self.dtype), device, 0)

    def pull(self) -> np.ndarray:
        if self.dtype != BF16:
            return self.value.numpy()
        host = np.empty(self.value.shape(), BF16)  # ORT's numpy bridge has no bf16: raw bits
        mirror = ort.OrtValue.ortvalue_from_numpy_with_onnx_type(host.view(np.uint16), _ONNX_BFLOAT16)
        mirror.update_inplace(self.value)
        return host


def bind_type(dtype: np.dtype):
    """The element type IOBinding takes for a buffer: bf16 as its ONNX type number (ORT's numpy
    bridge has no bf16), anything else as its numpy type."""
    return _ONNX_BFLOAT16 if dtype == BF16 else dtype.type


def entry_ptr(buf, offset_bytes: int = 0) -> int:
    """The address ``offset_bytes`` into a buffer's memory (its host array, or its device value)."""
    base = buf.host.ctypes.data if buf.device == "cpu" else buf.value.data_ptr()
    return base + offset_bytes


def slots_of(model, needed: tuple[str, ...], marker: str, what: str, max_batch: int | None) -> int:
    """The slots a batch generator of ``model`` holds (``max_batch``, None: the artifact's
    --max-batch), after checking that its sessions hold the ``needed`` kinds (``marker``: the
    batched kind an artifact without --max-batch lacks) and that its dtype runs on its device."""
    manifest = model.manifest
    missing = [str(kind) for kind in needed if kind not in model.sessions]
    if missing:
        have = (
            "no batched graphs (export with --max-batch B)"
            if marker not in manifest.graphs
            else "them not opened (kinds=...)"
        )
        raise ArtifactError(
            f"{model.path}: {what} needs the {', '.join(missing)} graphs; this artifact has {have}"
        )
    if manifest.dtype != "fp32" and model.device == "cpu":
        raise ArtifactError(f"{model.path}: {manifest.dtype} artifacts need the CUDA device")
    limit = manifest.max_batch or 1
    slots = limit if max_batch is None else max_batch
    if isinstance(slots, bool) or not isinstance(slots, int) or not 1 <= slots <= limit:
        raise RequestError(f"max_batch must be in 1..{limit} (the artifact's --max-batch), got {max_batch}")
    return slots
