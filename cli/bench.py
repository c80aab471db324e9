"""``loopcast bench``: time ORT steps and generation against PyTorch and the bandwidth floor."""

from __future__ import annotations

from pathlib import Path

import click


@click.command()
@click.argument("checkpoint", default="demo")
@click.option(
    "--device",
    type=click.Choice(["cpu", "cuda"]),
    default=None,
    help="Default: cuda when onnxruntime has the CUDA provider and the driver sees a GPU, else cpu.",
)
@click.option(
    "--dtype",
    "dtypes",
    multiple=True,
    type=click.Choice(["fp32", "fp16", "bf16"]),
    help="Repeatable (default: fp16 and bf16 on cuda, fp32 on cpu).",
)
@click.option(
    "--variant",
    "variants",
    multiple=True,
    type=click.Choice(["stock", "batch-invariant", "default"]),
    help="Graph variants to compare: stock ops, every loopcast op, or the exporter's default op set "
    "(default: what a user's export runs on the device: default on cpu, batch-invariant on cuda).",
)
@click.option(
    "--quantize",
    "quantize",
    multiple=True,
    type=click.Choice(["none", "int4", "int8"]),
    help="Weight formats, each exported beside the others (repeatable; default: none, float "
    "weights): int4/int8 as `loopcast export --quantize` (block 32, symmetric).",
)
@click.option(
    "--quick",
    is_flag=True,
    help="A first look in about a minute on a CPU: past 128, width 5, 10 runs per step, 32 tokens "
    "per prompt, no alternation, oracle rows, PyTorch baseline or profile.",
)
@click.option("--past", type=int, default=1024, show_default=True, help="KV length the steps attend over.")
@click.option(
    "--loops",
    default="",
    help="Recurrent-depth (Huginn) checkpoints: the r values to time (comma-separated; default: its "
    "default r): plain steps, the pipeline's cycle and generation, with oracle rows per --oracle-reject.",
)
@click.option(
    "--kl-threshold",
    type=float,
    default=None,
    help="Recurrent-depth (Huginn) checkpoints: also plain decoding and the pipeline's oracle rows "
    "with the KL exit at this threshold (kv_policy full), against plain decoding at that exit.",
)
@click.option("--widths", default="2,5,8", show_default=True, help="Verify widths W (comma-separated).")
@click.option("--iters", type=int, default=50, show_default=True, help="Timed runs per step kind.")
@click.option("--new-tokens", type=int, default=128, show_default=True, help="Tokens per end-to-end prompt.")
@click.option(
    "--alternate-tokens",
    type=int,
    default=1000,
    show_default=True,
    help="Length of the decode/draft/verify alternation run (CUDA).",
)
@click.option("--no-end-to-end", is_flag=True, help="Skip the end-to-end tokens/s rows.")
@click.option(
    "--oracle-reject",
    "oracle_reject",
    default="0,0.08",
    show_default=True,
    help="Pipeline rows with oracle drafts (plain greedy's continuation replayed through the drafts "
    "hook) that spoil these fractions of positions (comma-separated; empty: none).",
)
@click.option(
    "--passes",
    type=int,
    default=1,
    show_default=True,
    help="End-to-end passes over the prompts, the modes taking turns prompt by prompt; the ratios "
    "reported are the median over passes of each mode against plain in the same pass.",
)
@click.option("--no-torch", is_flag=True, help="Skip the PyTorch baseline.")
@click.option(
    "--threads", type=int, default=None, help="ONNX Runtime intra-op threads (default: one per core)."
)
@click.option("--no-profile", is_flag=True, help="Skip the per-kernel-family decode profile (CUDA).")
@click.option(
    "--work-dir",
    type=click.Path(path_type=Path),
    default=None,
    help="Where checkpoints and artifacts are exported (default: $LOOPCAST_CACHE/bench/work, "
    "LOOPCAST_CACHE defaulting to ~/.cache/loopcast).",
)
@click.option(
    "--out",
    type=click.Path(path_type=Path),
    default=None,
    help="JSON report, a PNG beside it when matplotlib is installed (default: a new timestamped "
    "file under $LOOPCAST_CACHE/bench).",
)
def bench(
    checkpoint: str,
    device: str | None,
    dtypes: tuple[str, ...],
    variants: tuple[str, ...],
    quantize: tuple[str, ...],
    past: int,
    loops: str,
    kl_threshold: float | None,
    widths: str,
    iters: int,
    new_tokens: int,
    alternate_tokens: int,
    no_end_to_end: bool,
    oracle_reject: str,
    passes: int,
    no_torch: bool,
    threads: int | None,
    no_profile: bool,
    quick: bool,
    work_dir: Path | None,
    out: Path | None,
) -> None:
    """Time ORT steps and generation against PyTorch and the bandwidth floor (`preset:NAME` = random weights)."""  # noqa: E501 (one line: click's help)
    from loopcast.bench.harness import BenchOptions, default_variants, run_bench
    from loopcast.bench.report import default_report_path, format_table, write_report

    from loopcast.devices import cache_root, check_device, default_device
    from loopcast.errors import RequestError
    from loopcast.presets import PRESETS

    if quick:
        past, widths, iters, new_tokens, alternate_tokens = 128, "5", 10, 32, 0
        oracle_reject, no_torch, no_profile, passes = "", True, True, 1
    if checkpoint.startswith("preset:") and checkpoint.split(":", 1)[1] not in PRESETS:
        raise RequestError(
            f"unknown preset {checkpoint!r}; choose from {', '.join('preset:' + name for name in PRESETS)}"
        )
    if not checkpoint.startswith("preset:"):
        from loopcast.exporter.checkpoint import resolve_checkpoint

        resolve_checkpoint(checkpoint)  # a missing path: one error line, before any other output
    # Checked before anything is exported: a CPU-only install refuses --device cuda at once.
    device = check_device(device) if device is not None else default_device()
    work_dir = work_dir if work_dir is not None else cache_root() / "bench" / "work"
    out = out if out is not None else default_report_path(checkpoint, device)
    if out.suffix != ".json":
        raise RequestError(f"--out must name a .json file, got {out}")

    try:
        width_list = tuple(int(w) for w in widths.split(",") if w)
    except ValueError:
        raise RequestError(f"--widths must be comma-separated integers, got {widths!r}") from None
    if threads is not None and threads < 1:
        raise RequestError(f"--threads must be >= 1, got {threads}")
    if past < 1 or iters < 1 or passes < 1:
        raise RequestError("--past, --iters and --passes must be positive")
    from loopcast.exporter.export import MAX_VERIFY_WIDTH

    if not width_list or any(not 2 <= w <= MAX_VERIFY_WIDTH for w in width_list):
        raise RequestError(f"--widths must be verify widths in 2..{MAX_VERIFY_WIDTH}, got {widths!r}")
    try:
        loop_list = tuple(int(r) for r in loops.split(",") if r)
    except ValueError:
        raise RequestError(f"--loops must be comma-separated integers, got {loops!r}") from None
    if any(r < 1 for r in loop_list):
        raise RequestError(f"--loops values must be >= 1, got {loops!r}")
    try:
        rejects = tuple(float(f) for f in oracle_reject.split(",") if f)
    except ValueError:
        raise RequestError(
            f"--oracle-reject must be comma-separated fractions, got {oracle_reject!r}"
        ) from None
    if any(not 0 <= f <= 1 for f in rejects):
        raise RequestError(f"--oracle-reject fractions must be in 0..1, got {oracle_reject!r}")
    opts = BenchOptions(
        checkpoint,
        work_dir,
        device,
        dtypes or (("fp16", "bf16") if device == "cuda" else ("fp32",)),
        variants or default_variants(device),
        past,
        width_list,
        iters,
        new_tokens,
        not no_end_to_end,
        alternate_tokens,
        not no_torch,
        not no_profile,
        rejects,
        passes,
        threads,
        quantize or ("none",),
        loop_list,
        kl_threshold,
    )
    click.echo(f"bench on {device}: artifacts in {work_dir}, report {out}", err=True)
    report = run_bench(
        opts,
        log=lambda line: click.echo(line, err=True),
        on_progress=lambda partial: write_report(partial, out, plot=False),
    )
    click.echo(format_table(report))
    for path in write_report(report, out):
        click.echo(f"wrote {path}")
