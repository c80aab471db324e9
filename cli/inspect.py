"""``loopcast inspect``: explain a checkpoint or an artifact."""

from __future__ import annotations

import os
from pathlib import Path

import click


@click.command()
@click.argument("path")
@click.option(
    "--verify", is_flag=True, help="Artifact: also check the SHA-256 of every file the manifest records."
)
def inspect(path: str, verify: bool) -> None:
    """Explain a checkpoint directory (or `demo`), a GGUF file or an exported artifact."""
    if not Path(path).exists():
        from loopcast.swap import recover

        recover(Path(path), clean=False)  # an export killed mid-swap: put the artifact back
    if os.path.lexists(Path(path) / "manifest.json"):  # any kind: describe_artifact says what is wrong
        from loopcast.ort_runtime.loading.describe import describe_artifact

        click.echo(describe_artifact(Path(path), verify=verify))
        return
    if verify:
        from loopcast.errors import RequestError

        raise RequestError(
            f"{path}: --verify checks an exported artifact; this is not one (no manifest.json)"
        )
    from loopcast.exporter.gguf_source import GGUFSource, is_gguf

    if is_gguf(path):
        click.echo(GGUFSource(path).describe())
        return
    from loopcast.exporter.inspect_checkpoint import describe_checkpoint

    click.echo(describe_checkpoint(path))
