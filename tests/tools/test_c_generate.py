"""The C example (tools/c_generate) generates the same tokens as the Python generator."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from loopcast.ort_runtime import load

from tests.artifacts import artifact
from tests.c_example import build_c_example


@pytest.fixture(scope="module")
def program(tmp_path_factory) -> Path:
    return build_c_example(tmp_path_factory.mktemp("c_build"))


def _run(program: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(program), *args], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize(
    "name,batch_invariant,pad",
    [
        ("ouro-r3", False, None),
        ("llama-tied-gqa", False, None),
        ("demo", False, None),
        ("ouro-r3", True, None),
        ("llama-tied-gqa", True, None),
        ("ouro-r3", True, 32),  # heads of 16 stored as 32: the KV shape is kv_layout.shape's
    ],
)
def test_c_tokens_equal_python(program: Path, name: str, batch_invariant: bool, pad: int | None) -> None:
    """With --batch-invariant the C program registers the library the artifact carries."""
    path = artifact(name, batch_invariant=batch_invariant, pad_heads_to=pad)
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
    shutil.copytree(artifact("ouro-r3", ops="stock"), dst)
    return dst


@pytest.mark.parametrize(
    "damage,needle",
    [
        (lambda p: (p / "manifest.json").write_text("{oops"), "corrupt manifest"),
        (lambda p: (p / "decode.onnx").unlink(), "graph file for 'decode' is missing"),
        (lambda p: (p / "manifest.json").unlink(), "manifest.json: not found"),
    ],
)
def test_c_errors(program: Path, tmp_path: Path, damage, needle: str) -> None:
    path = _copy(tmp_path)
    damage(path)
    proc = _run(program, str(path), "5", "1,2")
    assert proc.returncode == 2
    assert proc.stderr.startswith("error:") and needle in proc.stderr, proc.stderr
    assert proc.stderr.strip().count("\n") == 0


@pytest.mark.parametrize(
    "args,needle",
    [
        (["5", "1,99999"], "outside the vocabulary"),
        (["-1", "1"], "MAX_NEW_TOKENS"),
        (["5", "1,x"], "comma-separated"),
    ],
)
def test_c_bad_requests(program: Path, args, needle: str) -> None:
    proc = _run(program, str(artifact("ouro-r3")), *args)
    assert proc.returncode == 2 and needle in proc.stderr


# -- the trust rule and untrusted manifests in C (docs/trust.md) --------------------------------


def _edit(path: Path, change) -> None:
    raw = json.loads((path / "manifest.json").read_text())
    change(raw)
    (path / "manifest.json").write_text(json.dumps(raw))


@pytest.mark.parametrize(
    "change,needle",
    [
        (lambda r: r["graphs"]["decode"].update(file="/etc/passwd"), "inside the artifact"),
        (lambda r: r["graphs"]["decode"].update(file="../art/decode.onnx"), "no '..'"),
        (lambda r: r["graphs"]["prefill"].update(file=7), "graphs.prefill.file"),
        (lambda r: r.update(weights_file="../x"), "no '..'"),
        (lambda r: r.update(max_length=10**12), "max_length"),
        (lambda r: r.update(max_length=31.5), "max_length"),
        (lambda r: r["kv_layout"].update(slots=10**9), "slots"),
        (lambda r: r["kv_layout"].update(shape=[1, 4, 64, 16]), "kv_layout.shape[2]"),
        (lambda r: r["kv_layout"].update(shape=[1, -4, 32, 16]), "kv_layout.shape[1]"),
        (lambda r: r["graphs"]["decode"].update(kv_slots=[0, 1, 2, 3, 4, 99]), "kv_slots"),
        (lambda r: r["model"].update(vocab_size="97"), "vocab_size"),
        (lambda r: r.update(eos_token_ids=[10**6]), "eos_token_ids"),
        (lambda r: r.update(eos_token_ids="0"), "eos_token_ids"),
        (lambda r: r["files"]["weights.safetensors"].update(size=5), "weights file has"),
        (lambda r: r["graphs"].pop("decode"), "no 'decode' graph"),
    ],
    ids=[
        "abs-graph",
        "dotdot-graph",
        "int-file",
        "dotdot-weights",
        "huge-max-length",
        "float-max-length",
        "huge-slots",
        "kv-length",
        "neg-heads",
        "unknown-slot",
        "str-vocab",
        "eos-range",
        "eos-type",
        "weights-size",
        "no-decode",
    ],
)
def test_c_untrusted_manifest(program: Path, tmp_path: Path, change, needle: str) -> None:
    path = tmp_path / "art"
    shutil.copytree(artifact("ouro-r3", max_length=32), path)
    _edit(path, change)
    proc = _run(program, str(path), "5", "1,2")
    assert proc.returncode == 2, proc.stdout
    assert proc.stderr.startswith("error:") and needle in proc.stderr, proc.stderr
    assert proc.stderr.strip().count("\n") == 0


def test_c_graph_symlink_leaving_the_artifact(program: Path, tmp_path: Path) -> None:
    path = _copy(tmp_path)
    shutil.move(path / "decode.onnx", tmp_path / "outside.onnx")
    (path / "decode.onnx").symlink_to(tmp_path / "outside.onnx")
    proc = _run(program, str(path), "5", "1,2")
    assert proc.returncode == 2 and "resolves outside the artifact" in proc.stderr, proc.stderr


@pytest.fixture(scope="module")
def bi_artifact() -> Path:
    from loopcast.custom_ops.build import find_ort_include

    if find_ort_include() is None:
        pytest.skip("ORT C++ headers missing")
    return artifact("ouro-r3", batch_invariant=True)


def test_c_op_library_trust(program: Path, bi_artifact: Path, tmp_path: Path) -> None:
    from tests.ort_runtime.test_trust import MARKER_SOURCE

    path = tmp_path / "art"
    shutil.copytree(bi_artifact, path)
    expected = _run(program, str(path), "6", "5,6,7")
    assert expected.returncode == 0, expected.stderr  # built here: trusted by its hash
    other_cache = {**os.environ, "LOOPCAST_CACHE": str(tmp_path / "other-cache")}
    proc = subprocess.run(
        [str(program), str(path), "6", "5,6,7"], capture_output=True, text=True, env=other_cache
    )
    assert proc.returncode == 2 and "not one you built" in proc.stderr and "--trust-ops" in proc.stderr
    proc = subprocess.run(
        [str(program), "--trust-ops", str(path), "6", "5,6,7"],
        capture_output=True,
        text=True,
        env=other_cache,
    )
    assert proc.returncode == 0 and proc.stdout == expected.stdout
    # A hostile library with a correct record: refused without trust, its constructor never runs.
    cc = shutil.which("cc")
    marker = tmp_path / "marker"
    (tmp_path / "m.c").write_text(MARKER_SOURCE)
    name = json.loads((path / "manifest.json").read_text())["custom_op_library"]
    subprocess.run(
        [cc, "-shared", "-fPIC", f'-DMARKER_PATH="{marker}"', str(tmp_path / "m.c"), "-o", str(path / name)],
        check=True,
    )
    data = (path / name).read_bytes()
    _edit(
        path,
        lambda r: r["files"].update({name: {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}}),
    )
    proc = _run(program, str(path), "6", "5,6,7")
    assert proc.returncode == 2 and "not one you built" in proc.stderr
    assert not marker.exists()
    # Symlinked out of the artifact (same bytes, same hash): refused even with trust.
    (tmp_path / "outside.so").write_bytes(data)
    (path / name).unlink()
    (path / name).symlink_to(tmp_path / "outside.so")
    proc = _run(program, "--trust-ops", str(path), "6", "5,6,7")
    assert proc.returncode == 2 and "resolves outside the artifact" in proc.stderr
    assert not marker.exists()
    # Hash mismatch: refused even with trust.
    (path / name).unlink()
    (path / name).write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    proc = _run(program, "--trust-ops", str(path), "6", "5,6,7")
    assert proc.returncode == 2 and "SHA-256 does not match" in proc.stderr
    assert not marker.exists()


def test_c_library_the_graphs_do_not_use_is_not_loaded(program: Path, tmp_path: Path) -> None:
    path = _copy(tmp_path)  # stock graphs
    (path / "libx.so").write_bytes(b"never loaded")
    _edit(path, lambda r: r.update(custom_op_library="libx.so", custom_ops=["BatchInvariantMatMul"]))
    proc = _run(program, str(path), "4", "5,6,7")
    assert proc.returncode == 0, proc.stderr
