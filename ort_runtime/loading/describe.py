"""What ``loopcast inspect`` prints about an artifact (``describe_artifact``): the manifest
validated, every graph file parsed, sizes (and with ``verify`` the hashes) checked; nothing is
loaded into ONNX Runtime."""

from __future__ import annotations

import stat
from pathlib import Path

from loopcast.confined_files import confined_file
from loopcast.manifest import Manifest
from loopcast.vocab import GraphKind


def _library_status(path: Path, manifest: Manifest) -> str:
    """Whether the op library would load without --trust-ops (docs/trust.md); nothing is loaded."""
    from loopcast.manifest import sha256_file
    from loopcast.ops_trust import locally_built_hashes

    if not manifest.custom_op_library:
        return ""
    library = confined_file(path, manifest.custom_op_library, "custom-op library")
    assert library is not None
    digest = sha256_file(library.resolve())
    built = "built here" if digest in locally_built_hashes() else "not built here: loading needs --trust-ops"
    return f" (library {manifest.custom_op_library}, {built})"


def describe_artifact(path: Path, verify: bool = False) -> str:
    """What ``loopcast inspect`` prints. The manifest is validated and recorded sizes checked;
    each graph file must parse as an ONNX model; ``verify`` also hashes every recorded file."""
    from loopcast.ort_runtime.loading.trust import recorded_size, uses_loopcast_domain

    manifest = Manifest.read(path)
    for spec in manifest.graphs.values():
        # raises on a file that is not an ONNX model (Manifest.read checked its size and kind)
        uses_loopcast_domain(Path(path) / spec.file, recorded_size(manifest, spec.file))
    cfg = manifest.config
    # the artifact's own regular files (lstat: a symlink's target is not counted)
    total = sum(st.st_size for f in Path(path).iterdir() if stat.S_ISREG((st := f.lstat()).st_mode))
    weights = (Path(path) / manifest.weights_file).stat().st_size
    lines = [
        f"artifact        {path}",
        f"schema          v{manifest.schema_version} (exporter {manifest.exporter_version})",
        f"model           {cfg.model_type}, {_depth(cfg)}, hidden {cfg.hidden_size}, vocab {cfg.vocab_size}",
        *(_recurrent_options(cfg, manifest) if cfg.recurrent_depth else []),
        f"dtype           {manifest.dtype} (exported from {manifest.source_format})",
        "quantization    "
        + (manifest.quantization.describe() if manifest.quantization is not None else "none (float weights)"),
        f"attention       {cfg.num_heads} heads / {cfg.num_kv_heads} KV heads of {cfg.head_dim}"
        + (
            f", stored as {manifest.attention_head_size} (zero-padded for the CUDA attention kernels)"
            if manifest.attention_head_size
            else ""
        ),
        f"max length      {manifest.max_length} (KV slots: {manifest.kv_layout['slots']}, "
        f"each {manifest.kv_layout['shape']})",
        f"weights         {manifest.weights_file} {weights / 2**20:.1f} MiB "
        f"(artifact total {total / 2**20:.1f} MiB)",
        f"custom ops      {', '.join(manifest.custom_ops) or 'none'}{_library_status(Path(path), manifest)}",
        f"exact verify    {_exact_verify(manifest)}",
        *(
            [f"max batch       {manifest.max_batch} sequences (batched kinds; docs/serving.md)"]
            if manifest.max_batch
            else []
        ),
        "graphs:",
    ]
    runs = {  # the recurrent kinds: the host composes them (graphs/recurrent.py)
        GraphKind.PRELUDE: "once",
        GraphKind.CORE_STEP: f"r = 1..{cfg.num_loops} times (default {cfg.loops_default})",
        GraphKind.CODA: "once",
        GraphKind.RECURRENT_CYCLE: f"per pipeline cycle, row k a lane at step k (k < {cfg.num_loops})",
        GraphKind.PRELUDE_BATCH: "once, rows per sequence",
        GraphKind.CORE_STEP_BATCH: "up to r times, each sequence at its own r",
        GraphKind.CODA_BATCH: "once, rows per sequence",
    }
    for kind, spec in manifest.graphs.items():
        size = (Path(path) / spec.file).stat().st_size
        loops = f"runs {runs[kind]}" if kind in runs else f"loops {spec.first_loop}..{spec.last_loop - 1}"
        lines.append(
            f"  {kind:<12} {spec.file:<17} rows {spec.rows or 'dynamic':<8} {loops}  "
            f"KV slots {len(spec.kv_slots):<3} {size / 1024:.0f} KiB"
        )
        others = [n for n in spec.inputs if not n.startswith("past_")]
        outs = [n for n in spec.outputs if not n.startswith("present_")]
        lines.append(f"  {'':<12} inputs {', '.join(others)} + past_key/value.{{slot}}")
        lines.append(f"  {'':<12} outputs {', '.join(outs)} + present_key/value.{{slot}}")
    if verify:
        from loopcast.manifest_schema import verify_hashes

        lines += ["verify (SHA-256 of every recorded file):", *verify_hashes(manifest, Path(path))]
    elif manifest.files:
        lines.append(
            f"files           {len(manifest.files)} recorded with sizes (checked) and SHA-256 "
            "(loopcast inspect --verify checks them)"
        )
    return "\n".join(lines)


def _exact_verify(manifest) -> str:
    """Where verify rows equal decode rows, as declared, and whether the CPU declaration holds on
    this CPU (the manifest's exact_verify_cpu names the CPU it was measured on)."""
    from loopcast.cpu_features import cpu_signature, same_cpu_kernels

    text = ", ".join(f"{d}: {str(v).lower()}" for d, v in sorted(manifest.exact_verify.items())) or "none"
    measured = manifest.exact_verify_cpu
    if measured is None or not manifest.exact_verify.get("cpu", False):
        return text
    here = "this CPU too" if same_cpu_kernels(measured) else f"not this CPU ({cpu_signature()}): false here"
    return f"{text} (cpu measured on {measured}; {here})"


def _depth(cfg) -> str:
    if not cfg.recurrent_depth:
        return f"R={cfg.num_loops} loops x {cfg.num_layers} layers"
    return (
        f"recurrent depth: {cfg.num_prelude_layers} prelude + {cfg.num_layers} core x r + "
        f"{cfg.num_coda_layers} coda layers, r = 1..{cfg.num_loops} (default {cfg.loops_default})"
    )


def _recurrent_options(cfg, manifest) -> list[str]:
    """What a request may choose on a recurrent-depth artifact (docs/checkpoints.md)."""
    exact = ", ".join(f"{d}: {str(v).lower()}" for d, v in sorted(manifest.exact_verify.items())) or "none"
    modes = (
        "prompt-lookup, self (--draft-depth d < r) or pipeline"
        if GraphKind.RECURRENT_CYCLE in manifest.graphs
        else "prompt-lookup or self (--draft-depth d < r)"
    )
    return [
        f"per request     --loops r (1..{cfg.num_loops}), --kl-threshold, --state-seed; --speculative "
        f"{modes}; exact_verify {exact}"
    ]
