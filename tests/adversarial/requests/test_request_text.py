"""Text that is not valid Unicode gets one clean refusal at every entry point: undecodable bytes
on the command line (Python hands them over as lone surrogates, ``surrogateescape``) or on
stdin, a lone surrogate in a Python ``str`` or spelled in a JSON string (``"\\ud800"``)."""

from __future__ import annotations

import json
import socket
import subprocess
import sys

import pytest

from loopcast.errors import RequestError
from tests.adversarial.requests.request_cases import (
    MODEL,
    assert_one_error_line,
    assert_openai_error,
    case,
    invoke,
    params,
)

BAD_ARG = "ab\udcffcd"  # what Python makes of the argv bytes b"ab\xffcd"
LONE = "ab\ud800cd"  # a lone high surrogate
C = "non-utf8"

CLI_ROWS = [
    case("cli", C, "argv-prompt", ["--prompt", BAD_ARG], "--prompt is not valid UTF-8"),
    case("cli", C, "argv-chat", ["--chat", BAD_ARG], "--chat is not valid UTF-8"),
    case("cli", C, "argv-second-chat", ["--chat", "hi", "--chat", BAD_ARG], "--chat is not valid UTF-8"),
    case("cli", C, "argv-system", ["--chat", "hi", "--system", BAD_ARG], "--system is not valid UTF-8"),
    case("cli", C, "argv-stop", ["--prompt", "hi", "--stop", BAD_ARG], "--stop is not valid UTF-8"),
    case("cli", C, "argv-lone-surrogate-prompt", ["--prompt", LONE], "--prompt is not valid UTF-8"),
    case("cli", C, "stdin-bytes", ["--prompt", "-"], "--prompt -: cannot read stdin", stdin=b"ab\xffcd"),
    case("cli", C, "stdin-truncated-utf8", ["--prompt", "-"], "cannot read stdin", stdin="é".encode()[:1]),
    case("cli", C, "prompt-file-bytes", ["--prompt-file", "{file}"], "--prompt-file", file=b"\xfe\xff"),
    case(
        "cli",
        C,
        "serve-model-name",
        ["--model-name", BAD_ARG],
        "--model-name is not valid UTF-8",
        command="serve",
    ),
]


@pytest.mark.parametrize("row", params(CLI_ROWS))
def test_cli_text(row, adversarial_artifact, tmp_path) -> None:
    args = list(row.given)
    if "file" in row.extra:
        (tmp_path / "p.txt").write_bytes(row.extra["file"])
        args = [a.replace("{file}", str(tmp_path / "p.txt")) for a in args]
    if row.extra.get("command") == "serve":
        pytest.importorskip("fastapi")
        pytest.importorskip("uvicorn")
        with socket.socket() as taken:  # should the name pass, the taken port ends the command
            taken.bind(("127.0.0.1", 0))
            taken.listen()
            result = invoke("serve", adversarial_artifact, *args, "--port", taken.getsockname()[1])
    else:
        stdin = row.extra.get("stdin")
        result = invoke("generate", adversarial_artifact, *args, "--max-new-tokens", "2", input=stdin)
    assert_one_error_line(result, row.expect)


def test_cli_argv_bytes_in_a_real_process(adversarial_artifact) -> None:
    """The bytes go through the OS's argv and Python's own decoding, not CliRunner's."""
    argv = [sys.executable, "-m", "loopcast.cli", "generate", str(adversarial_artifact).encode(), b"--prompt"]
    done = subprocess.run([*argv, b"ab\xffcd"], capture_output=True, timeout=120)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.decode(errors="replace").strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --prompt is not valid UTF-8"), lines
    assert done.stdout == b""


API_ROWS = [
    case("api", C, "prompt", {"prompt": LONE}, "prompt is not valid UTF-8", parameter="prompt"),
    case("api", C, "prompt-trailing", {"prompt": "x\udfff"}, "not valid UTF-8", parameter="prompt"),
    case(
        "api",
        C,
        "message-content",
        {"messages": [{"role": "user", "content": LONE}]},
        "messages is not valid UTF-8",
        parameter="messages",
    ),
    case(
        "api",
        C,
        "message-content-parts",
        {"messages": [{"role": "user", "content": [{"type": "text", "text": LONE}]}]},
        "messages is not valid UTF-8",
        parameter="messages",
    ),
    case(
        "api",
        C,
        "system-message",
        {"messages": [{"role": "system", "content": BAD_ARG}, {"role": "user", "content": "hi"}]},
        "messages is not valid UTF-8",
        parameter="messages",
    ),
    case(
        "api",
        C,
        "stop-string",
        {"prompt": "hi", "stop": ["ok", LONE]},
        "stop is not valid UTF-8",
        parameter="stop",
    ),
]


@pytest.mark.parametrize("row", params(API_ROWS))
def test_api_text(row, model) -> None:
    for call in (model.generate, lambda **kw: list(model.stream(**kw))):
        with pytest.raises(RequestError, match=row.expect) as info:
            call(max_new_tokens=2, **row.given)
        assert info.value.parameter == row.extra["parameter"]


# Bodies as the client sends them: the JSON escape \ud800 is valid JSON, its string is not text.
SERVER_ROWS = [
    case("server", C, "prompt", ("/v1/completions", '{"prompt": "a\\ud800b"}'), "prompt", param="prompt"),
    case(
        "server",
        C,
        "prompt-list",
        ("/v1/completions", '{"prompt": ["a\\udc80"]}'),
        "prompt",
        param="prompt.0",
    ),
    case(
        "server",
        C,
        "message-content",
        ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "\\udfff"}]}'),
        "messages.0.content",
        param="messages.0.content",
    ),
    case(
        "server",
        C,
        "message-extra-field",
        ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi", "name": "\\ud800"}]}'),
        "messages.0.name",
        param="messages.0.name",
    ),
    case(
        "server",
        C,
        "stop",
        ("/v1/completions", '{"prompt": "hi", "stop": ["\\ud800"]}'),
        "stop",
        param="stop.0",
    ),
    case(
        "server",
        C,
        "ignored-field",
        ("/v1/completions", '{"prompt": "hi", "user": "\\ud800"}'),
        "user",
        param="user",
    ),
    case("server", C, "key", ("/v1/completions", '{"prompt": "hi", "\\ud800": 1}'), "UTF-8", param="\\ud800"),
    case(
        "server",
        C,
        "raw-bytes",
        ("/v1/completions", b'{"model": "demo", "prompt": "a\xffb"}'),
        "not valid JSON",
        param=None,
    ),
]


@pytest.mark.parametrize("row", params(SERVER_ROWS))
def test_server_text(row, http, adversarial_artifact) -> None:
    route, body = row.given
    if isinstance(body, str):  # add the model and a length, keeping the escapes as sent
        body = body[:-1] + f', "model": "{MODEL}", "max_tokens": 2}}'
        body = body.encode()
    r = http.post(route, content=body, headers={"content-type": "application/json"})
    error = assert_openai_error(r, 400, row.expect, hidden=(str(adversarial_artifact),))
    assert error["param"] == row.extra["param"]
    assert error["type"] == "invalid_request_error"


def test_server_still_serves_after_refusing_text(http) -> None:
    r = http.post("/v1/completions", content=json.dumps({"model": MODEL, "prompt": "ok", "max_tokens": 1}))
    assert r.status_code == 200, r.text
