"""The attributes the loopcast ops index with, checked against the manifest at load.

``RowAttention`` (custom_ops/src/row_attention.h) picks the KV buffer pair row i reads and
writes by its ``row_buffers`` attribute, and reads the buffers with ``kv_num_heads`` heads. The
kernel checks both when it runs, but that is a generation's first step, long after load, and
its refusal is a raw ONNX Runtime error. So every loopcast-domain node whose attributes index
KV buffers is checked here when the artifact is opened: ``row_buffers`` names only pairs the
node is given (and each pair it is given), the pairs are KV buffers of the graph's manifest
slots, and ``kv_num_heads`` is the manifest's. A mismatch is an ArtifactError naming the graph
file, the node and the attribute.

On CUDA the attention kernels take only some shapes (``check_cuda_shapes``): the stored head
size (the exporter pads other heads: exporter/head_padding.py) and the KV length.
"""

from __future__ import annotations

import re
from pathlib import Path

import onnx

from loopcast.errors import ArtifactError
from loopcast.manifest import GraphSpec, Manifest
from loopcast.vocab import CUDA_ATTENTION_HEAD_DIMS, OpSet

LOOPCAST_DOMAIN = "loopcast"
ROW_ATTENTION_FIRST_KV = 6  # inputs 0..5: query, positions, sequences, masked_keys, cos, sin
_PAST = re.compile(r"past_(key|value)\.(\d+)$")
CUDA_ATTENTION_MAX_LENGTH = 49152  # the longest KV of the CUDA attention kernels (cuda_ops.cc)


def check_cuda_shapes(path: Path, manifest: Manifest) -> None:
    """Raise ArtifactError unless the loopcast attention ops' CUDA kernels take the artifact's
    stored head size (a padded head's, else head_dim) and max length."""
    head, padded = manifest.kv_head_size, manifest.attention_head_size is not None
    if OpSet(manifest.op_set).loopcast_attention and (
        head not in CUDA_ATTENTION_HEAD_DIMS or manifest.max_length > CUDA_ATTENTION_MAX_LENGTH
    ):
        raise ArtifactError(
            f"{path}: the CUDA BatchInvariantAttention kernel takes head size 16/32/64/128 and max "
            f"length <= {CUDA_ATTENTION_MAX_LENGTH} (this artifact: {head}"
            f"{f' (heads of {manifest.config.head_dim} padded)' if padded else ''}, {manifest.max_length})"
        )


def check_op_attributes(graph_file: Path, spec: GraphSpec, manifest: Manifest) -> None:
    """Raise ArtifactError when a loopcast op of ``graph_file`` indexes KV buffers that the
    manifest's layout for this graph does not have."""
    try:
        model = onnx.load(str(graph_file), load_external_data=False)
    except Exception as exc:  # protobuf raises several types for a damaged file
        raise ArtifactError(f"{graph_file}: not a readable ONNX graph ({exc})") from None
    slots = set(spec.kv_slots)
    for node in model.graph.node:
        if node.domain != LOOPCAST_DOMAIN or node.op_type != "RowAttention":
            continue
        where = f"{graph_file}: node {node.name or node.op_type}"
        attrs = {a.name: a for a in node.attribute}
        heads = attrs.get("kv_num_heads")
        if heads is None or heads.i != manifest.config.num_kv_heads:
            raise ArtifactError(
                f"{where}: attribute kv_num_heads is {heads.i if heads is not None else 'missing'}, "
                f"the manifest's KV layout has {manifest.config.num_kv_heads} KV heads"
            )
        kv = list(node.input[ROW_ATTENTION_FIRST_KV:])
        pairs = len(kv) // 2
        if len(kv) % 2 or not pairs:
            raise ArtifactError(f"{where}: takes {len(kv)} KV buffers, expected (key, value) pairs")
        for name in kv:
            match = _PAST.match(name)
            if match is not None and int(match.group(2)) not in slots:
                raise ArtifactError(
                    f"{where}: KV input {name} is not a buffer of this graph's manifest slots {sorted(slots)}"
                )
        rows = list(attrs["row_buffers"].ints) if "row_buffers" in attrs else None
        if not rows:
            raise ArtifactError(f"{where}: attribute row_buffers is missing")
        bad = next((i for i, b in enumerate(rows) if not 0 <= b < pairs), None)
        if bad is not None:
            raise ArtifactError(
                f"{where}: attribute row_buffers[{bad}] = {rows[bad]} names no KV buffer pair "
                f"(the node is given {pairs}); the graph does not match the manifest's KV layout"
            )
        unused = sorted(set(range(pairs)) - set(rows))
        if unused:
            raise ArtifactError(f"{where}: attribute row_buffers names no row for KV pair {unused[0]}")
