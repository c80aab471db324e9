"""`loopcast generate`'s prompt sources (--prompt-file, --prompt -) and sampling options."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner
from loopcast.cli import main

from tests.artifacts import artifact

PROMPT = "def fibonacci(n):\n"


def _run(*args, input=None):
    return CliRunner().invoke(
        main, ["generate", str(artifact("demo")), "--max-new-tokens", "12", "--json", *args], input=input
    )


def _tokens(result) -> list[int]:
    assert result.exit_code == 0, result.output
    return json.loads(result.output)["tokens"]


def test_prompt_file_and_stdin_equal_prompt(tmp_path: Path) -> None:
    (tmp_path / "p.txt").write_text(PROMPT, encoding="utf-8")
    expected = _tokens(_run("--prompt", PROMPT))
    assert _tokens(_run("--prompt-file", str(tmp_path / "p.txt"))) == expected
    assert _tokens(_run("--prompt", "-", input=PROMPT)) == expected


def test_sampling_options_are_seeded() -> None:
    args = (
        "--prompt",
        PROMPT,
        "--temperature",
        "0.8",
        "--top-k",
        "40",
        "--top-p",
        "0.95",
        "--min-p",
        "0.01",
        "--repetition-penalty",
        "1.1",
    )
    a = _run(*args, "--seed", "7")
    assert _tokens(a) == _tokens(_run(*args, "--seed", "7"))
    assert json.loads(a.output)["stats"]["sampling"]["seed"] == 7
    runs = {tuple(_tokens(_run(*args, "--seed", str(s)))) for s in range(3)}
    assert len(runs) > 1
    greedy = _tokens(_run("--prompt", PROMPT))
    assert _tokens(_run("--prompt", PROMPT, "--temperature", "0")) == greedy


@pytest.mark.parametrize(
    "args,fragment",
    [
        (["--prompt", "x", "--prompt-file", "p.txt"], "got --prompt, --prompt-file"),
        (["--prompt-file", "/nonexistent/p.txt"], "/nonexistent/p.txt"),
        (["--system", "be brief", "--prompt", "x"], "--system goes with --chat"),
        (["--prompt", "x", "--temperature", "-1"], "temperature must be a finite number >= 0"),
        (["--prompt", "x", "--top-p", "0"], "top_p must be in (0, 1]"),
        (["--prompt", "x", "--stop", ""], "stop strings must be non-empty"),
        (
            ["--prompt", "x", "--seed", "1", "--speculative", "prompt-lookup", "--num-draft-tokens", "9"],
            "--num-draft-tokens must be in 1..4",
        ),
        (
            ["--prompt", "x", "--seed", "1", "--speculative", "self", "--gate", "cost"],
            "gate cost decides on measured",
        ),
    ],
)
def test_bad_options_are_one_error_line(args, fragment: str) -> None:
    result = CliRunner().invoke(main, ["generate", str(artifact("demo")), *args])
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert lines[-1].startswith("error: ") and fragment in lines[-1], result.output
    assert "Traceback" not in result.output


def test_help_shows_a_chat_example() -> None:
    result = CliRunner().invoke(main, ["generate", "--help"])
    assert "--chat" in result.output and "--system" in result.output and "--prompt -" in result.output
