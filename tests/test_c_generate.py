"""The C example (tools/c_generate) generates the same tokens as the Python generator."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from loopcast.ort_runtime import load
from tests.artifacts import artifact

ROOT = Path(__file__).resolve().parents[1]
SOURCE = ROOT / "tools" / "c_generate"
HEADERS = ROOT / ".cdeps" / "usr" / "include" / "onnxruntime" / "onnxruntime_c_api.h"


@pytest.fixture(scope="module")
def program(tmp_path_factory) -> Path:
    missing = [what for what, ok in [("make", shutil.which("make")), ("a C compiler", shutil.which("cc")),
                                     ("ORT C headers (tools/c_generate/fetch_deps.sh)", HEADERS.is_file()),
                                     ("cJSON", Path("/usr/include/cjson/cJSON.h").is_file())] if not ok]
    if missing:
        if os.environ.get("LOOPCAST_REQUIRE_C") == "1":
            pytest.fail(f"C example prerequisites missing: {', '.join(missing)}")
        pytest.skip(f"C example prerequisites missing: {', '.join(missing)}")
    build = tmp_path_factory.mktemp("c_build")
    proc = subprocess.run(["make", "-C", str(SOURCE), f"BUILD={build}", f"PYTHON={sys.executable}"],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return build / "c_generate"


def _run(program: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(program), *args], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("name,batch_invariant", [("ouro-r3", False), ("llama-tied-gqa", False), ("demo", False),
                                                  ("ouro-r3", True), ("llama-tied-gqa", True)])
def test_c_tokens_equal_python(program: Path, name: str, batch_invariant: bool) -> None:
    """With --batch-invariant the C program registers the library the artifact carries."""
    path = artifact(name, batch_invariant=batch_invariant)
    model = load(path)
    rng = np.random.default_rng(5)
    for length in (1, 4, 13):
        ids = rng.integers(1, model.config.vocab_size, length).tolist()
        expected = model.generate(ids, 24).tokens
        proc = _run(program, str(path), "24", ",".join(map(str, ids)))
        assert proc.returncode == 0, proc.stderr
        assert [int(t) for t in proc.stdout.strip().split(",")] == expected


def test_c_stops_at_capacity(program: Path) -> None:
    path = artifact("ouro-r3", max_length=24)
    ids = [5, 6, 7, 8, 9, 10]
    result = load(path).generate(ids, 100)  # stops at the manifest's EOS ids, as the C program does
    got = _run(program, str(path), "100", ",".join(map(str, ids))).stdout.strip().split(",")
    assert [int(t) for t in got] == result.tokens
    if result.finish_reason == "length":
        assert len(got) == 24 - len(ids) + 1


def _copy(tmp_path: Path) -> Path:
    dst = tmp_path / "art"
    shutil.copytree(artifact("ouro-r3"), dst)
    return dst


@pytest.mark.parametrize("damage,needle", [
    (lambda p: (p / "manifest.json").write_text("{oops"), "corrupt manifest"),
    (lambda p: (p / "decode.onnx").unlink(), "graph file for 'decode' is missing"),
    (lambda p: (p / "manifest.json").unlink(), "manifest.json: not found"),
])
def test_c_errors(program: Path, tmp_path: Path, damage, needle: str) -> None:
    path = _copy(tmp_path)
    damage(path)
    proc = _run(program, str(path), "5", "1,2")
    assert proc.returncode == 2
    assert proc.stderr.startswith("error:") and needle in proc.stderr, proc.stderr
    assert proc.stderr.strip().count("\n") == 0


@pytest.mark.parametrize("args,needle", [(["5", "1,99999"], "outside the vocabulary"),
                                         (["-1", "1"], "MAX_NEW_TOKENS"), (["5", "1,x"], "comma-separated")])
def test_c_bad_requests(program: Path, args, needle: str) -> None:
    proc = _run(program, str(artifact("ouro-r3")), *args)
    assert proc.returncode == 2 and needle in proc.stderr
