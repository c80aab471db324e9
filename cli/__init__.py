"""The ``loopcast`` command line: the group, its one-line errors, and the commands (one module each).

Heavy imports happen inside commands, not at import time: ``loopcast --help`` loads neither
onnxruntime nor torch.
"""

from __future__ import annotations

import sys

import click
from loopcast.cli.bench import bench
from loopcast.cli.build_ops import build_ops
from loopcast.cli.demo import demo
from loopcast.cli.export import export
from loopcast.cli.flags import with_flags
from loopcast.cli.generate import generate
from loopcast.cli.inspect import inspect
from loopcast.cli.options import parse_ids as _parse_ids  # noqa: F401  (tests import it from here)
from loopcast.cli.random_checkpoint import random_checkpoint
from loopcast.cli.serve import serve

from loopcast.errors import LoopcastError


class _OneLineErrors(click.Group):
    """Every error the user can fix is one ``error:`` line on stderr and exit status 2: the
    LoopcastError family (its parameter named by the command's flag, cli/flags.py) and click's own
    usage errors (unknown option, bad value, missing argument) instead of a usage block. Anything
    else is a bug and keeps its traceback."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except LoopcastError as exc:
            name = ctx.invoked_subcommand
            command = self.get_command(ctx, name) if name else None
            click.echo(f"error: {with_flags(exc, command)}", err=True)
            sys.exit(2)

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        try:
            code = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except getattr(click.exceptions, "NoArgsIsHelpError", ()) as exc:  # bare `loopcast`: the help
            click.echo(exc.ctx.get_help())
            sys.exit(0)
        except click.ClickException as exc:
            ctx = getattr(exc, "ctx", None)
            where = f" (see `{ctx.command_path} --help`)" if ctx is not None else ""
            click.echo(f"error: {exc.format_message()}{where}", err=True)
            sys.exit(2)
        except click.exceptions.Abort:
            click.echo("error: aborted", err=True)
            sys.exit(1)
        if not standalone_mode:
            return code
        sys.exit(code if isinstance(code, int) else 0)


@click.group(cls=_OneLineErrors)
@click.version_option(package_name="loopcast")
def main() -> None:
    """Export looped transformers to ONNX and run them with ONNX Runtime."""


for _command in (inspect, random_checkpoint, export, generate, demo, bench, serve, build_ops):
    main.add_command(_command)
