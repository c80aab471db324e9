"""Command-line flags out of range or contradicting each other, a port in use and a missing path:
each one ``error:`` line and exit 2, before any model is loaded or any file written."""

from __future__ import annotations

import socket

import pytest

from tests.adversarial.requests.request_cases import assert_one_error_line, case, invoke, params

F = "cli-flags"
GEN = ["generate", "no-such-artifact", "--prompt-ids", "5,6"]  # refused before the path is opened
EXPORT = ["export", "demo", "-o", "{out}"]

ROWS = [
    case(
        "cli", F, "serve-port-70000", ["serve", "x", "--port", "70000"], "'--port': 70000 is not in the range"
    ),
    case("cli", F, "serve-port-0", ["serve", "x", "--port", "0"], "'--port': 0 is not in the range"),
    case("cli", F, "serve-port-negative", ["serve", "x", "--port", "-1"], "'--port'"),
    case(
        "cli",
        F,
        "serve-threads-negative",
        ["serve", "x", "--threads", "-1"],
        "'--threads': -1 is not in the range",
    ),
    case("cli", F, "serve-max-body-zero", ["serve", "x", "--max-body-bytes", "0"], "'--max-body-bytes'"),
    case("cli", F, "serve-prefill-rows-zero", ["serve", "x", "--prefill-rows", "0"], "'--prefill-rows'"),
    case(
        "cli",
        F,
        "serve-prefill-rows-eager",
        ["serve", "x", "--prefill-rows", "32"],
        "--prefill-rows needs --cuda-graphs",
    ),
    case(
        "cli",
        F,
        "generate-threads-negative",
        ["generate", "x", "--prompt", "a", "--threads", "-1"],
        "--threads",
    ),
    case(
        "cli",
        F,
        "export-ops-stock-batch-invariant",
        [*EXPORT, "--ops", "stock", "--batch-invariant"],
        "--batch-invariant means --ops loopcast; it contradicts --ops stock",
    ),
    case(
        "cli",
        F,
        "export-ops-attention-batch-invariant",
        [*EXPORT, "--ops", "loopcast-attention", "--batch-invariant"],
        "contradicts --ops loopcast-attention",
    ),
    case(
        "cli",
        F,
        "export-target-cuda-ops-stock",
        [*EXPORT, "--target", "cuda", "--ops", "stock"],
        "--target cuda builds the loopcast ops",
    ),
    case(
        "cli",
        F,
        "generate-draft-tokens-without-speculation",
        [*GEN, "--num-draft-tokens", "3"],
        "--num-draft-tokens goes with --speculative",
    ),
    case(
        "cli",
        F,
        "generate-gate-without-speculation",
        [*GEN, "--gate", "always"],
        "--gate goes with --speculative",
    ),
    case(
        "cli",
        F,
        "generate-allow-inexact-without-speculation",
        [*GEN, "--allow-inexact"],
        "--allow-inexact goes with --speculative",
    ),
    case(
        "cli",
        F,
        "generate-draft-depth-without-speculation",
        [*GEN, "--draft-depth", "1"],
        "--draft-depth goes with --speculative",
    ),
    case(
        "cli",
        F,
        "generate-pipeline-exit-with-self",
        [*GEN, "--speculative", "self", "--pipeline-exit", "2"],
        "--pipeline-exit goes with --speculative pipeline, not self",
    ),
    case(
        "cli",
        F,
        "generate-alternate-gap-with-prompt-lookup",
        [*GEN, "--speculative", "prompt-lookup", "--alternate-gap", "0.1"],
        "goes with --speculative self",
    ),
    case(
        "cli",
        F,
        "generate-top-p-at-temperature-0",
        [*GEN, "--temperature", "0", "--top-p", "0.5"],
        "--top-p shapes sampling, but --temperature 0 is greedy",
    ),
    case(
        "cli",
        F,
        "generate-penalty-at-temperature-0",
        [*GEN, "--temperature", "0", "--repetition-penalty", "1.2"],
        "--repetition-penalty shapes sampling",
    ),
    case(
        "cli",
        F,
        "generate-torch-threads",
        [*GEN, "--backend", "torch", "--threads", "2"],
        "--threads is an ONNX Runtime option",
    ),
    case(
        "cli",
        F,
        "generate-torch-trust-ops",
        [*GEN, "--backend", "torch", "--trust-ops"],
        "--trust-ops is an ONNX Runtime option",
    ),
    case("cli", F, "bench-missing-path", ["bench", "{out}", "--quick"], "checkpoint directory not found"),
]


@pytest.mark.parametrize("row", params(ROWS))
def test_cli_flag(row, tmp_path) -> None:
    out = tmp_path / "out"
    result = invoke(*[a.replace("{out}", str(out)) for a in row.given])
    assert_one_error_line(result, row.expect)
    assert not out.exists()  # nothing written


def test_a_port_in_use_is_one_error_line(tmp_path) -> None:
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        # the bind is checked before the artifact is read: a missing one is not what fails
        result = invoke("serve", tmp_path / "never-read", "--port", port)
    line = assert_one_error_line(result, f"--port: cannot listen on 127.0.0.1:{port}")
    assert "in use" in line.lower()


def test_the_same_flags_alone_are_accepted() -> None:
    """The refusals are about the combinations: each flag on its own passes the checks (and the
    command fails later, on the missing artifact)."""
    for args in (
        [*GEN, "--speculative", "prompt-lookup", "--num-draft-tokens", "3"],
        [*GEN, "--speculative", "pipeline", "--pipeline-exit", "2"],
        [*GEN, "--temperature", "0", "--seed", "1"],
        [*GEN, "--top-p", "0.5"],
    ):
        assert_one_error_line(invoke(*args), "no-such-artifact")
