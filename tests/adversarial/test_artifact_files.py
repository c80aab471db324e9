"""Adversarial artifact files (docs/trust.md, "Paths" and "Files"): every file an artifact names
or the runtime opens — manifest, tokenizer files, chat template, generation config, graphs,
weights — replaced by a symlink leaving the artifact, a FIFO, a directory, an oversized file or a
symlink loop. Each surface must answer with its one error (an ArtifactError from the Python API,
one ``error:`` line and exit 2 from the CLI and the C example), in bounded time, naming the file.

The baseline artifact (``rich``) has every one of those files and works on every surface
(``test_baseline_*``), so each case fails only through its mutation. A symlink's target is a
byte-identical copy of the file outside the artifact: reading it would succeed, so only the
confinement can refuse it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from click.testing import CliRunner
from loopcast.cli import main
from loopcast.ort_runtime import load

from loopcast.confined_files import (
    JSON_CONFIG_MAX_BYTES,
    MANIFEST_MAX_BYTES,
    TEMPLATE_MAX_BYTES,
    TOKENIZER_MAX_BYTES,
)
from loopcast.errors import ArtifactError
from tests.adversarial.cases import Case, Table, assert_one_error_line, within_deadline
from tests.artifacts import artifact
from tests.c_example import build_c_example

# name -> (file, the cap it is refused above: None = the manifest's recorded size)
FILES = {
    "manifest": ("manifest.json", MANIFEST_MAX_BYTES),
    "tokenizer": ("tokenizer.json", TOKENIZER_MAX_BYTES),
    "tokenizer_config": ("tokenizer_config.json", JSON_CONFIG_MAX_BYTES),
    "special_tokens": ("special_tokens_map.json", JSON_CONFIG_MAX_BYTES),
    "template": ("chat_template.jinja", TEMPLATE_MAX_BYTES),
    "generation_config": ("generation_config.json", JSON_CONFIG_MAX_BYTES),
    "graph": ("prefill.onnx", None),
    "weights": ("weights.safetensors", None),
}
# what the C example reads (it has no tokenizer); inspect reads the same
C_FILES = ("manifest", "graph", "weights")
# the fragment of the Python error per category (the C example says "not a regular file" etc.)
EXPECT = {
    "symlink_out": "outside the artifact",
    "fifo": "is a FIFO",
    "directory": "is a directory",
    "oversized": "bytes",
    "symlink_loop": "cannot be resolved",
}
C_EXPECT = {
    "symlink_out": "outside the artifact",
    "fifo": "not a regular file",
    "directory": "not a regular file",
    "oversized": "bytes",
    "symlink_loop": "is missing",
}


def _rows():
    for category in EXPECT:
        for name in FILES:
            if category == "symlink_loop" and name not in ("manifest", "tokenizer", "template"):
                continue
            surfaces = ("api", "cli") + (("inspect", "c") if name in C_FILES else ())
            yield Case(category, name, FILES[name][0], surfaces, EXPECT[category])


TABLE = Table(_rows())

TOKENIZER_VOCAB = {"<unk>": 0, "<s>": 1, "</s>": 2, "hello": 3, "world": 4}
TEMPLATE = "{{ bos_token }}{% for m in messages %}{{ m['content'] }} {% endfor %}"
MESSAGES = [{"role": "user", "content": "hello world"}]


@pytest.fixture(scope="module")
def rich(tmp_path_factory) -> Path:
    """A tiny stock artifact (deferred sessions, no native code) with every optional file."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    path = tmp_path_factory.mktemp("rich") / "art"
    shutil.copytree(artifact("ouro-r3", ops="stock"), path)
    tokenizer = Tokenizer(WordLevel(TOKENIZER_VOCAB, unk_token="<unk>"))
    tokenizer.pre_tokenizer = Whitespace()
    (path / "tokenizer.json").write_text(tokenizer.to_str())
    (path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    (path / "special_tokens_map.json").write_text(json.dumps({"unk_token": "<unk>"}))
    (path / "chat_template.jinja").write_text(TEMPLATE)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2]}))
    return path


@pytest.fixture(scope="module")
def c_program(tmp_path_factory) -> Path:
    return build_c_example(tmp_path_factory.mktemp("c_build"))


def _mutated(rich: Path, tmp_path: Path, case: Case) -> tuple[Path, list[Path]]:
    """A copy of ``rich`` with ``case`` applied; the FIFOs it made (to release a hung reader)."""
    art = tmp_path / "art"
    shutil.copytree(rich, art, symlinks=True)
    target = art / case.payload
    fifos = []
    if case.category == "symlink_out":
        outside = tmp_path / "outside"
        outside.mkdir()
        shutil.copy(target, outside / case.payload)  # the same bytes: only the place is wrong
        target.unlink()
        target.symlink_to(outside / case.payload)
    elif case.category == "fifo":
        target.unlink()
        os.mkfifo(target)
        fifos.append(target)
    elif case.category == "directory":
        target.unlink()
        target.mkdir()
        (target / "inside").write_text("{}")
    elif case.category == "oversized":
        cap = FILES[case.name][1]
        with open(target, "r+b") as f:  # sparse: no disk is written for the cap
            f.truncate(cap + 1 if cap is not None else target.stat().st_size + 1)
    elif case.category == "symlink_loop":
        target.unlink()
        target.symlink_to(case.payload)  # itself
    else:
        raise AssertionError(case.category)
    return art, fifos


def _use_api(art: Path) -> None:
    """Everything the Python API opens: load (manifest, graphs, weights, tokenizer), the chat
    template (template, tokenizer config, special tokens) and a generation (generation config)."""
    model = load(art)
    ids = model.apply_chat_template(MESSAGES)
    model.generate(ids, 2)


def _cli(*args: object):
    return CliRunner().invoke(main, [str(a) for a in args])


def _cli_generate(art: Path):
    return _cli("generate", art, "--chat", "hello world", "--max-new-tokens", "2")


def _c(program: Path, art: Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(program), str(art), "2", "3,4"], capture_output=True, text=True, timeout=20)


def test_baseline_works_on_every_surface(rich, c_program) -> None:
    """The unmutated artifact: every case below fails only through its mutation."""
    _use_api(rich)
    result = _cli_generate(rich)
    assert result.exit_code == 0, result.output
    for args in (("inspect", rich), ("inspect", "--verify", rich)):
        result = _cli(*args)
        assert result.exit_code == 0, result.output
    proc = _c(c_program, rich)
    assert proc.returncode == 0, proc.stderr


@TABLE.parametrize("api")
def test_api_refuses(rich, tmp_path, case: Case) -> None:
    art, fifos = _mutated(rich, tmp_path, case)
    with pytest.raises(ArtifactError) as info:
        within_deadline(lambda: _use_api(art), unblock=fifos)
    assert case.payload in str(info.value) and case.expect in str(info.value), str(info.value)


@TABLE.parametrize("cli")
def test_cli_generate_refuses(rich, tmp_path, case: Case) -> None:
    art, fifos = _mutated(rich, tmp_path, case)
    result = within_deadline(lambda: _cli_generate(art), unblock=fifos)
    assert_one_error_line(result.exit_code, result.stdout, result.stderr, case.payload, case.expect)


@TABLE.parametrize("inspect")
@pytest.mark.parametrize("verify", [False, True], ids=["inspect", "verify"])
def test_cli_inspect_refuses(rich, tmp_path, case: Case, verify: bool) -> None:
    art, fifos = _mutated(rich, tmp_path, case)
    args = ("inspect", "--verify", art) if verify else ("inspect", art)
    result = within_deadline(lambda: _cli(*args), unblock=fifos)
    assert_one_error_line(result.exit_code, result.stdout, result.stderr, case.payload, case.expect)


@TABLE.parametrize("c")
def test_c_example_refuses(rich, c_program, tmp_path, case: Case) -> None:
    art, _ = _mutated(rich, tmp_path, case)
    try:
        proc = _c(c_program, art)
    except subprocess.TimeoutExpired:
        pytest.fail("the C example hung")
    assert_one_error_line(proc.returncode, proc.stdout, proc.stderr, case.payload, C_EXPECT[case.category])
