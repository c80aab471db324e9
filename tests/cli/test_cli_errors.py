"""CLI input errors beyond the foundation's: id parsing, click's own usage errors, and the
commands that used to end in tracebacks. Each is one `error:` line and exit status 2."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from click.testing import CliRunner
from loopcast.cli import _parse_ids, main

from loopcast.errors import RequestError
from tests.artifacts import artifact
from tests.cli.test_cli_foundation import _console_script, assert_one_error_line


def invoke(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def assert_cli_error(result, *fragments: str) -> None:
    assert result.exit_code == 2, result.output
    assert result.stdout == ""
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    assert_one_error_line(result.exit_code, result.stdout, result.stderr, *fragments)


@pytest.mark.parametrize(
    "text,ids",
    [
        ("1,2,3", [1, 2, 3]),
        ("1 2 3", [1, 2, 3]),
        ("1, 2, 3", [1, 2, 3]),
        (" 7\t8\n9 ", [7, 8, 9]),
        ("42", [42]),
        ("", []),
        ("-4,5", [-4, 5]),
    ],
)
def test_ids_by_commas_or_spaces(text, ids) -> None:
    assert _parse_ids(text) == ids


@pytest.mark.parametrize(
    "text", ["1 2,3", "12 3,4", "1,,2", "1,2,", ",1", "1;2", "1.0", "1_000", "0x10", "1,a"]
)
def test_ambiguous_or_malformed_ids_are_refused(text) -> None:
    with pytest.raises(RequestError, match="--prompt-ids"):
        _parse_ids(text)


def test_space_separated_ids_run_as_separate_tokens() -> None:
    path = artifact("ouro-r3")
    spaced = invoke("generate", path, "--prompt-ids", "5 6 7", "--max-new-tokens", "4", "--json")
    commas = invoke("generate", path, "--prompt-ids", "5,6,7", "--max-new-tokens", "4", "--json")
    assert spaced.exit_code == 0, spaced.output
    assert spaced.stdout.split('"stats"')[0] == commas.stdout.split('"stats"')[0]
    assert '"prompt_tokens": 3' in spaced.stdout


@pytest.mark.parametrize(
    "args,fragments",
    [
        (["generate", "x", "--prompt-idz", "1"], ["No such option", "generate --help"]),
        (["generate"], ["Missing argument 'PATH'"]),
        (["export", "x", "-o", "y", "--dtype", "fp64"], ["--dtype", "fp64"]),
        (["generate", "x", "--prompt-ids", "1", "--max-new-tokens", "many"], ["--max-new-tokens", "many"]),
        (["no-such-command"], ["No such command"]),
    ],
)
def test_click_usage_errors_are_one_line(args, fragments) -> None:
    assert_cli_error(invoke(*args), *fragments)


def test_usage_error_in_a_real_process() -> None:
    proc = subprocess.run([*_console_script(), "export"], capture_output=True, text=True, timeout=120)
    assert_one_error_line(proc.returncode, proc.stdout, proc.stderr, "Missing argument")


def test_help_and_version_still_exit_zero() -> None:
    assert invoke("--help").exit_code == 0
    assert invoke("--version").exit_code == 0
    result = invoke()
    assert result.exit_code == 0 and "Commands:" in result.stdout


def test_demo_zero_new_tokens() -> None:
    assert_cli_error(invoke("demo", "--max-new-tokens", "0"), "--max-new-tokens must be >= 1")


def test_bench_unknown_preset(tmp_path) -> None:
    assert_cli_error(
        invoke("bench", "preset:nope", "--device", "cpu", "--work-dir", tmp_path),
        "unknown preset 'preset:nope'",
        "preset:tiny-ouro",
    )


def test_random_checkpoint_onto_unwritable_paths(tmp_path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    assert_cli_error(invoke("random-checkpoint", blocker / "sub"), str(blocker))
    assert_cli_error(invoke("random-checkpoint", "/proc/loopcast-test"), "loopcast-test")


def test_generate_trust_ops_flag_and_inspect_verify(tmp_path) -> None:
    path = artifact("ouro-r3")
    assert (
        invoke("generate", path, "--prompt-ids", "5 6", "--max-new-tokens", "2", "--trust-ops").exit_code == 0
    )
    result = invoke("inspect", path, "--verify")
    assert result.exit_code == 0 and "ok  weights.safetensors" in result.stdout
    assert_cli_error(invoke("inspect", tmp_path, "--verify"), "not")


def test_zeroed_weights_are_caught(tmp_path) -> None:
    import shutil

    path = tmp_path / "art"
    shutil.copytree(artifact("ouro-r3"), path)
    weights = path / "weights.safetensors"
    data = bytearray(weights.read_bytes())
    data[-4096:] = bytes(4096)  # same size
    weights.write_bytes(bytes(data))
    # Every load (and inspect) compares a sampled hash: small files are hashed whole.
    assert_cli_error(invoke("inspect", path), "weights.safetensors", "sampled SHA-256")
    assert_cli_error(
        invoke("generate", path, "--prompt-ids", "5", "--max-new-tokens", "2"), "sampled SHA-256"
    )
    # Without the sampled hash only --verify can tell.
    raw = json.loads((path / "manifest.json").read_text())
    del raw["files"]["weights.safetensors"]["sampled_sha256"]
    (path / "manifest.json").write_text(json.dumps(raw))
    assert invoke("inspect", path).exit_code == 0
    assert_cli_error(invoke("inspect", path, "--verify"), "weights.safetensors", "SHA-256")
    weights.write_bytes(bytes(data[:1000]))
    assert_cli_error(invoke("inspect", path), "weights.safetensors", "1000 bytes")


def test_python_m_usage_error() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "loopcast.cli", "inspect"], capture_output=True, text=True, timeout=120
    )
    assert_one_error_line(proc.returncode, proc.stdout, proc.stderr, "Missing argument")
