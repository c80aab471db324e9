"""``loopcast export model.gguf``: a GGUF file into an artifact (docs/architecture.md, "GGUF input").

The file's blocks become the artifact's quantized weights as they are (no float round trip;
the manifest's ``quantization`` says ``gguf`` and the block format), float tensors are written
in the artifact's dtype (and RTN-quantized only under ``--quantize``), and the tokenizer and chat
template are built from the metadata (exporter/gguf_tokenizer.py).
"""

from __future__ import annotations

import dataclasses
import tempfile
from pathlib import Path

from loopcast.exporter.export import (
    ExportOptions,
    ExportSource,
    _requested_op_set,
    check_supported,
    export_source,
    prepare_output,
)
from loopcast.exporter.gguf_source import GGUFSource
from loopcast.exporter.gguf_tokenizer import write_tokenizer

from loopcast.errors import ExportError
from loopcast.manifest import Manifest
from loopcast.vocab import OpSet


def export_gguf(
    path: Path,
    out_dir: str | Path,
    options: ExportOptions,
    *,
    progress: bool = False,
    overwrite: bool = False,
) -> Manifest:
    source = GGUFSource(path)
    if source.scheme is not None:
        if options.quantization is not None:
            raise ExportError(
                f"{path}: --quantize: the file's layers are already quantized "
                f"({source.scheme.describe()}); export it without --quantize"
            )
        if source.scheme.float_zero_points and options.op_set == OpSet.LOOPCAST and options.dtype != "fp32":
            raise ExportError(
                f"{path}: Q4_1 blocks (fp32 zero points) run on the CPU kernels only; the CUDA kernels "
                f"(--dtype {options.dtype}) take uint8 zero points: export with --dtype fp32"
            )
        options = dataclasses.replace(
            options, quantization=source.with_accuracy_level(options.source_accuracy_level)
        )
    elif options.source_accuracy_level != 4:
        raise ExportError(f"{path}: --accuracy-level: the file's layers are float; pass --quantize")
    opts = options.resolved(source.config)
    check_supported(source.config, _requested_op_set(opts) or OpSet.LOOPCAST_ATTENTION)
    out = prepare_output(out_dir, overwrite)
    with tempfile.TemporaryDirectory(prefix=".gguf-tokenizer.", dir=out.parent) as tokenizer_dir:
        write_tokenizer(source.metadata, str(path), Path(tokenizer_dir))
        native = source.native if source.scheme is not None else None
        src = ExportSource(source.config, source.read, lambda: None, Path(tokenizer_dir), native, "gguf")
        return export_source(src, out, opts, progress)
