"""What one request may cost the server before any model work: its body's size and its text.

- A body is read through :func:`read_body`: a ``Content-Length`` above the limit is refused before
  a byte is read, and a body sent without one (chunked) is counted as it streams in and refused
  the moment it passes the limit, so a client cannot make the server buffer more than
  ``max_body_bytes`` (``loopcast serve --max-body-bytes``; 413 ``request_too_large``).
- JSON parsing, validation, tokenization and chat-template rendering run in a worker thread
  (``off_loop``), never on the event loop, so ``/health`` and streaming responses keep
  answering while one request's prompt is being prepared.
- A JSON string may spell a lone surrogate (``"\\ud800"``), which no UTF-8 tokenizer takes:
  :func:`lone_surrogate_at` names the field so that it is refused with a 400.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, TypeVar

from loopcast.errors import RequestError

DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024
T = TypeVar("T")


class BodyTooLarge(RequestError):
    """A request body past the server's limit (HTTP 413)."""


def declared_length(headers) -> int | None:
    """The ``Content-Length`` a client declared, or None; a malformed one is a RequestError."""
    raw = headers.get("content-length")
    if raw is None:
        return None
    if not raw.strip().isdigit():
        raise RequestError(f"Content-Length must be a byte count, got {raw[:40]!r}")
    return int(raw)


def _too_large(size: int | str, limit: int) -> BodyTooLarge:
    return BodyTooLarge(
        f"the request body ({size} bytes) is larger than this server's limit of {limit} bytes "
        "(loopcast serve --max-body-bytes)"
    )


async def read_body(request, limit: int) -> bytes:
    """The body of ``request``, at most ``limit`` bytes (else BodyTooLarge, before or while reading)."""
    declared = declared_length(request.headers)
    if declared is not None and declared > limit:
        raise _too_large(declared, limit)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _too_large(f"more than {limit}", limit)
        chunks.append(chunk)
    return b"".join(chunks)


async def off_loop(func: Callable[..., T], *args: Any) -> T:
    """``func(*args)`` in the server's worker threads: CPU work that must not stall the event loop."""
    from starlette.concurrency import run_in_threadpool

    return await run_in_threadpool(func, *args)


def lone_surrogate_at(value: object, where: str = "") -> str | None:
    """The dotted field (``messages.0.content``) of the first string in ``value`` that holds a lone
    surrogate, or None. Keys are checked too (a bad key is named with its surrogates escaped, so
    the answer itself is valid UTF-8); nesting is bounded by the JSON parser's own depth."""
    if isinstance(value, str):
        return None if _encodable(value) else (where or "body")
    items: Iterable[tuple[Any, Any]] = (
        value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    )
    for key, item in items:
        bad_key = isinstance(key, str) and not _encodable(key)
        name = str(key).encode("utf-8", "backslashreplace").decode() if bad_key else str(key)
        field = f"{where}.{name}" if where else name
        if bad_key:
            return field
        found = lone_surrogate_at(item, field)
        if found is not None:
            return found
    return None


def _encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
