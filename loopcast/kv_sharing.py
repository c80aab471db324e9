"""The release's KV sharing across core steps (Huginn's ``compress-*`` cache lookups).

Without sharing, core step k's layer l has its own slot ``k·L + l`` (docs/architecture.md §2).
The release's cache can instead map the core block index ``b = k·L + l`` onto fewer entries:

- ``compress-s{c}``: slot ``b mod c`` (c = L: one slot per layer, rewritten at every step);
- ``compress-r{c}``: slot ``b div c`` (c consecutive blocks share one).

A shared slot holds, for each earlier position, the last block that wrote it, and for the
current rows what their current step just wrote: the attention of step k reads the earlier
tokens' latest entry of that slot, as the release's dict-per-position cache does with the
"full" lookup. The KV of a sequence then takes ``c`` (or ``ceil(r·L/c)``) core slots instead
of ``r·L``. Plain decoding only: a rewound position's deeper blocks are not rewritten by a
shallower call, so speculation over shared slots is not offered.
"""

from __future__ import annotations

import re

from loopcast.errors import ConfigError

_PATTERN = re.compile(r"compress-([sr])([1-9][0-9]*)")


def parse_sharing(name: str | None) -> tuple[str, int] | None:
    """``None`` (a slot per block) or (kind ``s``/``r``, c) from ``compress-s4``/``compress-r2``."""
    if name is None:
        return None
    match = _PATTERN.fullmatch(str(name))
    if not match:
        raise ConfigError(
            f"kv_sharing must be None, 'compress-s<c>' or 'compress-r<c>' (c >= 1), got {name!r}"
        )
    return match.group(1), int(match.group(2))


def core_kv_slot(num_layers: int, step: int, layer: int, sharing: tuple[str, int] | None) -> int:
    """The core slot of (step, layer) under ``sharing`` (parse_sharing's result)."""
    block = step * num_layers + layer
    if sharing is None:
        return block
    kind, c = sharing
    return block % c if kind == "s" else block // c
