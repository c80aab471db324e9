"""``loopcast export``: checkpoint directory → artifact directory (docs/architecture.md §3, §4).

The artifact is assembled in a staging directory beside the destination and swapped into
place only when every file is written and checked, so a failed export leaves nothing that
looks like an artifact, and a killed one leaves the old artifact (or restores it on the next
export or load): loopcast/swap.py.
"""

from __future__ import annotations

import dataclasses
import shutil
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from loopcast.exporter.artifact_output import os_errors, prepare_output
from loopcast.exporter.checkpoint import resolve_checkpoint, validate_checkpoint
from loopcast.exporter.export_options import (
    MAX_VERIFY_WIDTH,
    ExportOptions,
    check_cuda_attention,
    check_half_precision_runs,
    check_supported,
    head_size,
)
from loopcast.exporter.output_dir import check_output_dir
from loopcast.exporter.weights import (
    Native,
    Read,
    checkpoint_reader,
    weight_layout,
    weights_nbytes,
    write_weights,
)
from tqdm import tqdm

from loopcast import __version__
from loopcast.config import ModelConfig, generation_max_length, load_config
from loopcast.cpu_features import cpu_signature
from loopcast.errors import ExportError
from loopcast.manifest import (
    MANIFEST_FILE,
    SCHEMA_VERSION,
    WEIGHTS_FILE,
    GraphSpec,
    Manifest,
    chunked_sha256,
)
from loopcast.quant import QuantScheme, quantized_linears
from loopcast.swap import Staging, output_path, recover
from loopcast.vocab import BATCH_KINDS, SELF_BATCH_KINDS, TREE_KINDS, OpSet, can_tree_verify, graph_plan

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "generation_config.json",
)


def custom_op_library() -> Path:
    """A path to the custom-op library file: the prebuilt ``loopcast-ops`` one when it matches
    these kernel sources, else built once per source version into the loopcast cache
    (``custom_ops/library.py``)."""
    from loopcast.custom_ops import library

    from loopcast.ops_trust import record_local_build

    try:
        path = library.custom_op_library()
    except Exception as exc:
        raise ExportError(f"the loopcast ops need the custom-op library: {exc}") from None
    # This user's own build (or the prebuilt wheel they installed): artifacts carrying it load
    # without --trust-ops (docs/trust.md). Idempotent.
    record_local_build(path)
    return path


def _requested_op_set(opts: ExportOptions) -> OpSet | None:
    """The op set the options ask for; None: "auto" for fp32, decided by whether the custom-op
    library can be had and by the weights (fp16/bf16 "auto" is stock)."""
    if opts.op_set == "auto":
        return OpSet.STOCK if opts.dtype != "fp32" else None
    return OpSet(opts.op_set)


def _auto_op_set(config, opts: ExportOptions, log) -> OpSet:
    """fp32 "auto" with the library at hand: loopcast-attention (the stock MatMul and
    MatMulNBits, loopcast attention), or the loopcast op set for quantized weights that the stock
    MatMulNBits cannot keep row-invariant on this CPU (exporter/matmulnbits_rows.py): fp32 zero
    points (a GGUF's Q4_1 blocks, where its path is slow too), or int8 activations (accuracy
    level 4, where the two kernels run at comparable speed) in a scheme whose rows this CPU's
    MLAS kernels change with the row count. Levels 0/1 keep MatMulNBits (its fp32 path is the
    faster; never row-invariant: --ops loopcast is the exact choice there)."""
    q = opts.quantization
    if q is None:
        return OpSet.LOOPCAST_ATTENTION
    if q.float_zero_points:
        return OpSet.LOOPCAST
    if q.accuracy_level != 4:
        return OpSet.LOOPCAST_ATTENTION
    from loopcast.exporter.matmulnbits_rows import stock_rows_invariant

    if stock_rows_invariant(quantized_linears(config, q)):
        return OpSet.LOOPCAST_ATTENTION
    log(
        f"note: MatMulNBits' rows change with the row count on this CPU at {q.layers.value} block "
        f"{q.block_size} accuracy level {q.accuracy_level}; exporting the loopcast op set "
        "(BatchInvariantMatMulNBits, row-invariant) so that speculation stays exact"
    )
    return OpSet.LOOPCAST


def _resolve_op_set(config, opts: ExportOptions, log) -> tuple[OpSet, Path | None]:
    """The op set to build and the library it needs (built or found in the cache first, so a
    missing toolchain fails before minutes of writing)."""
    quantized_linears(config, opts.quantization)  # a scheme this config refuses: before any build
    op_set = _requested_op_set(opts)
    if op_set is None:
        try:
            library = custom_op_library()
        except ExportError as exc:
            # The advice fits every caller (export, demo, bench): what fixes it, not a flag of one.
            log(
                f"note: exporting stock graphs: {exc}. Their verify rows are not exact, so speculation "
                "on them is refused (plain decoding runs as usual)"
            )
            return OpSet.STOCK, None
        return _auto_op_set(config, opts, log), library
    return op_set, custom_op_library() if op_set.needs_library else None


@dataclass(frozen=True)
class ExportSource:
    """What an export reads: float tensors by upstream name (``read``), the blocks of weights
    that arrive quantized (``native``: a GGUF's), and the directory holding the tokenizer files."""

    config: ModelConfig
    read: Read
    close: Callable[[], None]
    tokenizer_dir: Path | None
    native: Native | None = None
    format: str = "safetensors"


def export_checkpoint(
    checkpoint: str | Path,
    out_dir: str | Path,
    options: ExportOptions = ExportOptions(),
    *,
    progress: bool = False,
    overwrite: bool = False,
) -> Manifest:
    """Export a Hugging Face checkpoint directory (or ``demo``, or a hub id), or a ``.gguf`` file
    (exporter/gguf_export.py), into an artifact directory."""
    from loopcast.exporter.gguf_source import is_gguf

    if is_gguf(checkpoint):
        from loopcast.exporter.gguf_export import export_gguf

        return export_gguf(Path(checkpoint), out_dir, options, progress=progress, overwrite=overwrite)
    checkpoint_dir = resolve_checkpoint(checkpoint)
    config = load_config(checkpoint_dir)
    opts = options.resolved(config, generation_max_length(checkpoint_dir))
    # fp32 "auto" resolves to loopcast-attention unless the library cannot be had (checked again
    # once resolved, before any writing)
    check_supported(config, _requested_op_set(opts) or OpSet.LOOPCAST_ATTENTION)
    head_size(config, opts, _requested_op_set(opts) or OpSet.LOOPCAST_ATTENTION)  # pad_heads_to's op set
    check_cuda_attention(config, opts, _requested_op_set(opts))
    out = prepare_output(out_dir, overwrite)
    tensors = validate_checkpoint(checkpoint_dir, config)  # once: the writer reads these files
    read, close = checkpoint_reader(tensors)
    return export_source(ExportSource(config, read, close, checkpoint_dir), out, opts, progress)


def export_source(source: ExportSource, out: Path, opts: ExportOptions, progress: bool) -> Manifest:
    """Write the artifact of ``source`` under resolved ``opts`` at ``out`` (prepare_output)."""
    check_half_precision_runs(opts)
    with os_errors(out):
        staging = Staging(out)
        try:
            # Every file first, then manifest.json once, complete (file records and the measured
            # exactness), and only then the swap: a failure at any point leaves no artifact.
            known: dict[str, str] = {}
            manifest = _write_artifact(source, opts, staging.path, progress, known)
            manifest = _with_file_records(manifest, staging.path, known)
            manifest = _with_exactness(manifest, staging.path)
            (staging.path / MANIFEST_FILE).write_text(manifest.to_json())
            staging.install()
        except BaseException:
            staging.discard()
            raise
        finally:
            source.close()
    return manifest


def _write_artifact(
    source: ExportSource,
    opts: ExportOptions,
    staging: Path,
    show_progress: bool,
    known_hashes: dict[str, str],
) -> Manifest:
    """Write every file of the artifact but manifest.json into ``staging`` and return the
    manifest; ``known_hashes`` gets the digest of files hashed here (the weights, chunked:
    loopcast/manifest.py), so the file records skip a pass."""
    config, read = source.config, source.read
    op_set, built_library = _resolve_op_set(
        config, opts, lambda line: print(line, file=sys.stderr) if show_progress else None
    )
    check_supported(config, op_set)
    if opts.tree_verify and can_tree_verify(config, op_set):
        raise ExportError(f"--tree-verify: {can_tree_verify(config, op_set)}")
    quant = opts.quantization
    # the stored head size: padded for the CUDA attention kernels where they lack head_dim
    heads = head_size(config, opts, op_set)
    padded = heads if heads != config.head_dim else None
    if padded is not None and source.native is not None:
        raise ExportError(
            f"heads of {config.head_dim} stored as {heads} (the loopcast attention ops' CUDA kernels "
            "take 16, 32, 64 or 128) would move the blocks of this file's quantized tensors; export "
            "it with --ops stock, or from a float (F16/F32/BF16) source"
        )
    layout = weight_layout(config, opts.max_length, opts.dtype, read, quant, padded)
    total = weights_nbytes(config, opts.max_length, opts.dtype, read, quant, padded)
    bar = tqdm(
        total=total, desc="weights", unit="B", unit_scale=True, unit_divisor=1024, disable=not show_progress
    )
    # The graphs need only the weights' offsets, known before the copy: they are built on a
    # second thread while the weights are written (the copy is mostly numpy and I/O, which
    # release the GIL) and saved once the weights file is complete. That thread also imports
    # onnx-ir (0.5 s of sympy on the H200 host), which the copy does not need.
    with ThreadPoolExecutor(max_workers=1) as pool:
        built = pool.submit(_build_graphs, config, opts, op_set, layout, staging, padded)
        try:
            stored = write_weights(
                staging / WEIGHTS_FILE,
                config,
                opts.max_length,
                opts.dtype,
                read,
                progress=bar.update,
                quant=quant,
                native=source.native,
                head_size=padded,
            )
        finally:
            bar.close()
        plans, refs, models, graphs, custom_ops = built.result()
    if stored != layout:
        raise AssertionError("the weights file's layout differs from the one the graphs were built on")
    # Hashed in 64 MiB chunks on all cores while the file is still in the page cache (one
    # core's SHA-256 of 2.7 GB took 2 s on the H200 host, as long as the rest of the copy)
    known_hashes[WEIGHTS_FILE] = chunked_sha256(staging / WEIGHTS_FILE)
    import onnx_ir as ir  # imported by the graph thread by now
    from loopcast.exporter.genai import write_genai

    library = None
    for plan in plans:
        ir.save(models[plan.key], staging / graphs[plan.key].file)
    graphs.update(
        _write_batched(
            config,
            _ir_dtype(opts.dtype),
            opts.max_length,
            opts.max_batch,
            opts.verify_width,
            refs,
            staging,
            op_set,
            custom_ops,
            quant=quant,
            draft_depth=opts.draft_depth,
            head_size=padded,
        )
    )
    genai_files = (
        write_genai(
            staging, config, _ir_dtype(opts.dtype), opts.max_length, refs, WEIGHTS_FILE, quant, padded
        )
        if opts.genai
        else []
    )
    if custom_ops:
        # The artifact carries its own copy so that C programs and other machines need nothing else.
        library = built_library.name
        shutil.copy(built_library, staging / library)
    tokenizer_files = []
    for name in TOKENIZER_FILES:
        if source.tokenizer_dir is not None and (source.tokenizer_dir / name).is_file():
            shutil.copy(source.tokenizer_dir / name, staging / name)
            tokenizer_files.append(name)
    manifest = Manifest(
        schema_version=SCHEMA_VERSION,
        exporter_version=__version__,
        model=config.to_hf_dict(),
        dtype=opts.dtype,
        max_length=opts.max_length,
        verify_width=None if config.recurrent_depth else opts.verify_width,
        draft_depth=opts.draft_depth,
        kv_layout={
            "slots": config.num_kv_slots,
            "slot_of": "core loop r, layer l -> r*L + l; then prelude, then coda"
            + (" (core_step binds step r's slots to step 0's names)" if config.recurrent_depth else ""),
            "shape": [1, config.num_kv_heads, opts.max_length, heads],
            "names": {
                "past": "past_key.{slot} / past_value.{slot}",
                "present": "present_key.{slot} / present_value.{slot} (bind the same buffer)",
            },
            "lengths": "seqlens_k = n+M-1 (int32 [1]); total_sequence_length = n+M (int32 scalar)",
        },
        graphs=graphs,
        custom_ops=sorted(custom_ops),
        custom_op_library=library,
        tokenizer_files=tokenizer_files,
        eos_token_ids=list(config.eos_token_ids),
        op_set=op_set,
        genai_files=genai_files,
        max_batch=opts.max_batch,
        quantization=quant,
        exit_depths=list(opts.exit_depths or ()),
        source_format=source.format,
        attention_head_size=padded,
    )
    return manifest


def _ir_dtype(name: str):
    import onnx_ir as ir

    return {"fp32": ir.DataType.FLOAT, "fp16": ir.DataType.FLOAT16, "bf16": ir.DataType.BFLOAT16}[name]


def _build_graphs(
    config: ModelConfig,
    opts: ExportOptions,
    op_set: OpSet,
    layout: dict,
    staging: Path,
    head_size: int | None = None,
):
    """On the graph thread: the kinds to build, the weight references, every kind's model (not
    yet saved), its spec and the custom ops it uses; ``head_size``: the padded head size."""
    from loopcast.graphs.builder import GraphBuilder, weight_refs
    from loopcast.graphs.kinds import build_kind, plan_kinds

    dtype = _ir_dtype(opts.dtype)
    plans = plan_kinds(
        config,
        opts.verify_width,
        opts.draft_depth,
        op_set=op_set,
        tree=opts.tree_verify,
        exit_depths=opts.exit_depths or (),
    )
    refs = weight_refs(layout)
    quantized = quantized_linears(config, opts.quantization, head_size)
    models, graphs, custom_ops = {}, {}, set()
    for plan in plans:
        builder = GraphBuilder(refs, WEIGHTS_FILE, staging, quantized, head_size=head_size)
        models[plan.key], graphs[plan.key] = build_kind(
            plan, config, dtype, opts.max_length, builder, op_set=op_set
        )
        custom_ops.update(builder.custom_ops())
    return plans, refs, models, graphs, custom_ops


def _with_exactness(manifest: Manifest, staging: Path) -> Manifest:
    """Declare per device whether verify rows are the decode rows bit for bit. Measured on the
    CPU for quantized artifacts as for float ones (the twin reads the same quantized tensors
    through the same MatMulNBits / BatchInvariantMatMulNBits nodes; docs/architecture.md
    "Quantized weights"). Measured on the
    CPU (fp32 only: the CPU runs nothing else) by loading a two-layer twin of the staged
    artifact on its own weights (exporter/exactness_probe.py: the same kernels at the same
    shapes for a fraction of the prepacking), after the files are recorded (the trust rule
    loads the op library only by recorded hash), before manifest.json is written; on CUDA only the
    loopcast kernels are row-invariant (tested on the GPU: tests/ort_runtime/test_cuda.py),
    cuBLAS and GroupQueryAttention are not."""
    from loopcast.exporter.exactness_probe import rows_match_shallow

    q = manifest.quantization
    # fp32 zero points are the CPU kernels' alone (the CUDA kernels compute every level in the
    # activation dtype, rows invariant)
    cpu_only = q is not None and q.float_zero_points
    exact = {
        "cpu": manifest.dtype == "fp32" and rows_match_shallow(staging, manifest=manifest),
        # quantized: BatchInvariantMatMulNBits, row-invariant on CUDA as on the CPU
        "cuda": OpSet(manifest.op_set).batch_invariant and not cpu_only,
    }
    # MLAS's kernels (the stock MatMul and MatMulNBits) are picked by the CPU's vector features:
    # the CPU answer holds where they are this CPU's
    measured_on = None if OpSet(manifest.op_set).batch_invariant else cpu_signature()
    return dataclasses.replace(manifest, exact_verify=exact, exact_verify_cpu=measured_on)


def with_verify_width(
    artifact_dir: str | Path, out_dir: str | Path, width: int, *, overwrite: bool = False
) -> Manifest:
    """A sibling artifact whose verify graphs take ``width`` rows, sharing the weights file.

    Only the graphs are rebuilt (seconds, even at 1.4B); the weights, tokenizer and custom-op
    library are hard-linked (ORT refuses external data reached through a symlink that leaves the
    model's directory; a copy is made across file systems), so benchmarks can compare several
    verify widths of one export. Assembled in a staging directory and swapped into place like
    an export, so a failure leaves nothing behind.
    """
    import os

    from loopcast.exporter.weights import read_stored

    src, out = Path(artifact_dir), output_path(out_dir)
    recover(out)
    manifest = Manifest.read(src)
    config = manifest.config
    if not 2 <= width <= min(MAX_VERIFY_WIDTH, manifest.max_length):
        raise ExportError(
            f"verify width must be in 2..{min(MAX_VERIFY_WIDTH, manifest.max_length)}, got {width}"
        )
    if out.exists() and out.resolve() == src.resolve():
        raise ExportError(f"{out}: the output must differ from the source artifact")
    check_output_dir(out, overwrite, "overwrite=True")
    import onnx_ir as ir
    from loopcast.graphs.builder import GraphBuilder, weight_refs
    from loopcast.graphs.kinds import build_kind, plan_kinds

    dtype = _ir_dtype(manifest.dtype)
    refs = weight_refs(read_stored(src / manifest.weights_file))
    quantized = quantized_linears(config, manifest.quantization, manifest.attention_head_size)
    keep = [manifest.weights_file, *manifest.tokenizer_files, *manifest.genai_files]
    if manifest.custom_op_library:
        keep.append(manifest.custom_op_library)
    with os_errors(out):
        staging = Staging(out)
        try:
            for name in keep:
                try:
                    os.link(src / name, staging.path / name)
                except OSError:
                    shutil.copy(src / name, staging.path / name)
            graphs = {}
            for plan in plan_kinds(
                config,
                width,
                manifest.draft_depth,
                op_set=manifest.op_set,
                tree=any(kind in manifest.graphs for kind in TREE_KINDS),
                exit_depths=tuple(manifest.exit_depths),
            ):
                builder = GraphBuilder(
                    refs,
                    manifest.weights_file,
                    staging.path,
                    quantized,
                    head_size=manifest.attention_head_size,
                )
                model, spec = build_kind(
                    plan, config, dtype, manifest.max_length, builder, op_set=manifest.op_set
                )
                ir.save(model, staging.path / spec.file)
                graphs[plan.key] = spec
            graphs.update(
                _write_batched(
                    config,
                    dtype,
                    manifest.max_length,
                    manifest.max_batch,
                    width,
                    refs,
                    staging.path,
                    manifest.op_set,
                    set(),
                    manifest.weights_file,
                    quant=manifest.quantization,
                    draft_depth=manifest.draft_depth
                    if any(kind in manifest.graphs for kind in SELF_BATCH_KINDS)
                    else None,
                    head_size=manifest.attention_head_size,
                )
            )
            derived = dataclasses.replace(manifest, graphs=graphs, verify_width=width, files={})
            derived = _with_file_records(derived, staging.path)
            (staging.path / MANIFEST_FILE).write_text(derived.to_json())
            staging.install()
        except BaseException:
            staging.discard()
            raise
    return derived


def _write_batched(
    config: ModelConfig,
    dtype,
    max_length: int,
    max_batch: int | None,
    verify_width: int | None,
    refs: dict,
    staging: Path,
    op_set: OpSet,
    custom_ops: set[str],
    weights_file: str = WEIGHTS_FILE,
    quant: QuantScheme | None = None,
    draft_depth: int | None = None,
    head_size: int | None = None,
) -> dict[str, GraphSpec]:
    """The batched kinds (graphs/batched.py) when ``max_batch`` is set (the self-speculation
    ones also with ``draft_depth``); adds their custom ops."""
    import onnx_ir as ir
    from loopcast.graphs.batched import build_batched_kind
    from loopcast.graphs.builder import GraphBuilder

    graphs = {}
    plans = graph_plan(
        config, op_set, verify_width=verify_width, draft_depth=draft_depth, max_batch=max_batch
    )
    for plan in (p for p in plans if p.kind in BATCH_KINDS):
        builder = GraphBuilder(
            refs, weights_file, staging, quantized_linears(config, quant, head_size), head_size=head_size
        )
        model, spec = build_batched_kind(
            plan.kind,
            config,
            dtype,
            max_length,
            builder,
            op_set=op_set,
            rows=plan.rows,
            loops=(plan.first_loop, plan.last_loop),
        )
        ir.save(model, staging / spec.file)
        graphs[plan.kind] = spec
        custom_ops.update(builder.custom_ops())
    return graphs


def _with_file_records(manifest: Manifest, staging: Path, known: dict[str, str] | None = None) -> Manifest:
    """Record size and SHA-256 of every file the manifest names: loading checks the sizes,
    ``inspect --verify`` the hashes, and the runtime loads the op library only if its hash
    matches (docs/trust.md)."""
    from loopcast.manifest import CHUNKED_SHA256, FileRecord, file_digest, sampled_sha256

    names = [spec.file for spec in manifest.graphs.values()] + [
        manifest.weights_file,
        *manifest.tokenizer_files,
        *manifest.genai_files,
    ]
    if manifest.custom_op_library:
        names.append(manifest.custom_op_library)
    known = known or {}

    def record(name: str) -> FileRecord:
        scheme = CHUNKED_SHA256 if name == manifest.weights_file else "sha256"
        digest = known.get(name) or file_digest(staging / name, scheme)
        return FileRecord((staging / name).stat().st_size, digest, sampled_sha256(staging / name), scheme)

    return dataclasses.replace(manifest, files={name: record(name) for name in names})
