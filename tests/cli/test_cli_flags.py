"""Library errors name parameters (``num_draft_tokens``); the CLI names its flags (``--num-draft-tokens``)."""

from __future__ import annotations

import click
import pytest
from click.testing import CliRunner
from loopcast.cli import main
from loopcast.cli.flags import with_flags

from loopcast.errors import ConfigError, RequestError
from tests.artifacts import artifact


def invoke(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def error_line(result) -> str:
    assert result.exit_code == 2, result.output
    assert result.stdout == "" and "Traceback" not in result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    return lines[0]


@click.command()
@click.option("--num-draft-tokens", type=int)
@click.option("-o", "--output")
@click.option("--speculative")
@click.option("--skip-special-tokens/--keep-special-tokens", default=True)
def _command(**_):
    pass


@pytest.mark.parametrize(
    "error,message",
    [
        # a leading "NAME must" names the parameter
        (RequestError("num_draft_tokens must be >= 1, got 0"), "--num-draft-tokens must be >= 1, got 0"),
        (
            RequestError("speculative must be one of none, self, got 'x'"),
            "--speculative must be one of none, self, got 'x'",
        ),
        # the parameter attribute, wherever the name stands (or a prefix when it does not)
        (RequestError("cannot write output here", parameter="output"), "cannot write --output here"),
        (RequestError("unwritable", parameter="output"), "--output: unwritable"),
        (RequestError("bad", parameter="skip_special_tokens"), "--skip-special-tokens: bad"),
        # a config field spelled otherwise than its flag
        (
            RequestError("mode must be one of none, self", parameter="mode"),
            "--speculative must be one of none, self",
        ),
        # no flag of this command, a flag named already, or no parameter: the message as written
        (RequestError("max_new_tokens must be >= 0, got -1"), "max_new_tokens must be >= 0, got -1"),
        (ConfigError("head_dim must be even"), "head_dim must be even"),
        (RequestError("--output x: taken", parameter="output"), "--output x: taken"),
        (RequestError("sampling top_p must be in (0, 1], got 0"), "sampling top_p must be in (0, 1], got 0"),
    ],
)
def test_with_flags(error, message) -> None:
    assert with_flags(error, _command) == message


def test_request_error_stays_backwards_compatible() -> None:
    assert str(RequestError("x")) == "x" and RequestError("x").parameter is None
    assert RequestError("x", parameter="gate").parameter == "gate"


@pytest.mark.parametrize(
    "args,line",
    [
        (["--num-draft-tokens", "0"], "error: --num-draft-tokens must be >= 1, got 0"),
        (["--pipeline-exit", "0"], "error: --pipeline-exit must be >= 1, got 0"),
        (["--alternate-gap", "2"], "error: --alternate-gap must be in (0, 1], got 2.0"),
        (["--max-new-tokens", "-1"], "error: --max-new-tokens must be >= 0, got -1"),
    ],
)
def test_generate_config_errors_name_the_flag(args, line) -> None:
    result = invoke("generate", artifact("ouro-r3"), "--prompt-ids", "5 6", *args)
    assert error_line(result) == line


def test_gate_choices_are_the_enum() -> None:
    result = invoke("generate", "x", "--prompt-ids", "1", "--gate", "none")
    assert "'none' is not one of 'auto', 'always', 'hit-density', 'cost'" in error_line(result)
    help_text = invoke("generate", "--help").output
    assert "[auto|always|hit-density|cost]" in help_text
    assert "[none|prompt-lookup|self|pipeline]" in help_text  # custom is the API's proposer objects


def test_serve_speculative_choices_are_the_served_modes() -> None:
    # which of them an engine runs is checked at start (tests/serve/test_serve_requests.py)
    result = invoke("serve", "x", "--speculative", "custom")
    assert "'custom' is not one of 'none', 'prompt-lookup', 'self', 'pipeline'" in error_line(result)


def test_gate_always_runs() -> None:
    base = ["generate", artifact("ouro-r3"), "--prompt-ids", "5 6 5 6", "--max-new-tokens", "6", "--json"]
    plain = invoke(*base)
    always = invoke(*base, "--speculative", "prompt-lookup", "--gate", "always", "--allow-inexact")
    assert plain.exit_code == 0 and always.exit_code == 0, always.output
    assert plain.stdout.split('"finish_reason"')[0] == always.stdout.split('"finish_reason"')[0]


@pytest.mark.parametrize("command", ["generate", "bench"])
def test_threads_is_validated_by_generate_and_bench(command) -> None:
    args = [command, "demo"] + (["--prompt", "x"] if command == "generate" else ["--device", "cpu"])
    result = CliRunner().invoke(main, [*args, "--threads", "0"])
    assert result.exit_code == 2, result.output
    assert result.output.strip().splitlines()[-1].startswith("error: --threads must be")


def test_threads_reaches_the_sessions() -> None:
    from loopcast.ort_runtime import load

    from loopcast.manifest import PREFILL

    path = artifact("llama-tied-gqa")
    for bad in (-1, 0, True, 1.5):
        with pytest.raises(RequestError, match="threads must be a positive integer"):
            load(path, threads=bad)
    one = load(path, threads=1)
    assert one.loaded.sessions[PREFILL].get_session_options().intra_op_num_threads == 1
    assert (
        one.generate([1, 2, 3], 5, stop_ids=()).tokens
        == load(path).generate([1, 2, 3], 5, stop_ids=()).tokens
    )


def test_serve_help_example_is_greedy() -> None:
    """The serve help's curl example asks for greedy tokens (OpenAI's default temperature samples)."""
    result = CliRunner().invoke(main, ["serve", "--help"])
    assert result.exit_code == 0 and '"temperature": 0' in result.output and "samples" in result.output


def test_stream_with_json_is_refused_not_dropped() -> None:
    result = CliRunner().invoke(main, ["generate", "demo", "--prompt", "x", "--stream", "--json"])
    assert result.exit_code == 2
    assert result.output.strip().splitlines()[-1] == (
        "error: --stream and --json do not combine: --json prints one object when the generation ends"
    )


def test_generate_and_bench_give_the_same_cuda_advice() -> None:
    """On a CPU-only onnxruntime, `generate --device cuda` and `bench --device cuda` say the same
    thing: how onnxruntime-gpu replaces onnxruntime."""
    from loopcast.devices import CUDA_INSTALL_ADVICE, cuda_available

    if cuda_available():
        pytest.skip("this install can run CUDA")
    import onnxruntime as ort

    if "CUDAExecutionProvider" in ort.get_available_providers():
        pytest.skip("onnxruntime-gpu without a GPU: another message")
    gen = CliRunner().invoke(
        main, ["generate", str(artifact("llama-tied-gqa")), "--prompt-ids", "1", "--device", "cuda"]
    )
    bench = CliRunner().invoke(main, ["bench", "demo", "--device", "cuda", "--quick"])
    for result in (gen, bench):
        assert result.exit_code == 2 and CUDA_INSTALL_ADVICE in result.output, result.output
