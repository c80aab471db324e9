"""``loopcast export``: checkpoint directory → artifact directory (DESIGN §3, §4).

The artifact is assembled in a staging directory beside the destination and swapped into
place only when every file is written and checked, so a failed export leaves nothing that
looks like an artifact, and a killed one leaves the old artifact (or restores it on the next
export or load): loopcast/swap.py.
"""

from __future__ import annotations

import contextlib
import errno
import shutil
from dataclasses import dataclass
from pathlib import Path

import onnx_ir as ir
import torch
from tqdm import tqdm

from loopcast import __version__
from loopcast.config import ModelConfig, load_config
from loopcast.errors import ExportError
from loopcast.exporter.checkpoint import DTYPES, resolve_checkpoint, validate_checkpoint
from loopcast.exporter.weights import artifact_tensors, checkpoint_reader, write_weights
from loopcast.graphs.builder import GraphBuilder, WeightRef
from loopcast.graphs.kinds import build_kind, plan_kinds
from loopcast.manifest import MANIFEST_FILE, SCHEMA_VERSION, WEIGHTS_FILE, Manifest
from loopcast.swap import Staging, output_path, recover

IR_DTYPES = {"fp32": ir.DataType.FLOAT, "fp16": ir.DataType.FLOAT16, "bf16": ir.DataType.BFLOAT16}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
MAX_VERIFY_WIDTH = 32


@dataclass(frozen=True)
class ExportOptions:
    dtype: str = "fp32"
    max_length: int | None = None      # default: min(config max positions, 4096)
    verify_width: int = 5
    draft_depth: int | None = None     # default: 1 when R > 1
    batch_invariant: bool = False      # loopcast custom ops: verify rows == decode rows bit for bit

    def resolved(self, config: ModelConfig) -> ExportOptions:
        if self.dtype not in IR_DTYPES:
            raise ExportError(f"--dtype must be one of fp32, fp16, bf16, got {self.dtype!r}")
        max_length = self.max_length if self.max_length is not None else min(config.max_position_embeddings, 4096)
        if not 1 <= max_length <= config.max_position_embeddings:
            raise ExportError(f"--max-length {max_length} is outside 1..{config.max_position_embeddings} "
                              "(the model's max_position_embeddings)")
        if not 2 <= self.verify_width <= MAX_VERIFY_WIDTH:
            raise ExportError(f"--verify-width must be in 2..{MAX_VERIFY_WIDTH}, got {self.verify_width}")
        if self.verify_width > max_length:
            raise ExportError(f"--verify-width {self.verify_width} exceeds --max-length {max_length}")
        depth = self.draft_depth
        if config.num_loops == 1:
            if depth is not None:
                raise ExportError("--draft-depth needs a looped model; this one has R=1")
        else:
            depth = 1 if depth is None else depth
            if not 1 <= depth < config.num_loops:
                raise ExportError(f"--draft-depth must be in 1..{config.num_loops - 1} (R={config.num_loops}), "
                                  f"got {depth}")
        return ExportOptions(self.dtype, max_length, self.verify_width, depth, self.batch_invariant)


def check_supported(config: ModelConfig, batch_invariant: bool = False) -> None:
    """Limits of the ORT ops the graphs use, beyond what the config itself validates."""
    if config.head_dim % 2:
        raise ExportError(f"head_dim {config.head_dim} is not supported: rotary needs an even head_dim")
    if config.head_dim % 16 and not batch_invariant:
        raise ExportError(f"head_dim {config.head_dim} is not supported: GroupQueryAttention's rotary "
                          "needs a multiple of 16 (--batch-invariant graphs take any even head_dim on the "
                          "CPU; their CUDA kernel takes 16, 32, 64 or 128)")


def custom_op_library() -> Path:
    """The built custom-op library, compiled once per source version into the loopcast cache.

    Keyed by a hash of the sources and the build switches, so an edited kernel is rebuilt and
    an unchanged one is reused by every export.
    """
    import hashlib
    import os

    from loopcast.custom_ops import build

    src_dir = Path(build.__file__).resolve().parent / "src"
    digest = hashlib.sha256()
    for source in sorted(src_dir.iterdir()):
        if source.is_file():
            digest.update(source.name.encode() + source.read_bytes())
    # The build recipe and whether CUDA kernels can be built are part of the key: a CPU-only
    # library cached before nvcc was installed must not be reused.
    digest.update(Path(build.__file__).read_bytes())
    digest.update(f"nvcc={build.find_nvcc()} cxx={os.environ.get('CXX', '')}".encode())
    for var in ("LOOPCAST_NO_CUDA", "LOOPCAST_NVCC", "LOOPCAST_ORT_INCLUDE"):
        digest.update(f"{var}={os.environ.get(var, '')}".encode())
    root = Path(os.environ.get("LOOPCAST_CACHE", Path.home() / ".cache" / "loopcast"))
    out = root / f"ops-{digest.hexdigest()[:12]}"
    library = out / build.LIBRARY_NAME
    if not library.is_file():
        try:
            build.build_library(out)
        except Exception as exc:
            raise ExportError(f"--batch-invariant needs the custom-op library: {exc}") from None
    else:
        # Built before hashes were recorded (or the registry was deleted): it is still this
        # user's own build, so artifacts carrying it load without --trust-ops (docs/trust.md).
        from loopcast.ops_trust import record_local_build
        record_local_build(library)
    return library


def _check_output_dir(out: Path) -> None:
    if out.exists() and not out.is_dir():
        raise ExportError(f"{out}: output path exists and is a file")
    for parent in out.parents:
        if parent.exists():
            if not parent.is_dir():
                raise ExportError(f"{out}: {parent} is not a directory")
            break
    if out.is_dir() and any(out.iterdir()) and not (out / MANIFEST_FILE).is_file():
        raise ExportError(f"{out}: output directory is not empty and is not a loopcast artifact")


def export_checkpoint(checkpoint: str | Path, out_dir: str | Path, options: ExportOptions = ExportOptions(),
                      *, progress: bool = False, overwrite: bool = False) -> Manifest:
    checkpoint_dir = resolve_checkpoint(checkpoint)
    config = load_config(checkpoint_dir)
    check_supported(config, options.batch_invariant)
    opts = options.resolved(config)
    out = output_path(out_dir)
    recover(out)  # a killed earlier export: restore the artifact, remove its leftovers
    _check_output_dir(out)
    if (out / MANIFEST_FILE).is_file() and not overwrite:
        raise ExportError(f"{out}: an artifact is already there (pass --overwrite to replace it)")
    validate_checkpoint(checkpoint_dir, config)
    with _os_errors(out):
        staging = Staging(out)
        try:
            manifest = _with_file_records(_write_artifact(checkpoint_dir, config, opts, staging.path, progress),
                                          staging.path)
            staging.install()
        except BaseException:
            staging.discard()
            raise
    return manifest


@contextlib.contextmanager
def _os_errors(out: Path):
    """An OS error while staging or swapping (full disk, permissions, read-only file system, a
    busy mount point) is the environment's, not a bug: one ExportError line naming the file."""
    try:
        yield
        return
    except OSError as exc:
        reason = exc.strerror or str(exc)
        hint = {errno.ENOSPC: "; free some space", errno.EDQUOT: "; over the disk quota",
                errno.EFBIG: "; over the file-size limit", errno.EROFS: "; the file system is read-only",
                errno.EACCES: "; no permission", errno.EPERM: "; no permission",
                errno.EBUSY: "; is it a mount point or in use?"}.get(exc.errno, "")
        where = f"{exc.filename}: " if exc.filename and Path(exc.filename) != out else ""
        message = f"{out}: cannot write the artifact ({where}{reason}{hint}); nothing was replaced"
    # A progress bar left open by the failed write would redraw itself at exit, after the error
    # line; finish it now so the error stays the last line.
    for bar in list(getattr(tqdm, "_instances", ())):
        bar.close()
    raise ExportError(message)


def _write_artifact(checkpoint_dir: Path, config: ModelConfig, opts: ExportOptions, staging: Path,
                    show_progress: bool) -> Manifest:
    dtype = DTYPES[opts.dtype]
    # Built (or found in the cache) first: a missing toolchain fails before minutes of writing.
    built_library = custom_op_library() if opts.batch_invariant else None
    plans = plan_kinds(config, opts.verify_width, opts.draft_depth)
    read, close = checkpoint_reader(validate_checkpoint(checkpoint_dir, config))
    n_tensors = len(artifact_tensors(config, opts.max_length, read))
    bar = tqdm(total=n_tensors + len(plans), desc="export", unit="step", disable=not show_progress)
    try:
        stored = write_weights(staging / WEIGHTS_FILE, config, opts.max_length, dtype, _checked(read),
                               progress=bar.update)
    finally:
        close()
    refs = {name: WeightRef(name, IR_DTYPES[opts.dtype], t.shape, t.offset, t.length)
            for name, t in stored.items()}
    graphs, custom_ops, library = {}, set(), None
    for plan in plans:
        builder = GraphBuilder(refs, WEIGHTS_FILE, staging)
        model, spec = build_kind(plan, config, IR_DTYPES[opts.dtype], opts.max_length, builder,
                                 batch_invariant=opts.batch_invariant)
        ir.save(model, staging / spec.file)
        graphs[plan.kind] = spec
        custom_ops.update(builder.custom_ops())
        bar.update(1)
    bar.close()
    if custom_ops:
        # The artifact carries its own copy so that C programs and other machines need nothing else.
        library = built_library.name
        shutil.copy(built_library, staging / library)
    tokenizer_files = []
    for name in TOKENIZER_FILES:
        if (checkpoint_dir / name).is_file():
            shutil.copy(checkpoint_dir / name, staging / name)
            tokenizer_files.append(name)
    manifest = Manifest(
        schema_version=SCHEMA_VERSION,
        exporter_version=__version__,
        model=config.to_hf_dict(),
        dtype=opts.dtype,
        max_length=opts.max_length,
        verify_width=opts.verify_width,
        draft_depth=opts.draft_depth,
        kv_layout={
            "slots": config.num_kv_slots,
            "slot_of": "core loop r, layer l -> r*L + l; then prelude, then coda",
            "shape": [1, config.num_kv_heads, opts.max_length, config.head_dim],
            "names": {"past": "past_key.{slot} / past_value.{slot}",
                      "present": "present_key.{slot} / present_value.{slot} (bind the same buffer)"},
            "lengths": "seqlens_k = n+M-1 (int32 [1]); total_sequence_length = n+M (int32 scalar)",
        },
        graphs=graphs,
        custom_ops=sorted(custom_ops),
        custom_op_library=library,
        tokenizer_files=tokenizer_files,
        eos_token_ids=[config.eos_token_id] if config.eos_token_id is not None else [],
    )
    (staging / MANIFEST_FILE).write_text(manifest.to_json())
    return manifest


def with_verify_width(artifact_dir: str | Path, out_dir: str | Path, width: int, *,
                      overwrite: bool = False) -> Manifest:
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
        raise ExportError(f"verify width must be in 2..{min(MAX_VERIFY_WIDTH, manifest.max_length)}, got {width}")
    if out.exists() and out.resolve() == src.resolve():
        raise ExportError(f"{out}: the output must differ from the source artifact")
    _check_output_dir(out)
    if (out / MANIFEST_FILE).is_file() and not overwrite:
        raise ExportError(f"{out}: an artifact is already there (pass overwrite=True to replace it)")
    dtype = IR_DTYPES[manifest.dtype]
    refs = {name: WeightRef(name, dtype, t.shape, t.offset, t.length)
            for name, t in read_stored(src / manifest.weights_file).items()}
    keep = [manifest.weights_file, *manifest.tokenizer_files]
    if manifest.custom_op_library:
        keep.append(manifest.custom_op_library)
    with _os_errors(out):
        staging = Staging(out)
        try:
            for name in keep:
                try:
                    os.link(src / name, staging.path / name)
                except OSError:
                    shutil.copy(src / name, staging.path / name)
            graphs = {}
            for plan in plan_kinds(config, width, manifest.draft_depth):
                builder = GraphBuilder(refs, manifest.weights_file, staging.path)
                model, spec = build_kind(plan, config, dtype, manifest.max_length, builder,
                                         batch_invariant=bool(manifest.custom_ops))
                ir.save(model, staging.path / spec.file)
                graphs[plan.kind] = spec
            derived = Manifest(**{**manifest.__dict__, "graphs": graphs, "verify_width": width, "files": {}})
            derived = _with_file_records(derived, staging.path)
            staging.install()
        except BaseException:
            staging.discard()
            raise
    return derived


def _with_file_records(manifest: Manifest, staging: Path) -> Manifest:
    """Record size and SHA-256 of every file the manifest names and (re)write manifest.json:
    loading checks the sizes, ``inspect --verify`` the hashes, and the runtime loads the op
    library only if its hash matches (docs/trust.md)."""
    import dataclasses

    from loopcast.manifest import FileRecord, sampled_sha256, sha256_file

    names = [spec.file for spec in manifest.graphs.values()] + [manifest.weights_file, *manifest.tokenizer_files]
    if manifest.custom_op_library:
        names.append(manifest.custom_op_library)
    files = {name: FileRecord((staging / name).stat().st_size, sha256_file(staging / name),
                              sampled_sha256(staging / name)) for name in names}
    recorded = dataclasses.replace(manifest, files=files)
    (staging / MANIFEST_FILE).write_text(recorded.to_json())
    return recorded


def _checked(read):
    """Wrap the checkpoint reader so that shape errors name the tensor."""
    def read_checked(name: str) -> torch.Tensor:
        tensor = read(name)
        if not tensor.is_floating_point():
            raise ExportError(f"checkpoint tensor {name} has dtype {tensor.dtype}, expected floating point")
        return tensor.float()
    return read_checked

