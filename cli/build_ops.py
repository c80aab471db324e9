"""``loopcast build-ops``: compile the custom-op library."""

from __future__ import annotations

from pathlib import Path

import click


@click.command("build-ops")
@click.option(
    "-o",
    "--output",
    "out_dir",
    type=click.Path(path_type=Path),
    default=None,
    help="Directory for libloopcast_ops.so (default: custom_ops/build).",
)
@click.option(
    "--ort-include",
    type=click.Path(path_type=Path),
    default=None,
    help="Directory holding onnxruntime_cxx_api.h.",
)
def build_ops(out_dir: Path | None, ort_include: Path | None) -> None:
    """Compile the `loopcast` custom-op library (CPU kernels)."""
    from loopcast.custom_ops.build import build_library

    click.echo(f"built {build_library(out_dir, ort_include)}")
