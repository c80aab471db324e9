"""Which generation options an engine honours per request, checked generically.

A request carries one ``GenerationConfig`` (ort_runtime/decoding/generation_config.py); an engine
declares the keyword options (``GenerationConfig.replace``'s names: ``num_draft_tokens``,
``speculative``, ...) it implements. Any other option a request sets to a non-default value is
refused by name (``RequestError(parameter=...)``: HTTP 400 naming the field), never silently
ignored. So a new GenerationConfig field reaches the server with one request-body line, and an
engine serves it once it adds the name to what it honours.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection

from loopcast.ort_runtime.decoding.generation_config import GenerationConfig

from loopcast.errors import RequestError


def set_options(config: GenerationConfig) -> list[str]:
    """The keyword options of ``config`` that differ from the defaults, by their keyword names."""
    default = GenerationConfig()
    names = [
        f.name
        for f in dataclasses.fields(config)
        if f.name != "speculation" and getattr(config, f.name) != getattr(default, f.name)
    ]
    for keyword, attr in GenerationConfig._SPECULATION_KEYWORDS.items():
        if getattr(config.speculation, attr) != getattr(default.speculation, attr):
            names.append(keyword)
    return names


def check_honoured(config: GenerationConfig, honoured: Collection[str], engine: str) -> None:
    """Refuse the first option ``config`` sets that ``engine`` does not implement."""
    for name in set_options(config):
        if name not in honoured:
            raise RequestError(
                f"{name} is not supported by the {engine}; it serves {', '.join(sorted(honoured))}",
                parameter=name,
            )
