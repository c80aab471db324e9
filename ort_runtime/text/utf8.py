"""Text that can be encoded: a Python ``str`` may hold lone surrogates (``"\\ud800"`` from a JSON
escape, ``"\\udcff"`` from undecodable command-line bytes under ``surrogateescape``) that no UTF-8
tokenizer accepts. Every entry point checks its text here once, and refuses it with one
``RequestError`` naming the parameter, instead of failing deep inside the tokenizer."""

from __future__ import annotations

from collections.abc import Mapping

from loopcast.errors import RequestError


def checked_text(text: str, parameter: str) -> str:
    """``text`` if it is valid Unicode (encodable as UTF-8), else a RequestError for ``parameter``."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        bad = text[exc.start]
        hint = " (bytes that are not UTF-8)" if 0xDC80 <= ord(bad) <= 0xDCFF else " (a lone surrogate)"
        raise RequestError(
            f"{parameter} is not valid UTF-8 text: U+{ord(bad):04X} at character {exc.start}{hint}",
            parameter=parameter,
        ) from None
    return text


def check_texts(value: object, parameter: str, depth: int = 0) -> None:
    """Every string inside ``value`` (nested dicts and lists, as chat messages are) is valid."""
    if isinstance(value, str):
        checked_text(value, parameter)
    elif depth < 32 and isinstance(value, Mapping):
        for k, v in value.items():
            check_texts(k, parameter, depth + 1)
            check_texts(v, parameter, depth + 1)
    elif depth < 32 and isinstance(value, (list, tuple)):
        for v in value:
            check_texts(v, parameter, depth + 1)
