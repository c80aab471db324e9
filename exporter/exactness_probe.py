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
from loopcast.graphs.builder import GraphBuilder, WeightRef
from loopcast.graphs.kinds import build_kind, plan_kinds

from loopcast.manifest import (
    CYCLE_RUN,
    MANIFEST_FILE,
    TREE_TAIL,
    FileRecord,
    Manifest,
    sampled_sha256,
    sha256_file,
)

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


def rows_match_shallow(artifact_dir: str | Path, layers: int = 2) -> bool:
    """``rows_match_on_cpu`` of the artifact's shallow twin (the full check when the artifact
    is no deeper than the twin, or when its weights file cannot be hard-linked)."""
    from loopcast.exporter.weights import read_stored
    from loopcast.ort_runtime.decoding.exactness import rows_match_on_cpu

    path = Path(artifact_dir)
    manifest = Manifest.read(path)
    config = manifest.config
    shallow = shallow_config(config, layers)
    if shallow == config:
        return rows_match_on_cpu(path)
    probe = path / PROBE_DIR
    shutil.rmtree(probe, ignore_errors=True)
    probe.mkdir()
    try:
        try:
            os.link(path / manifest.weights_file, probe / manifest.weights_file)
        except OSError:
            return rows_match_on_cpu(path)  # e.g. a file system without hard links
        if manifest.custom_op_library:
            os.link(path / manifest.custom_op_library, probe / manifest.custom_op_library)
        dtype = _IR_DTYPES[manifest.dtype]
        refs = {
            name: WeightRef(name, dtype, t.shape, t.offset, t.length)
            for name, t in read_stored(path / manifest.weights_file).items()
        }
        graphs = {}
        for plan in plan_kinds(
            shallow,
            manifest.verify_width,
            manifest.draft_depth,
            op_set=manifest.op_set,
            tree=TREE_TAIL in manifest.graphs,
        ):
            if plan.kind == CYCLE_RUN:  # the cycle's rows are checked; the run repeats them
                continue
            model, spec = build_kind(
                plan,
                shallow,
                dtype,
                manifest.max_length,
                GraphBuilder(refs, manifest.weights_file, probe),
                op_set=manifest.op_set,
            )
            ir.save(model, probe / spec.file)
            graphs[plan.kind] = spec
        twin = dataclasses.replace(
            manifest,
            model=shallow.to_hf_dict(),
            graphs=graphs,
            tokenizer_files=[],
            genai_files=[],
            kv_layout={**manifest.kv_layout, "slots": shallow.num_kv_slots},
            exact_verify={},
            max_batch=None,
        )  # the batched kinds are not part of what exact_verify declares
        names = [spec.file for spec in graphs.values()] + [manifest.weights_file]
        names += [manifest.custom_op_library] if manifest.custom_op_library else []
        # The weights file is the artifact's own (a hard link): its recorded hash stands.
        recorded = manifest.files.get(manifest.weights_file)
        files = {
            name: (
                FileRecord(
                    (probe / name).stat().st_size,
                    recorded.sha256,
                    sampled_sha256(probe / name),
                    recorded.hash,
                )
                if recorded and name == manifest.weights_file
                else FileRecord(
                    (probe / name).stat().st_size, sha256_file(probe / name), sampled_sha256(probe / name)
                )
            )
            for name in names
        }
        (probe / MANIFEST_FILE).write_text(dataclasses.replace(twin, files=files).to_json())
        return rows_match_on_cpu(probe)
    finally:
        shutil.rmtree(probe, ignore_errors=True)
