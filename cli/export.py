"""``loopcast export``: a checkpoint into an ONNX artifact directory."""

from __future__ import annotations

from pathlib import Path

import click

from loopcast.errors import ExportError, RequestError
from loopcast.vocab import OpSet, choices


@click.command()
@click.argument("checkpoint")
@click.option(
    "-o",
    "--output",
    "out_dir",
    required=True,
    type=click.Path(path_type=Path),
    help="Artifact directory to create.",
)
@click.option("--dtype", type=click.Choice(["fp32", "fp16", "bf16"]), default="fp32", show_default=True)
@click.option(
    "--max-length", type=int, default=None, help="KV capacity S_max (default: min(max positions, 4096))."
)
@click.option("--verify-width", type=int, default=5, show_default=True, help="Rows W of verify/verify_tail.")
@click.option(
    "--draft-depth", type=int, default=None, help="Loops of the draft graph (default 1 when R > 1)."
)
@click.option(
    "--ops",
    type=click.Choice(["auto", *choices(OpSet)]),
    default="auto",
    show_default=True,
    help="Op set of the graphs. auto: for fp32, loopcast-attention (the loopcast attention op with "
    "stock MatMul: verify rows equal decode rows bit for bit on the CPU at stock speed) when "
    "the custom-op library can be built, else stock; loopcast: every hot op from the library.",
)
@click.option("--batch-invariant", is_flag=True, help="Same as --ops loopcast.")
@click.option(
    "--target",
    type=click.Choice(["cpu", "cuda"]),
    default="cpu",
    show_default=True,
    help="Device the artifact is for. cuda implies --ops loopcast: on a GPU the loopcast ops are "
    "faster than the stock ones, exact, and only their graphs can be captured (docs/perf.md).",
)
@click.option(
    "--genai",
    is_flag=True,
    help="Also write genai_decoder.onnx and genai_config.json, so that ONNX Runtime GenAI "
    "(og.Model(ART)) runs the artifact; stock ops, sharing weights.safetensors.",
)
@click.option(
    "--max-batch",
    type=int,
    default=None,
    help="Also write the batched decode graph for up to this many sequences (loopcast serve; "
    "docs/serving.md).",
)
@click.option(
    "--exit-depths",
    default="all",
    show_default=True,
    help="Static depths k < R that get their own graphs for generate --loops k: all, none, or a "
    "list such as 2,3 (looped models).",
)
@click.option(
    "--tree-verify",
    is_flag=True,
    help="Also write the tree kinds (tree_draft, tree_tail) that generate --alternate-gap needs "
    "(looped models, loopcast attention op).",
)
@click.option(
    "--quantize",
    default=None,
    metavar="int4|int8",
    help="Weight-only RTN block quantization of every layer's projections (MatMulNBits on the CPU; "
    "with --ops loopcast / --target cuda the row-invariant BatchInvariantMatMulNBits, CPU and CUDA; "
    'norms and rope stay float). docs/architecture.md, "Quantized weights".',
)
@click.option(
    "--block-size", type=int, default=32, show_default=True, help="Quantization block (32, 64, 128)."
)
@click.option(
    "--asymmetric", is_flag=True, help="Per-block zero points (min/max) instead of symmetric absmax."
)
@click.option(
    "--quantize-head",
    default="same",
    show_default=True,
    metavar="float|int8|int4|same",
    help="The lm_head's format under --quantize (a tied head gets its own quantized copy).",
)
@click.option(
    "--quantize-embedding",
    default="float",
    show_default=True,
    metavar="float|int8|int4|same",
    help="The embedding's format under --quantize (quantized: GatherBlockQuantized, --dtype fp32; "
    "a tied head must then be quantized too).",
)
@click.option(
    "--accuracy-level",
    type=int,
    default=4,
    show_default=True,
    help="MatMulNBits accuracy_level: 4 = int8 activations (fast; rows exact at block 32), 0/1 = fp32.",
)
@click.option("--overwrite", is_flag=True, help="Replace an existing artifact at the output path.")
def export(
    checkpoint: str,
    out_dir: Path,
    dtype: str,
    max_length: int | None,
    verify_width: int,
    draft_depth: int | None,
    ops: str,
    batch_invariant: bool,
    target: str,
    genai: bool,
    max_batch: int | None,
    exit_depths: str,
    tree_verify: bool,
    quantize: str | None,
    block_size: int,
    asymmetric: bool,
    quantize_head: str,
    quantize_embedding: str,
    accuracy_level: int,
    overwrite: bool,
) -> None:
    """Export a checkpoint directory (or `demo`) or a GGUF file into an ONNX artifact directory."""
    from loopcast.exporter.export import ExportOptions, export_checkpoint
    from loopcast.exporter.gguf_source import is_gguf

    _refuse_contradictions(ops, batch_invariant, target, quantize)

    from loopcast.manifest import BATCH_KINDS
    from loopcast.quant import quant_scheme_from_options

    # A GGUF's quantized layers take --accuracy-level without --quantize (their scheme is the file's)
    source_level = accuracy_level if is_gguf(checkpoint) and quantize is None else 4
    scheme = quant_scheme_from_options(
        quantize,
        block_size,
        asymmetric,
        quantize_head,
        quantize_embedding,
        accuracy_level if source_level == 4 else 4,
    )

    options = ExportOptions(
        dtype,
        max_length,
        verify_width,
        draft_depth,
        batch_invariant or target == "cuda",
        ops,
        genai,
        max_batch,
        tree_verify,
        scheme,
        _exit_depths(exit_depths),
        source_level,
    )
    manifest = export_checkpoint(checkpoint, out_dir, options, progress=True, overwrite=overwrite)
    kinds = ", ".join(
        f"{k}({v.rows or 'M'})" if k not in BATCH_KINDS else f"{k}({v.rows or 'M'} x B<={manifest.max_batch})"
        for k, v in manifest.graphs.items()
    )
    exact = ", ".join(d for d, ok in manifest.exact_verify.items() if ok) or "no device"
    genai_note = "; ONNX Runtime GenAI model (genai_config.json)" if manifest.genai_files else ""
    if manifest.quantization is not None:
        genai_note += f"; weights {manifest.quantization.describe()}"
    click.echo(
        f"wrote {out_dir}: {kinds}; dtype {manifest.dtype}, max length {manifest.max_length}, "
        f"ops {manifest.op_set}, exact speculation on {exact}{genai_note}"
    )


def _exit_depths(text: str) -> tuple[int, ...] | None:
    """``--exit-depths``: None (every k < R), () or the listed depths."""
    if text == "all":
        return None
    if text == "none":
        return ()
    try:
        return tuple(int(part) for part in text.replace(" ", ",").split(",") if part)
    except ValueError:
        raise RequestError(f"--exit-depths must be all, none or depths like 2,3; got {text!r}") from None


def _refuse_contradictions(ops: str, batch_invariant: bool, target: str, quantize: str | None) -> None:
    """Flags that ask for two op sets are refused, not resolved behind the user's back:
    ``--batch-invariant`` and ``--target cuda`` both mean ``--ops loopcast``."""
    if batch_invariant and ops not in ("auto", OpSet.LOOPCAST):
        raise ExportError(f"--batch-invariant means --ops loopcast; it contradicts --ops {ops}")
    if target == "cuda" and ops not in ("auto", OpSet.LOOPCAST):
        raise ExportError(
            f"--target cuda builds the loopcast ops (--ops loopcast); it contradicts --ops {ops}"
        )
