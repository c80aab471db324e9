r"""The request-side adversarial table: one row per (entry point, category, case).

Each test module of this folder lists its rows with :func:`case` and parametrizes over them, so
``pytest --collect-only -q tests/adversarial`` lists every case by id
(``entry/category/name``; ``| grep -o '\[[a-z]*/[a-z0-9-]*/' | sort | uniq -c`` counts them per
entry point and category). A row is data: what to send and the fragment the one clean refusal
must contain; the module's test says how to send it through the entry point's public interface
(the CLI's ``main``, the Python API, HTTP), and asserts the refusal's form (one ``error:`` line
and exit 2; a ``LoopcastError`` naming the parameter; a 4xx OpenAI error object) and that
nothing hung.

Categories (the closing note of a pass counts cases per category):

    bounded-work     chat templates that loop or grow without end; request bodies past the limit;
                     /health while a request's prompt is prepared
    non-utf8         text that is not valid Unicode at every entry point
    arguments        Python API arguments of the wrong type or range, foreign generators and
                     proposers
    cli-flags        flags out of range, contradictory flags, a port in use, a missing path
    http-errors      the server's 404/405/413/400 bodies in OpenAI's shape, without server paths
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import pytest
from click.testing import CliRunner
from loopcast.cli import main

MODEL = "demo"  # the served model's name in the server cases
ENTRIES = ("cli", "api", "server")
CATEGORIES = ("bounded-work", "non-utf8", "arguments", "cli-flags", "http-errors")


@dataclass(frozen=True)
class Case:
    entry: str  # one of ENTRIES
    category: str  # one of CATEGORIES
    name: str
    given: Any  # what is sent: argv, keyword arguments, an HTTP request, a template
    expect: str  # a fragment of the one refusal's message
    extra: dict = field(default_factory=dict)  # per-module details (status, parameter, ...)

    def __post_init__(self) -> None:
        assert self.entry in ENTRIES and self.category in CATEGORIES, self

    @property
    def id(self) -> str:
        return f"{self.entry}/{self.category}/{self.name}"


def case(entry: str, category: str, name: str, given: Any, expect: str, **extra: Any) -> Case:
    return Case(entry, category, name, given, expect, extra)


def params(cases: Iterable[Case]) -> list:
    """``cases`` as pytest params with their ids; duplicate ids are a table error."""
    cases = list(cases)
    ids = [c.id for c in cases]
    assert len(ids) == len(set(ids)), [i for i in ids if ids.count(i) > 1]
    return [pytest.param(c, id=c.id) for c in cases]


def client(state, **app_options):
    """A TestClient over a new app on ``state`` (use it as a context manager)."""
    from fastapi.testclient import TestClient
    from loopcast.serve.app import create_app

    return TestClient(
        create_app(state, close_on_shutdown=False, **app_options), raise_server_exceptions=False
    )


def invoke(*args, input=None):
    return CliRunner().invoke(main, [a if isinstance(a, str) else str(a) for a in args], input=input)


def assert_one_error_line(result, fragment: str) -> str:
    """The CLI's refusal: exit 2, nothing on stdout, one ``error:`` line on stderr, no traceback."""
    assert result.exit_code == 2, (result.exit_code, result.output, result.exception)
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert fragment in lines[0], lines[0]
    return lines[0]


def assert_openai_error(response, status: int, fragment: str, *, hidden: tuple[str, ...] = ()) -> dict:
    """A 4xx OpenAI error object carrying ``fragment``, and none of the ``hidden`` strings (the
    server's file-system paths)."""
    assert response.status_code == status, (response.status_code, response.text)
    body = response.json()
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and fragment in error["message"], error
    for secret in hidden:
        assert secret not in response.text, response.text
    return error
