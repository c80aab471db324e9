"""``loopcast random-checkpoint``: a random-weight checkpoint of a preset shape."""

from __future__ import annotations

from pathlib import Path

import click


@click.command("random-checkpoint")
@click.argument("out_dir", type=click.Path(path_type=Path))
@click.option(
    "--preset",
    default="tiny-ouro",
    show_default=True,
    help=(
        "Shape preset: tiny-ouro, tiny-llama, tiny-qwen2, tiny-huginn, smollm-135m, ouro-1.4b, "
        "llama-1.4b or huginn-3.5b."
    ),
)
@click.option("--dtype", type=click.Choice(["fp32", "fp16", "bf16"]), default="fp32", show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--max-shard-mb", type=int, default=None, help="Shard the weights above this size.")
def random_checkpoint(out_dir: Path, preset: str, dtype: str, seed: int, max_shard_mb: int | None) -> None:
    """Write a random-weight Hugging Face checkpoint of a preset shape."""
    from loopcast.errors import ConfigError
    from loopcast.presets import PRESETS
    from loopcast.torch_extra import require_torch

    require_torch("random-checkpoint")
    from loopcast.exporter.checkpoint import DTYPES
    from loopcast.exporter.random_checkpoint import write_random_checkpoint

    if preset not in PRESETS:
        raise ConfigError(f"unknown preset {preset!r}; choose from {', '.join(PRESETS)}")
    config = PRESETS[preset]
    if max_shard_mb is not None and max_shard_mb < 1:
        raise ConfigError(f"--max-shard-mb must be >= 1, got {max_shard_mb}")
    try:
        path = write_random_checkpoint(
            config,
            out_dir,
            seed=seed,
            dtype=DTYPES[dtype],
            max_shard_bytes=max_shard_mb * 2**20 if max_shard_mb else None,
        )
    except OSError as exc:  # an unwritable or full destination is the user's input, not a bug
        from loopcast.errors import CheckpointError

        raise CheckpointError(
            f"{exc.filename or out_dir}: cannot write the checkpoint ({exc.strerror or exc})"
        ) from None
    click.echo(f"wrote {path}")
