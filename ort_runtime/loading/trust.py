"""The trust rule for an artifact's native code (docs/trust.md, docs/architecture.md §4).

An artifact's ``custom_op_library`` is loaded only when all of these hold:

1. the graphs need it: the manifest lists custom ops *and* some graph has a node of the
   ``loopcast`` domain (read from the ONNX file itself, not taken from the manifest);
2. it is a regular file inside the artifact (the resolved path is checked, so a symlink that
   leaves the directory is refused; ``Manifest.read`` already refused absolute paths and ``..``);
3. its SHA-256 equals the one the manifest records;
4. the user trusts it: ``trust_ops=True`` (``--trust-ops``), or its hash is that of a library
   this user built locally (``loopcast build-ops`` or an export; see loopcast/ops_trust.py).

Otherwise nothing is loaded and the error says why; the library's constructors never run.
"""

from __future__ import annotations

from pathlib import Path

from loopcast.confined_files import GRAPH_MAX_BYTES, confined_file, open_regular
from loopcast.errors import ArtifactError
from loopcast.manifest import Manifest, sha256_file
from loopcast.ops_trust import locally_built_hashes

LOOPCAST_DOMAIN = b"loopcast"
_MODEL_GRAPH, _GRAPH_NODE, _NODE_DOMAIN = 7, 1, 7  # ModelProto.graph, GraphProto.node, NodeProto.domain


def _fields(buf: bytes, start: int = 0, end: int | None = None):
    """(field number, wire type, value) of one protobuf message; LEN values as (start, end)."""
    pos, end = start, len(buf) if end is None else end
    while pos < end:
        key, pos = _varint(buf, pos)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = _varint(buf, pos)
        elif wire == 1:
            value, pos = None, pos + 8
        elif wire == 5:
            value, pos = None, pos + 4
        elif wire == 2:
            length, pos = _varint(buf, pos)
            value, pos = (pos, pos + length), pos + length
        else:
            raise ValueError(f"unsupported wire type {wire}")
        if pos > end:
            raise ValueError("truncated message")
        yield number, wire, value


def _varint(buf: bytes, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= len(buf) or shift > 63:
            raise ValueError("truncated varint")
        byte = buf[pos]
        result |= (byte & 0x7F) << shift
        pos, shift = pos + 1, shift + 7
        if not byte & 0x80:
            return result, pos


def uses_loopcast_domain(graph_file: Path, max_bytes: int = GRAPH_MAX_BYTES) -> bool:
    """Whether any node of the ONNX model's main graph belongs to the ``loopcast`` domain.
    A minimal protobuf walk (weights are external, so graph files are small): ``onnx`` is not a
    runtime dependency."""
    with open_regular(graph_file, "graph file") as f:  # a regular file; never blocks on a FIFO
        buf = f.read(max_bytes + 1)
    if len(buf) > max_bytes:
        raise ArtifactError(f"{graph_file}: graph file is larger than the {max_bytes} bytes it may have")
    try:
        for number, wire, value in _fields(buf):
            if number != _MODEL_GRAPH or wire != 2:
                continue
            for n_num, n_wire, node in _fields(buf, *value):
                if n_num != _GRAPH_NODE or n_wire != 2:
                    continue
                for f_num, f_wire, dom in _fields(buf, *node):
                    if f_num == _NODE_DOMAIN and f_wire == 2 and buf[dom[0] : dom[1]] == LOOPCAST_DOMAIN:
                        return True
    except (OSError, ValueError) as exc:
        raise ArtifactError(f"{graph_file}: not a readable ONNX model ({exc})") from None
    return False


def op_library_to_load(
    path: Path, manifest: Manifest, *, trust_ops: bool, kinds: tuple[str, ...] | None = None
) -> Path | None:
    """The resolved library path to register with every session, or None when the graphs need
    none. Raises ArtifactError when they need one that the rule above refuses."""
    library = manifest.custom_op_library
    if not library or not manifest.custom_ops:
        return None
    files = [
        (confined_file(path, spec.file, f"graph file for '{kind}'"), recorded_size(manifest, spec.file))
        for kind, spec in manifest.graphs.items()
        if kinds is None or kind in kinds
    ]
    if not any(uses_loopcast_domain(f, cap) for f, cap in files if f is not None):
        return None  # named but unused: never loaded
    target = confined_file(path, library, "custom-op library")
    assert target is not None
    resolved = target.resolve()
    record = manifest.files.get(library)
    if record is None:
        raise ArtifactError(
            f"{target}: the manifest records no SHA-256 for the custom-op library, so it is "
            "not loaded; re-export the artifact with this loopcast"
        )
    digest = sha256_file(resolved)
    if digest != record.sha256:
        raise ArtifactError(
            f"{target}: custom-op library SHA-256 {digest[:16]}… does not match the manifest's "
            f"{record.sha256[:16]}…; not loading it"
        )
    if not trust_ops and digest not in locally_built_hashes():
        raise ArtifactError(
            f"{target}: the graphs need this native custom-op library, which is not one you "
            "built (loopcast build-ops); loading it runs its code. Pass --trust-ops "
            "(trust_ops=True) only if you trust whoever made this artifact"
        )
    return resolved


def recorded_size(manifest: Manifest, name: str) -> int:
    """The size the manifest records for ``name``: the most a reader reads of it."""
    record = manifest.files.get(name)
    return record.size if record is not None else GRAPH_MAX_BYTES
