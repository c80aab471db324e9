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
    """The keyword options of ``config`` that differ from the defaults, by their keyword names:
    a field's name, or for a field that is itself an options record (``speculation``) each of its
    fields' keyword (``SpeculationConfig.mode`` is ``speculative``)."""
    default = GenerationConfig()
    keyword = {attr: name for name, attr in GenerationConfig._SPECULATION_KEYWORDS.items()}
    names = []
    for f in dataclasses.fields(config):
        value, base = getattr(config, f.name), getattr(default, f.name)
        if dataclasses.is_dataclass(value) and type(value) is type(base) and f.name != "sampling":
            names += [
                keyword.get(sub.name, sub.name)
                for sub in dataclasses.fields(value)
                if getattr(value, sub.name) != getattr(base, sub.name)
            ]
        elif value != base:
            names.append(f.name)
    return names


def check_honoured(config: GenerationConfig, honoured: Collection[str], engine: str) -> None:
    """Refuse the first option ``config`` sets that ``engine`` does not implement."""
    for name in set_options(config):
        if name not in honoured:
            raise RequestError(
                f"{name} is not supported by the {engine}; it serves {', '.join(sorted(honoured))}",
                parameter=name,
            )
