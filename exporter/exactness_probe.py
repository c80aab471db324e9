"""Whether an artifact's verify rows are its decode rows on the CPU, measured on a shallow twin.

Row invariance is a property of each op's kernel at the op's shapes: a row's result must not
depend on how many rows share the call. Every layer of a stack is the same ops at the same
shapes (MatMul [M, H] x [H, N], the attention op over one KV slot, the norms), so a twin of the
artifact with the first ``layers`` layers of each stack (prelude, core, coda), every loop, the
embedding, loop-norm and head runs every kernel path the full graphs run, at their shapes and
with the same thread pool, on the artifact's own weights: two layers also keep the
layer-to-layer boundary that graph fusions see (residual add + next norm). The twin's graphs
are built with the artifact's op set and point into the artifact's own weights file (a hard
link), so loading it prepacks about ``layers / L`` of the weights instead of all of them
(SmolLM-135M shapes: 2 of 30 layers plus the head) and every step is that much cheaper.

    full artifact:  embed → [L layers] × R → norm → head     (what the runtime loads)
    twin:           embed → [2 layers] × R → norm → head     (same ops, shapes, op set, weights)

The exporter records the twin's answer as ``exact_verify["cpu"]``; ``rows_match_on_cpu`` on the
full artifact remains the reference (tests/exporter/test_exactness_probe.py checks that the two
agree on exact and on inexact artifacts).
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from pathlib import Path

import onnx_ir as ir
from loopcast.graphs.builder import GraphBuilder, weight_refs
from loopcast.graphs.kinds import build_kind

from loopcast.manifest import (
    MANIFEST_FILE,
    FileRecord,
    Manifest,
    sampled_sha256,
    sha256_file,
)
from loopcast.quant import quantized_linears
from loopcast.vocab import BATCH_KINDS, TREE_KINDS, graph_plan

_IR_DTYPES = {"fp32": ir.DataType.FLOAT, "fp16": ir.DataType.FLOAT16, "bf16": ir.DataType.BFLOAT16}
PROBE_DIR = ".exactness-probe"


def shallow_config(config, layers: int = 2):
    """``config`` with at most ``layers`` layers in each stack (the loops are kept)."""
    return dataclasses.replace(
        config,
        num_layers=min(config.num_layers, layers),
        num_prelude_layers=min(config.num_prelude_layers, layers),
        num_coda_layers=min(config.num_coda_layers, layers),
    )


def rows_match_shallow(
    artifact_dir: str | Path, layers: int = 2, *, manifest: Manifest | None = None
) -> bool:
    """``rows_match_on_cpu`` of the artifact's shallow twin (the artifact's own graphs when it is
    no deeper than the twin). ``manifest``: the artifact's, when its manifest.json is not written
    yet (the exporter probes its staging directory first and writes the manifest once, with the
    answer). The twin lives in a directory of its own inside the artifact, on hard links of the
    artifact's files (copies where the file system has no hard links), and is removed after."""
    from loopcast.exporter.weights import read_stored
    from loopcast.ort_runtime.decoding.exactness import rows_match_on_cpu

    path = Path(artifact_dir)
    manifest = manifest if manifest is not None else Manifest.read(path)
    config = manifest.config
    shallow = shallow_config(config, layers)
    probe = path / PROBE_DIR
    shutil.rmtree(probe, ignore_errors=True)
    probe.mkdir()
    try:
        linked = [manifest.weights_file] + (
            [manifest.custom_op_library] if manifest.custom_op_library else []
        )
        if shallow == config:  # the artifact's own graphs (the batched kinds are not declared)
            # (nor the static-depth graphs: their rows are the full-depth graphs' code at fewer loops)
            graphs = {
                key: spec
                for key, spec in manifest.graphs.items()
                if key not in BATCH_KINDS and "@" not in key
            }
            linked += [spec.file for spec in graphs.values()]
        for name in linked:
            _link(path / name, probe / name)
        if shallow != config:
            graphs = _build_twin(manifest, shallow, path, probe, read_stored)
        twin = dataclasses.replace(
            manifest,
            model=shallow.to_hf_dict(),
            graphs=graphs,
            tokenizer_files=[],
            genai_files=[],
            kv_layout={**manifest.kv_layout, "slots": shallow.num_kv_slots},
            exact_verify={},
            max_batch=None,
            exit_depths=[],
        )  # the batched kinds are not part of what exact_verify declares
        names = [spec.file for spec in graphs.values()] + [manifest.weights_file]
        names += [manifest.custom_op_library] if manifest.custom_op_library else []
        # A linked file is the artifact's own: its recorded hash stands.
        files = {
            name: manifest.files[name]
            if name in linked and name in manifest.files
            else FileRecord(
                (probe / name).stat().st_size, sha256_file(probe / name), sampled_sha256(probe / name)
            )
            for name in names
        }
        (probe / MANIFEST_FILE).write_text(dataclasses.replace(twin, files=files).to_json())
        return rows_match_on_cpu(probe)
    finally:
        shutil.rmtree(probe, ignore_errors=True)


def _build_twin(manifest: Manifest, shallow, path: Path, probe: Path, read_stored) -> dict:
    """The twin's graphs, built with the artifact's op set on the artifact's weights file."""
    dtype = _IR_DTYPES[manifest.dtype]
    refs = weight_refs(read_stored(path / manifest.weights_file))
    # the artifact's quantized matrices, read through the same MatMulNBits nodes (the twin's
    # first layers are the artifact's, so their names and shapes agree)
    quantized = quantized_linears(shallow, manifest.quantization, manifest.attention_head_size)
    graphs = {}
    for plan in graph_plan(
        shallow,
        manifest.op_set,
        verify_width=manifest.verify_width,
        draft_depth=manifest.draft_depth,
        tree=any(kind in manifest.graphs for kind in TREE_KINDS),
    ):
        model, spec = build_kind(
            plan,
            shallow,
            dtype,
            manifest.max_length,
            GraphBuilder(
                refs, manifest.weights_file, probe, quantized, head_size=manifest.attention_head_size
            ),
            op_set=manifest.op_set,
        )
        ir.save(model, probe / spec.file)
        graphs[plan.kind] = spec
    return graphs


def _link(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)
    except OSError:  # e.g. a file system without hard links
        shutil.copy(src, dst)
