"""Every refusal of the server is an OpenAI error object (``{"error": {"message", "type", "param",
"code"}}``) with a 4xx status, routing errors included, and no body names a path of the
server's file system."""

from __future__ import annotations

import json

import pytest

from tests.adversarial.requests.request_cases import MODEL, assert_openai_error, case, params

H = "http-errors"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}

ROWS = [
    case(
        "server",
        H,
        "unknown-route",
        ("GET", "/v2/nothing", None),
        "Invalid URL (GET /v2/nothing)",
        status=404,
    ),
    case("server", H, "unknown-post-route", ("POST", "/v1/embeddings", {}), "Invalid URL", status=404),
    case("server", H, "root", ("GET", "/", None), "Invalid URL (GET /)", status=404),
    case("server", H, "get-completions", ("GET", "/v1/completions", None), "method not allowed", status=405),
    case("server", H, "put-chat", ("PUT", "/v1/chat/completions", CHAT), "method not allowed", status=405),
    case("server", H, "post-health", ("POST", "/health", {}), "method not allowed", status=405),
    case("server", H, "delete-models", ("DELETE", "/v1/models", None), "method not allowed", status=405),
    case(
        "server",
        H,
        "unknown-model",
        ("POST", "/v1/completions", {"model": "x", "prompt": "a"}),
        "does not exist",
        status=404,
    ),
    case(
        "server", H, "body-not-json", ("POST", "/v1/completions", b"{not json"), "not valid JSON", status=400
    ),
    case(
        "server",
        H,
        "body-not-object",
        ("POST", "/v1/completions", [1, 2]),
        "must be a JSON object",
        status=400,
    ),
    case(
        "server", H, "deep-nesting", ("POST", "/v1/completions", b"[" * 100000), "not valid JSON", status=400
    ),
    case(
        "server",
        H,
        "bad-content-length",
        ("POST", "/v1/completions", b'{"model": "demo"}'),
        "Content-Length must be a byte count",
        status=400,
        headers={"content-length": "-5"},
    ),
    case(
        "server",
        H,
        "float-token-ids",
        ("POST", "/v1/completions", {"model": MODEL, "prompt": [1.5, 2]}),
        "invalid request: prompt",
        status=400,
    ),
    case(
        "server",
        H,
        "bool-token-ids",
        ("POST", "/v1/completions", {"model": MODEL, "prompt": [True, 2]}),
        "invalid request: prompt",
        status=400,
    ),
    case(
        "server",
        H,
        "bool-max-tokens",
        ("POST", "/v1/completions", {"model": MODEL, "prompt": "a", "max_tokens": True}),
        "invalid request: max_tokens",
        status=400,
    ),
    case(
        "server",
        H,
        "float-max-tokens",
        ("POST", "/v1/completions", {"model": MODEL, "prompt": "a", "max_tokens": 1.5}),
        "invalid request: max_tokens",
        status=400,
    ),
    case(
        "server",
        H,
        "string-temperature",
        ("POST", "/v1/completions", {"model": MODEL, "prompt": "a", "temperature": "0"}),
        "invalid request: temperature",
        status=400,
    ),
    case(
        "server",
        H,
        "token-id-out-of-vocab",
        ("POST", "/v1/completions", {"model": MODEL, "prompt": [10**6], "max_tokens": 1}),
        "outside the vocabulary",
        status=400,
    ),
    case(
        "server",
        H,
        "template-error-names-no-path",
        ("POST", "/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": "loop forever"}]}),
        "chat template",
        status=400,
    ),
]


@pytest.mark.parametrize("row", params(ROWS))
def test_http_error_shape(row, http, adversarial_artifact) -> None:
    method, route, body = row.given
    kwargs: dict = {"headers": row.extra.get("headers", {})}
    if isinstance(body, bytes):
        kwargs["content"] = body
    elif body is not None:
        kwargs["content"] = json.dumps(body).encode()
    r = http.request(method, route, **kwargs)
    hidden = (str(adversarial_artifact), str(adversarial_artifact.parent))
    error = assert_openai_error(r, row.extra["status"], row.expect, hidden=hidden)
    assert error["type"] == "invalid_request_error"
    if r.status_code == 405:
        assert r.headers["allow"]  # the methods the route takes, as HTTP asks


def test_health_and_models_still_answer(http) -> None:
    assert http.get("/health").json()["status"] == "ok"
    assert http.get("/v1/models").json()["data"][0]["id"] == MODEL
