"""Bounded work: a chat template cannot run or grow without end (ort_runtime/text/template_sandbox.py),
a request body cannot exceed the server's limit (serve/limits.py), and the server keeps answering
/health while a request's prompt is being prepared. Every pathological case ends within seconds
with one error."""

from __future__ import annotations

import dataclasses
import json
import threading
import time

import pytest
from loopcast.ort_runtime.text.chat import load_chat_template
from loopcast.ort_runtime.text.template_sandbox import RenderLimits

from loopcast.errors import RequestError
from tests.adversarial.requests.request_cases import (
    MODEL,
    assert_one_error_line,
    assert_openai_error,
    case,
    client,
    invoke,
    params,
)
from tests.artifacts import artifact

QUICKLY = 6.0  # seconds: every bounded case ends well within this on 2 busy cores
HI = [{"role": "user", "content": "hi"}]

TEMPLATES = [
    case(
        "api",
        "bounded-work",
        "nested-loops-1e10",
        "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
        "rendering stopped",
    ),
    case(
        "api",
        "bounded-work",
        "nested-loops-over-a-list",
        "{% set r = range(100000)|list %}{% for i in r %}{% for j in r %}{% endfor %}{% endfor %}",
        "rendering stopped",
    ),
    case(
        "api",
        "bounded-work",
        "renders-20MB",
        "{% for i in range(20000) %}{{ 'x' * 1000 }}{% endfor %}",
        "rendered more than",
    ),
    case("api", "bounded-work", "one-20MB-product", "{{ 'x' * 20000000 }}", "multiplies a sequence"),
    case("api", "bounded-work", "list-product", "{{ ([1] * 100000000)|length }}", "multiplies a sequence"),
    case(
        "api",
        "bounded-work",
        "join-of-big-strings",
        "{{ (['x' * 4000000] * 4000000)|join }}",
        "multiplies a sequence",
    ),
    case(
        "api",
        "bounded-work",
        "list-of-big-strings-grows",
        "{% set a = ['x' * 3000000] %}{% set b = a + a %}{{ b|join|length }}",
        "built a value",
    ),
    case("api", "bounded-work", "huge-power", "{{ 2 ** 100000000 }}", "to the power"),
    case(
        "api",
        "bounded-work",
        "doubling-concat",
        "{% set a = 'x' * 100000 %}{% set b = a ~ a %}{% set c = b ~ b %}{% set d = c ~ c %}"
        "{% set e = d ~ d %}{% set f = e ~ e %}{% set g = f ~ f %}{{ g|length }}",
        "built a value",
    ),
    case(
        "api",
        "bounded-work",
        "doubling-plus",
        "{% set a = 'x' * 100000 %}{% set b = a + a %}{% set c = b + b %}{% set d = c + c %}"
        "{% set e = d + d %}{% set f = e + e %}{% set g = f + f %}{{ g|length }}",
        "built a value",
    ),
    case(
        "api",
        "bounded-work",
        "namespace-doubling",
        "{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}"
        "{% endfor %}{{ ns.s|length }}",
        "built a value",
    ),
    case("api", "bounded-work", "ljust-1e9", "{{ 'x'.ljust(1000000000) }}", "calls ljust"),
    case("api", "bounded-work", "center-filter-1e9", "{{ 'x'|center(1000000000) }}", "width of"),
    case("api", "bounded-work", "percent-width-1e9", "{{ '%1000000000s' % 'x' }}", "width of"),
    case("api", "bounded-work", "star-width-1e9", "{{ '%*s' % (1000000000, 'x') }}", "width of"),
    case("api", "bounded-work", "nested-format-width", "{{ '{0:{1}}'.format('x', 1000000000) }}", "calls"),
    case("api", "bounded-work", "format-width-1e9", "{{ '{:>1000000000}'.format('x') }}", "width of"),
    case("api", "bounded-work", "format-filter-1e9", "{{ '%1000000000s'|format('x') }}", "width of"),
    case(
        "api",
        "bounded-work",
        "endless-macro",
        "{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}",
        "recursed",
    ),
    case(
        "api",
        "bounded-work",
        "recursive-loop",
        "{% for i in range(3) recursive %}{{ loop(range(100000)) }}{% endfor %}",
        "recursed",
    ),
]


def _template(tmp_path, source: str):
    """A tokenizer directory whose chat template is ``source`` (the text layer's own loader)."""
    import shutil

    src = artifact("demo")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / name, tmp_path / name)
    (tmp_path / "chat_template.jinja").write_text(source)
    return load_chat_template(tmp_path)


@pytest.mark.parametrize("row", params(TEMPLATES))
def test_pathological_template_ends_quickly_with_one_error(tmp_path, row) -> None:
    template = _template(tmp_path, row.given)
    start = time.perf_counter()
    with pytest.raises(RequestError, match="chat template") as info:
        template.render(HI)
    assert time.perf_counter() - start < QUICKLY
    assert row.expect in str(info.value) and info.value.parameter == "messages"


def test_the_deadline_stops_a_template_the_step_count_allows(tmp_path) -> None:
    template = _template(tmp_path, TEMPLATES[0].given)
    template = dataclasses.replace(template, limits=RenderLimits(max_seconds=0.05, max_steps=10**12))
    start = time.perf_counter()
    with pytest.raises(RequestError, match=r"ran longer than 0.05 s"):
        template.render(HI)
    assert time.perf_counter() - start < 3.0  # the deadline itself, with room for a busy machine


def test_messages_that_render_past_the_size_limit_are_refused(tmp_path) -> None:
    template = _template(tmp_path, "{% for m in messages %}{{ m.content }}{% endfor %}")
    small = dataclasses.replace(template, limits=RenderLimits(max_chars=1000))
    assert small.render([{"role": "user", "content": "y" * 999}]) == "y" * 999
    with pytest.raises(RequestError, match="rendered more than 1000 characters"):
        small.render([{"role": "user", "content": "y" * 1001}])


def test_the_width_checked_filters_still_work(tmp_path) -> None:
    # numbers in a format string's text are not widths; small widths format as jinja2 does
    source = (
        "{{ 'build 20261202: %s' % 'x' }}|{{ 'on 20261202 {}'.format('y') }}|"
        "{{ '%5.2f|%-3d|%%' % (1.5, 2) }}|"
        "{{ '%*s' % (3, 'z') }}|{{ '{0:{1}}'.format('w', 4) }}|"
        "{{ 'hello world foo'|truncate(9) }}|{{ 'aaa bbb'|wordwrap(3) }}|{{ 'x'|center(3) }}|"
        "{{ [1, 2, 3]|batch(2)|list }}|{{ [1, 2, 3]|slice(2)|list }}|{{ 'a\nb'|indent(2) }}|"
        "{{ '%s-%d'|format('a', 1) }}"
    )
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    plain = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True).from_string(source)
    assert _template(tmp_path, source).render(HI) == plain.render(messages=HI, add_generation_prompt=True)


def test_ordinary_templates_render_many_messages_within_the_limits(tmp_path) -> None:
    # a long conversation over the features real templates use stays far inside the bounds
    source = (
        "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}"
        "{{ '<|' ~ m.role ~ '|>' + m.content | tojson }}{% if not loop.last %}\n{% endif %}"
        "{% endfor %}{{ ns.n }}"
    )
    template = _template(tmp_path, source)
    text = template.render([{"role": "user", "content": "t"}] * 2000)
    assert text.endswith("2000") and text.count("<|user|>") == 2000


# -- the same bound through the three entry points (the artifact's own template) -------------------

ENTRY_ROWS = [
    case("api", "bounded-work", "generate-messages-loop-forever", "loop forever", "ran more than"),
    case("api", "bounded-work", "generate-messages-huge", "huge", "rendered more than"),
    case("cli", "bounded-work", "generate-chat-loop-forever", "loop forever", "ran more than"),
    case("cli", "bounded-work", "generate-chat-huge", "huge", "rendered more than"),
    case("server", "bounded-work", "chat-loop-forever", "loop forever", "ran more than"),
    case("server", "bounded-work", "chat-huge", "huge", "rendered more than"),
]


@pytest.mark.parametrize("row", params(ENTRY_ROWS))
def test_pathological_template_through_each_entry_point(row, adversarial_artifact, model, request) -> None:
    messages = [{"role": "user", "content": row.given}]
    start = time.perf_counter()
    if row.entry == "api":
        with pytest.raises(RequestError, match=row.expect) as info:
            model.generate(messages=messages, max_new_tokens=2)
        assert info.value.parameter == "messages"
    elif row.entry == "cli":
        result = invoke("generate", adversarial_artifact, "--chat", row.given, "--max-new-tokens", "2")
        assert_one_error_line(result, row.expect)
    else:
        http = request.getfixturevalue("http")
        r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": messages, "max_tokens": 2})
        assert_openai_error(r, 400, row.expect, hidden=(str(adversarial_artifact),))
    assert time.perf_counter() - start < QUICKLY + 5  # the CLI also loads the model


# -- request bodies -----------------------------------------------------------------------------

BODY_ROWS = [
    case("server", "bounded-work", "declared-length-over-default", "declared", "larger than", limit=None),
    case("server", "bounded-work", "chunked-over-default", "chunked", "more than", limit=None),
    case(
        "server", "bounded-work", "declared-length-over-small-limit", "declared", "limit of 1024", limit=1024
    ),
    case("server", "bounded-work", "chunked-over-small-limit", "chunked", "limit of 1024", limit=1024),
]


def _big_completion(size: int) -> bytes:
    head = json.dumps({"model": MODEL, "max_tokens": 1, "prompt": ""})[:-2].encode()
    return head + b"x" * (size - len(head) - 2) + b'"}'


@pytest.mark.parametrize("row", params(BODY_ROWS))
def test_bodies_past_the_limit_get_413(serving, row) -> None:
    from loopcast.serve.limits import DEFAULT_MAX_BODY_BYTES

    limit = row.extra["limit"]
    body = _big_completion((limit or DEFAULT_MAX_BODY_BYTES) + 1)
    options = {} if limit is None else {"max_body_bytes": limit}
    with client(serving, **options) as c:
        if row.given == "declared":
            r = c.post("/v1/completions", content=body, headers={"content-type": "application/json"})
        else:  # no Content-Length: counted as it streams in
            r = c.post("/v1/completions", content=iter([body[:512], body[512:]]))
        error = assert_openai_error(r, 413, row.expect)
        assert error["code"] == "request_too_large"


def test_a_body_at_the_limit_is_served(serving) -> None:
    body = json.dumps({"model": MODEL, "prompt": "def f():", "max_tokens": 1, "temperature": 0}).encode()
    with client(serving, max_body_bytes=len(body)) as c:
        assert c.post("/v1/completions", content=body).status_code == 200
        assert c.post("/v1/completions", content=body + b" ").status_code == 413


def test_health_answers_while_a_prompt_is_rendered(http, serving, monkeypatch) -> None:
    """While a chat prompt is being rendered, /health answers at once: the rendering runs in a
    worker thread, not on the event loop. The rendering is held until /health has answered; had
    it run on the event loop, /health would wait for the hold to time out and find it released."""
    rendering, release = threading.Event(), threading.Event()
    released_by_timeout: list[bool] = []
    render = serving.chat_ids

    def held_render(*args, **kwargs):
        rendering.set()
        released_by_timeout.append(not release.wait(10))
        return render(*args, **kwargs)

    monkeypatch.setattr(serving, "chat_ids", held_render)
    status: dict[str, int] = {}

    def chat() -> None:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 1}
        status["chat"] = http.post("/v1/chat/completions", json=body).status_code

    worker = threading.Thread(target=chat)
    worker.start()
    try:
        assert rendering.wait(10), "the chat request never reached its rendering"
        assert http.get("/health").status_code == 200
        assert not release.is_set() and released_by_timeout == [], "/health waited for the rendering"
    finally:
        release.set()
        worker.join(30)
    assert status["chat"] == 200 and released_by_timeout == [False]
