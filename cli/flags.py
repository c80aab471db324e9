"""Library errors name parameters; the CLI names its flags. One mapping, used for every command.

The library validates with the names of its keyword API (``GenerationConfig``'s:
``num_draft_tokens must be >= 1, got 0``); a user of the CLI typed ``--num-draft-tokens``. The
parameter at fault is the error's ``parameter`` attribute (``RequestError(..., parameter=...)``)
or, for a message that carries none, the ``NAME`` of a leading ``NAME must``. It becomes the flag
of the running command's click option of that name (``ALIASES``: config fields spelled otherwise
than their flag). A parameter the command has no flag for leaves the message as the library
wrote it, so ``head_dim must be even`` stays, and ``sampling top_p must be ...`` names its field.
"""

from __future__ import annotations

import re

import click

# Config field names whose flag is spelled otherwise (SpeculationConfig.mode is --speculative).
# draft_loops (a recurrent-depth artifact's draft core steps) is --draft-depth.
ALIASES = {"mode": "speculative", "draft_loops": "draft_depth"}

_LEADING = re.compile(r"^([a-z_][a-z0-9_]*) must ")


def flag_of(command: click.Command | None, parameter: str) -> str | None:
    """The flag of ``command``'s option for library ``parameter`` (``--num-draft-tokens``), or None."""
    if command is None:
        return None
    name = ALIASES.get(parameter, parameter)
    for param in command.params:
        if isinstance(param, click.Option) and param.name == name:
            return next((opt for opt in param.opts if opt.startswith("--")), param.opts[0])
    return None


def parameter_of(exc: Exception) -> str | None:
    """The library parameter an error is about: its ``parameter``, else the name its message starts
    with (``NAME must ...``, the form of GenerationConfig's checks)."""
    named = getattr(exc, "parameter", None)
    if named:
        return named
    match = _LEADING.match(str(exc))
    return match.group(1) if match else None


def with_flags(exc: Exception, command: click.Command | None) -> str:
    """``exc``'s message with the parameter at fault named by ``command``'s flag."""
    message = str(exc)
    parameter = parameter_of(exc)
    flag = flag_of(command, parameter) if parameter else None
    if flag is None or flag in message:
        return message
    named = re.compile(rf"(?<![\w-]){re.escape(parameter)}(?!\w)")
    if named.search(message):
        return named.sub(flag, message, count=1)
    return f"{flag}: {message}"
