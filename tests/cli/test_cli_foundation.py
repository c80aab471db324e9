"""The `loopcast` CLI foundation: inspect, random-checkpoint, generate --backend torch, and the
error contract (a LoopcastError is one `error:` line on stderr and exit status 2)."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from loopcast.cli import main
from loopcast.exporter.checkpoint import SINGLE_FILE, load_checkpoint, resolve_checkpoint
from loopcast.exporter.random_checkpoint import random_tensors
from loopcast.exporter.reference_generate import greedy_generate
from loopcast.exporter.torch_backend import load_tokenizer
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from loopcast.presets import PRESETS

TINY_OURO, TINY_LLAMA = PRESETS["tiny-ouro"], PRESETS["tiny-llama"]


def invoke(*args: str):
    return CliRunner().invoke(main, [str(a) for a in args])


def assert_one_error_line(returncode: int, stdout: str, stderr: str, *fragments: str) -> None:
    assert returncode == 2, (stdout, stderr)
    assert stdout == ""
    lines = stderr.splitlines()
    assert len(lines) == 1, stderr
    assert lines[0].startswith("error: ")
    assert "Traceback" not in stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


def assert_cli_error(result, *fragments: str) -> None:
    # Exit 2 through sys.exit: anything else in result.exception is an unhandled bug.
    assert isinstance(result.exception, SystemExit), result.exception
    assert_one_error_line(result.exit_code, result.stdout, result.stderr, *fragments)


def inspect_fields(text: str) -> dict[str, str]:
    """`inspect` prints a 16-column key and a value per line."""
    return {line[:16].strip(): line[16:].strip() for line in text.splitlines()}


@pytest.fixture
def damaged(make_checkpoint, tmp_path):
    """``damaged(config_fields=..., drop_tensor=...)``: a fresh damaged copy of tiny-ouro."""
    copies = iter(range(1000))

    def make(config_fields: dict | None = None, drop_tensor: str | None = None) -> Path:
        path = tmp_path / f"damaged-{next(copies)}"
        shutil.copytree(make_checkpoint(TINY_OURO), path)
        if config_fields:
            raw = json.loads((path / "config.json").read_text())
            (path / "config.json").write_text(json.dumps({**raw, **config_fields}))
        if drop_tensor:
            tensors = load_file(path / SINGLE_FILE)
            del tensors[drop_tensor]
            save_file(tensors, path / SINGLE_FILE)
        return path

    return make


# -- happy paths -------------------------------------------------------------------------------


def test_help_lists_the_commands():
    result = invoke("--help")
    assert result.exit_code == 0
    for command in ("inspect", "random-checkpoint", "generate", "export"):
        assert command in result.stdout


def test_inspect_demo_prints_parameters_and_loops():
    result = invoke("inspect", "demo")
    assert result.exit_code == 0, result.output
    fields = inspect_fields(result.stdout)
    with safe_open(resolve_checkpoint("demo") / SINGLE_FILE, framework="pt") as f:  # headers only
        params = sum(math.prod(f.get_slice(name).get_shape()) for name in f.keys())
    assert fields["parameters"] == f"{params:,}"
    assert fields["loops (R)"].split()[0] == "4"
    assert fields["model_type"] == "ouro"


@pytest.mark.parametrize(
    ("config", "dtype", "kv_per_token"),
    [
        (TINY_OURO, torch.float32, "3.0 KiB"),  # 2 (K,V) x 3 loops x 2 layers x 4 heads x 16 x 4 B
        (TINY_LLAMA, torch.float16, "256 B"),  # 2 x 1 x 2 x 2 KV heads x 16 x 2 B
    ],
    ids=["tiny-ouro-fp32", "tiny-llama-fp16"],
)
def test_inspect_checkpoint_prints_kv_bytes_per_token(make_checkpoint, config, dtype, kv_per_token):
    path = make_checkpoint(config, dtype=dtype)
    result = invoke("inspect", path)
    assert result.exit_code == 0, result.output
    fields = inspect_fields(result.stdout)
    assert fields["KV per token"] == kv_per_token
    assert fields["KV slots"] == str(config.num_loops * config.num_layers)
    assert fields["dtype"] == str(dtype).removeprefix("torch.")


@pytest.mark.parametrize("config", [TINY_OURO, TINY_LLAMA], ids=["tiny-ouro", "tiny-llama"])
def test_generate_torch_json_equals_greedy_generate(make_checkpoint, config):
    path = make_checkpoint(config)
    result = invoke(
        "generate", path, "--backend", "torch", "--prompt-ids", "1,2,3", "--max-new-tokens", "5", "--json"
    )
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout)
    assert set(payload) == {"tokens", "text", "stats"}
    model = load_checkpoint(path, dtype=torch.float32)
    expected = greedy_generate(model, [1, 2, 3], 5, stop_ids=(config.eos_token_id,))
    assert len(expected.tokens) == 5
    assert payload["tokens"] == expected.tokens
    assert payload["text"] is None  # no tokenizer.json in a random checkpoint
    assert payload["stats"]["new_tokens"] == 5
    assert payload["stats"]["finish_reason"] == "length"

    plain = invoke("generate", path, "--backend", "torch", "--prompt-ids", "1,2,3", "--max-new-tokens", "5")
    assert plain.stdout.strip() == ",".join(map(str, expected.tokens))


def test_generate_torch_demo_with_text_prompt():
    result = invoke(
        "generate",
        "demo",
        "--backend",
        "torch",
        "--prompt",
        "def add(a, b):",
        "--max-new-tokens",
        "4",
        "--json",
    )
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout)
    model = load_checkpoint("demo", dtype=torch.float32)
    tokenizer = load_tokenizer(resolve_checkpoint("demo"))
    prompt_ids = tokenizer.encode("def add(a, b):").ids
    expected = greedy_generate(model, prompt_ids, 4, stop_ids=(model.config.eos_token_id,))
    assert payload["tokens"] == expected.tokens
    assert payload["text"] == tokenizer.decode(expected.tokens, skip_special_tokens=False)
    assert payload["stats"]["prompt_tokens"] == len(prompt_ids)


def test_random_checkpoint_command(tmp_path):
    out = tmp_path / "rand"
    result = invoke("random-checkpoint", out, "--preset", "tiny-llama", "--dtype", "bf16", "--seed", "3")
    assert result.exit_code == 0, result.output
    loaded = load_checkpoint(out)
    assert loaded.config == TINY_LLAMA.replace(torch_dtype="bfloat16")
    expected = dict(random_tensors(TINY_LLAMA, 3, 0.02, torch.bfloat16))
    state = loaded.state_dict()
    assert sorted(state) == sorted(expected)
    assert all(torch.equal(state[n], t) for n, t in expected.items())


# -- errors ------------------------------------------------------------------------------------


def test_inspect_missing_directory(tmp_path):
    missing = tmp_path / "nowhere"
    assert_cli_error(invoke("inspect", missing), str(missing), "not found")


@pytest.mark.parametrize(
    ("args", "fragments"),
    [
        (["--prompt-ids", "1,99999"], ["token id 99999 is outside the vocabulary [0, 97)"]),
        (["--prompt-ids", "1,-4"], ["token id -4 is outside the vocabulary"]),
        (["--prompt-ids", "1,2", "--max-new-tokens", "-1"], ["--max-new-tokens must be >= 0, got -1"]),
        (["--prompt-ids", ",".join(["5"] * 129)], ["prompt of 129 tokens", "max length 128"]),
        (["--prompt-ids", "1,x"], ["--prompt-ids", "'1,x'"]),
        (["--prompt-ids", ""], ["prompt is empty"]),
        ([], ["exactly one of --prompt and --prompt-ids"]),
        (["--prompt-ids", "1", "--prompt", "hi"], ["exactly one of --prompt and --prompt-ids"]),
        (["--prompt", "hi"], ["no tokenizer.json", "--prompt-ids"]),
    ],
    ids=[
        "id-too-big",
        "id-negative",
        "negative-max-new",
        "prompt-too-long",
        "not-an-int",
        "empty",
        "no-prompt",
        "two-prompts",
        "no-tokenizer",
    ],
)
def test_generate_bad_requests(make_checkpoint, args, fragments):
    path = make_checkpoint(TINY_OURO)
    assert_cli_error(invoke("generate", path, "--backend", "torch", *args), *fragments)


def test_unknown_model_type(damaged):
    path = damaged(config_fields={"model_type": "gpt2"})
    for command in (["inspect", path], ["generate", path, "--backend", "torch", "--prompt-ids", "1"]):
        assert_cli_error(invoke(*command), "unknown model_type 'gpt2'")


def test_missing_tensor(damaged):
    name = "model.layers.0.self_attn.q_proj.weight"
    path = damaged(drop_tensor=name)
    result = invoke("generate", path, "--backend", "torch", "--prompt-ids", "1,2")
    assert_cli_error(result, f"tensor {name} is missing")


def test_missing_config_and_weights(damaged):
    path = damaged()
    (path / "config.json").unlink()
    for command in (["inspect", path], ["generate", path, "--backend", "torch", "--prompt-ids", "1"]):
        assert_cli_error(invoke(*command), str(path / "config.json"), "not found")
    path = damaged()
    (path / SINGLE_FILE).unlink()
    for command in (["inspect", path], ["generate", path, "--backend", "torch", "--prompt-ids", "1"]):
        assert_cli_error(invoke(*command), str(path), "no weights")


def test_random_checkpoint_bad_options(tmp_path):
    assert_cli_error(invoke("random-checkpoint", tmp_path / "x", "--preset", "huge"), "unknown preset 'huge'")
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "notes.txt").write_text("mine")
    assert_cli_error(invoke("random-checkpoint", taken), str(taken), "not an empty directory")
    assert [p.name for p in taken.iterdir()] == ["notes.txt"]


# Real processes: the installed console script and `python -m loopcast.cli`.


def _console_script() -> list[str]:
    script = Path(sys.executable).with_name("loopcast")
    return [str(script)] if script.is_file() else [sys.executable, "-m", "loopcast.cli"]


def test_console_script_inspect_missing_directory(tmp_path):
    missing = tmp_path / "nowhere"
    proc = subprocess.run(
        [*_console_script(), "inspect", str(missing)], capture_output=True, text=True, timeout=120
    )
    assert_one_error_line(proc.returncode, proc.stdout, proc.stderr, str(missing))


def test_python_m_generate_bad_token(make_checkpoint):
    path = make_checkpoint(TINY_OURO)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "loopcast.cli",
            "generate",
            str(path),
            "--backend",
            "torch",
            "--prompt-ids",
            "1,99999",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert_one_error_line(proc.returncode, proc.stdout, proc.stderr, "token id 99999")


def test_demo_reports_medians_and_the_gate() -> None:
    """`loopcast demo` on the default (exact) artifact: every mode with the default gate, the
    median of three runs with its range, and why the gate engaged or stood down."""
    from tests.artifacts import require_exact_cpu_artifacts

    require_exact_cpu_artifacts()
    result = CliRunner().invoke(main, ["demo", "--max-new-tokens", "12"])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    for label in ("plain greedy", "prompt-lookup (gate auto)", "self (gate auto)", "pipeline (gate auto)"):
        assert any(line.startswith(label) and "(range " in line for line in lines), result.output
    # A speculative mode shows its ratio only where its gate engaged; else it says it stood down.
    for line in lines:
        if "(gate auto)" in line:
            assert ("vs plain" in line) != ("gate stood down: plain decoding" in line), line
    verdict = [line for line in lines if line.strip()][-1]
    assert verdict.startswith(("fastest: ", "plain greedy: every")), result.output
    assert "medians of 5 interleaved runs" in verdict
    assert not verdict.startswith("fastest: plain") or "no speculative mode beat it" in verdict
    assert "identical to plain greedy" not in verdict  # plain is never compared with itself


def test_demo_cache_without_the_pipeline_graphs_is_exported_again(tmp_path) -> None:
    """A cached demo artifact from before a pipeline graph kind existed is not reused: `loopcast
    demo` exports it again, so the pipeline gets its cycle run."""
    import json
    import shutil

    from loopcast.exporter.demo_artifact import _usable

    from tests.artifacts import artifact, require_exact_cpu_artifacts

    require_exact_cpu_artifacts()
    cached = tmp_path / "demo"
    shutil.copytree(artifact("demo"), cached)
    assert _usable(cached)
    manifest = json.loads((cached / "manifest.json").read_text())
    del manifest["graphs"]["cycle_run"]
    manifest["files"].pop("cycle_run.onnx", None)
    (cached / "manifest.json").write_text(json.dumps(manifest))
    (cached / "cycle_run.onnx").unlink()
    assert not _usable(cached)


def test_a_cached_stock_demo_is_exported_again_once_the_library_can_be_had(tmp_path) -> None:
    """Stock graphs cached while the op library could not be built are not reused once it can
    be (after tools/c_generate/fetch_deps.sh): the next `loopcast demo` re-exports by itself."""
    import shutil

    from loopcast.exporter.demo_artifact import _usable, library_available

    from tests.artifacts import artifact, require_exact_cpu_artifacts

    require_exact_cpu_artifacts()
    assert library_available()
    cached = tmp_path / "demo"
    shutil.copytree(artifact("demo", ops="stock"), cached)
    assert not _usable(cached)
