"""One resident copy of the weights for every session of an artifact (docs/architecture.md, "Weights").

Each ORT session otherwise loads the initializers of its graph itself: on CUDA every session
holds its own device copy of every weight (an artifact with five kinds held five copies), and
on the CPU every session maps the weights file again. ``SessionOptions.add_initializer`` hands
a session an OrtValue to use for an initializer instead of the graph's data, and ORT uses that
value as given (no copy, wherever it lives), so values made once from ``weights.safetensors``
serve every session: on CUDA one device copy, on the CPU zero-copy views of one mapping.
ORT uses a supplied value only where it plans that initializer on the value's device, and
accepts only values whose buffer the caller owns (on CUDA: exact allocations of our own,
``ort_runtime/loading/device_memory.py``).

Not used where ORT prepacks: a prepacking kernel (the stock CPU MatMul) packs the shared value
into a private copy per session anyway, and the raw mapping then stays resident besides (measured:
docs/perf.md, "Run-time memory"). The loopcast ops read their weights as given and never prepack.

The artifact is untrusted input (docs/trust.md): a shared value must be exactly what ORT would
have loaded for that initializer. Every initializer a graph stores in the weights file is
checked against the file's header (same name, element type, shape, byte range) before any
value is handed over; a kernel reading a weight of another shape would read outside it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from loopcast.ort_runtime.loading import device_memory

from loopcast.errors import ArtifactError
from loopcast.manifest import WEIGHTS_FILE
from loopcast.safetensors_file import MappedFile, SafetensorsFormatError

_ONNX_BFLOAT16 = onnx.TensorProto.BFLOAT16  # ORT's numpy bridge has no bf16: bf16 moves as raw uint16
_ONNX_TYPE_OF_CODE = {
    "F32": onnx.TensorProto.FLOAT,
    "F16": onnx.TensorProto.FLOAT16,
    "BF16": _ONNX_BFLOAT16,
    "U8": onnx.TensorProto.UINT8,  # quantized weights (loopcast/quant.py)
}


@dataclass
class SharedWeights:
    """The OrtValues every session of one artifact gets for its stored weights."""

    values: dict[str, ort.OrtValue]
    device: str
    nbytes: int
    _mapping: MappedFile | None = None  # CPU values are views of this mapping: keep it alive
    _owners: list[ort.OrtValue] = field(default_factory=list)  # CUDA: the allocations the values view

    def add_to(self, options: ort.SessionOptions, names: set[str]) -> None:
        for name in sorted(names):
            options.add_initializer(name, self.values[name])


def stored_initializers(graph_file: Path) -> dict[str, tuple[int, tuple[int, ...], int, int]]:
    """name -> (element type, shape, offset, length) of every initializer the graph keeps in the
    weights file (the graph proto only; its external data is not read)."""
    try:
        model = onnx.load(str(graph_file), load_external_data=False)
    except Exception as exc:  # protobuf raises several types for a damaged file
        raise ArtifactError(f"{graph_file}: not a readable ONNX graph ({exc})") from None
    out = {}
    for tensor in model.graph.initializer:
        if tensor.data_location != onnx.TensorProto.EXTERNAL:
            continue
        info = {entry.key: entry.value for entry in tensor.external_data}
        if info.get("location") != WEIGHTS_FILE:
            continue  # ORT loads it itself (and refuses a location outside the artifact)
        try:
            offset, length = int(info.get("offset", 0)), int(info["length"])
        except (KeyError, ValueError):
            raise ArtifactError(
                f"{graph_file}: initializer {tensor.name} has no valid external-data offset and length"
            ) from None
        out[tensor.name] = (tensor.data_type, tuple(int(d) for d in tensor.dims), offset, length)
    return out


def load_shared_weights(
    artifact: Path, graph_files: list[Path], device: str
) -> tuple[SharedWeights, list[set[str]]]:
    """One value per stored weight that the graphs use, and each graph's names to share.

    Raises ArtifactError when a graph's view of a weight disagrees with the weights file."""
    weights_file = artifact / WEIGHTS_FILE
    try:
        mapping = MappedFile(weights_file)
    except (OSError, SafetensorsFormatError) as exc:
        raise ArtifactError(f"{weights_file}: unreadable weights file ({exc})") from None
    per_graph, wanted = [], {}
    for file in graph_files:
        names = set()
        for name, (elem, shape, offset, length) in stored_initializers(file).items():
            entry = mapping.entries.get(name)
            if entry is None:
                raise ArtifactError(f"{file}: initializer {name} is not in {WEIGHTS_FILE}")
            stored = (_ONNX_TYPE_OF_CODE.get(entry.dtype), entry.shape, entry.offset, entry.length)
            if stored != (elem, shape, offset, length):
                raise ArtifactError(
                    f"{file}: initializer {name} is {onnx.TensorProto.DataType.Name(elem)} "
                    f"{list(shape)} at bytes {offset}+{length}, but {WEIGHTS_FILE} holds "
                    f"{entry.dtype} {list(entry.shape)} at {entry.offset}+{entry.length}"
                )
            names.add(name)
            wanted[name] = entry
        per_graph.append(names)
    values, nbytes, owners = {}, 0, []
    for name in sorted(wanted):
        try:
            array = mapping.tensor(name)
        except SafetensorsFormatError as exc:
            raise ArtifactError(f"{weights_file}: {exc}") from None
        if device != "cpu":
            # read, not mapped: the host then holds one tensor at a time, not the whole file's pages
            entry = wanted[name]
            array = np.fromfile(weights_file, np.uint8, entry.length, offset=entry.offset).view(array.dtype)
            array = array.reshape(entry.shape)
        bf16 = wanted[name].dtype == "BF16"
        raw = array.view(np.uint16) if bf16 else array
        if device == "cpu":
            # A view of the read-only mapping: ORT reads it in place and never writes initializers.
            values[name] = (
                ort.OrtValue.ortvalue_from_numpy_with_onnx_type(raw, _ONNX_BFLOAT16)
                if bf16
                else ort.OrtValue.ortvalue_from_numpy(raw)
            )
        elif device_memory.available():
            # one exact allocation per weight, ours (add_initializer takes only caller-owned buffers)
            values[name] = device_memory.device_value(
                array.shape, _ONNX_TYPE_OF_CODE[wanted[name].dtype], raw
            )
        else:
            owner = ort.OrtValue.ortvalue_from_shape_and_type(
                list(array.shape), _ONNX_BFLOAT16 if bf16 else array.dtype, "cuda", 0
            )
            owner.update_inplace(np.ascontiguousarray(raw))
            # without the driver library: a DLPack view of ORT's (arena) allocation, kept alive
            # by ``owner``
            values[name] = ort.OrtValue.from_dlpack(owner)
            owners.append(owner)
        nbytes += wanted[name].length
    return SharedWeights(values, device, nbytes, mapping if device == "cpu" else None, owners), per_graph
