"""The project's vocabularies as enums: one place names each choice a user or an artifact makes.

They are ``StrEnum``s, so the strings of the CLI, the manifest and the JSON API stay what they
were (``SpeculativeMode("self") == "self"``).
"""

from __future__ import annotations

from enum import StrEnum
from typing import TypeVar

from loopcast.errors import RequestError

E = TypeVar("E", bound=StrEnum)


class SpeculativeMode(StrEnum):
    """Who drafts: nobody (plain decoding), prompt lookup, the model's shallow loops (self), the
    pipeline's lanes, or a caller's own proposer (custom)."""

    NONE = "none"
    PROMPT_LOOKUP = "prompt-lookup"
    SELF = "self"
    PIPELINE = "pipeline"
    CUSTOM = "custom"


class GateKind(StrEnum):
    """When a step speculates (ort_runtime/decoding/gates.py). ``ALWAYS`` speculates on every
    step a proposer has drafts for (measurements); ``AUTO`` is the calibrated cost gate."""

    AUTO = "auto"
    ALWAYS = "always"
    HIT_DENSITY = "hit-density"
    COST = "cost"


def parse(enum: type[E], value: object, parameter: str) -> E:
    """``value`` as a member of ``enum``, or a RequestError that names ``parameter`` and the choices."""
    try:
        return enum(value if isinstance(value, str) else str(value))
    except ValueError:
        raise RequestError(f"{parameter} must be one of {', '.join(choices(enum))}, got {value!r}") from None


def choices(enum: type[StrEnum]) -> list[str]:
    """The choice list of an enum, in declaration order (the CLI's click.Choice lists)."""
    return [member.value for member in enum]
