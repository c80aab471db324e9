"""The `loopcast` custom-op library: BatchInvariantMatMul (B[K, N] and trans_b B[N, K]) against
numpy, row invariance, CPU-only and CUDA builds, and loading from Python and from the C example."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
from loopcast.custom_ops.build import build_library, find_nvcc, has_cuda
from loopcast.ort_runtime import load

from loopcast.errors import LoopcastError
from tests.artifacts import artifact
from tests.custom_ops.ops_models import as_dtype, matmul_model, session, swiglu_model

ROOT = Path(__file__).resolve().parents[2]


def _session(library: Path, K: int, N: int, dtype: str, trans_b: bool = False) -> ort.InferenceSession:
    return session(matmul_model(K, N, dtype, trans_b), library)


@pytest.mark.parametrize("trans_b", [False, True])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_swiglu_attribute_is_the_swiglu_op_then_the_product(library: Path, dtype: str, trans_b: bool) -> None:
    """swiglu=1 (the MLP's down projection reading [gate | up]) gives the bits of the SwiGLU op
    followed by the plain product, and its rows do not depend on the number of rows."""
    rng = np.random.default_rng(4)
    for K, N in [(64, 48), (7, 3)]:
        gate_up = as_dtype(2 * rng.standard_normal((6, 2 * K)), dtype)
        B = as_dtype(rng.standard_normal((N, K) if trans_b else (K, N)) / np.sqrt(K), dtype)
        act = session(swiglu_model(2 * K, dtype), library).run(None, {"gate_up": gate_up[None]})[0][0]
        plain = _session(library, K, N, dtype, trans_b).run(None, {"A": act, "B": B})[0]
        fused = session(matmul_model(K, N, dtype, trans_b, swiglu=True), library)
        got = fused.run(None, {"A": gate_up, "B": B})[0]
        assert np.array_equal(got, plain), (K, N)
        one_by_one = np.concatenate([fused.run(None, {"A": gate_up[i : i + 1], "B": B})[0] for i in range(6)])
        assert np.array_equal(one_by_one, got)
    with pytest.raises(Exception, match=r"A\[\.\.\., 2K\] \(swiglu=1: gate \| up\).*got A\[2, 16\]"):
        session(matmul_model("K", "N", dtype, trans_b, swiglu=True), library).run(
            None, {"A": as_dtype(np.zeros((2, 16)), dtype), "B": as_dtype(np.zeros((5, 16)), dtype)}
        )


@pytest.mark.parametrize("trans_b", [False, True])
@pytest.mark.parametrize("dtype,tol", [("float32", 1e-4), ("float16", 2e-2), ("bfloat16", 5e-2)])
def test_matches_numpy(library: Path, dtype: str, tol: float, trans_b: bool) -> None:
    rng = np.random.default_rng(1)
    for K, N in [(64, 48), (384, 1152), (7, 3)]:
        A = as_dtype(rng.standard_normal((9, K)), dtype)
        B = as_dtype(rng.standard_normal((N, K) if trans_b else (K, N)) / np.sqrt(K), dtype)
        got = _session(library, K, N, dtype, trans_b).run(None, {"A": A, "B": B})[0]
        expected = A.astype(np.float64) @ (B.T if trans_b else B).astype(np.float64)
        np.testing.assert_allclose(got.astype(np.float64), expected, rtol=tol, atol=tol)


@pytest.mark.parametrize("trans_b", [False, True])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_rows_do_not_depend_on_the_number_of_rows(library: Path, dtype: str, trans_b: bool) -> None:
    rng = np.random.default_rng(2)
    K, N = 384, 320
    session_ = _session(library, K, N, dtype, trans_b)
    A = as_dtype(rng.standard_normal((40, K)), dtype)
    B = as_dtype(rng.standard_normal((N, K) if trans_b else (K, N)), dtype)
    single = np.concatenate([session_.run(None, {"A": A[i : i + 1], "B": B})[0] for i in range(40)])
    for m in [*range(2, 33), 40]:
        assert np.array_equal(session_.run(None, {"A": A[:m], "B": B})[0], single[:m]), m


def test_shape_errors_name_the_layout(library: Path) -> None:
    with pytest.raises(Exception, match=r"B\[N, K\] \(trans_b=1\), got A\[2, 8\] and B\[8, 4\]"):
        session(matmul_model("K", "N", "float32", trans_b=True), library).run(
            None, {"A": np.zeros((2, 8), np.float32), "B": np.zeros((8, 4), np.float32)}
        )


def test_cuda_and_cpu_only_builds_load_in_a_cpu_session(library: Path, tmp_path: Path) -> None:
    """A CUDA build must load and run in a CPU-only runtime with no GPU (cudart is static and lazy)."""
    libs = [build_library(tmp_path / "cpu", cuda=False)]
    assert not has_cuda(libs[0])
    if find_nvcc() is not None:
        libs.append(build_library(tmp_path / "cuda", cuda=True))
        assert has_cuda(libs[1])
    A = np.ones((3, 16), np.float32)
    for lib in libs:
        assert np.array_equal(
            _session(lib, 16, 4, "float32").run(None, {"A": A, "B": np.ones((16, 4), np.float32)})[0],
            np.full((3, 4), 16.0, np.float32),
        )


def _artifact_with_library(tmp_path: Path, library: Path) -> Path:
    """A --batch-invariant artifact (its graphs need the library) carrying ``library``, with the
    size and SHA-256 records the runtime checks before loading native code (docs/trust.md)."""
    path = tmp_path / "art"
    shutil.copytree(artifact("ouro-r3", batch_invariant=True), path)
    raw = json.loads((path / "manifest.json").read_text())
    shutil.copy(library, path / raw["custom_op_library"])
    data = library.read_bytes()
    raw["files"][raw["custom_op_library"]] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (path / "manifest.json").write_text(json.dumps(raw))
    return path


def test_runtime_registers_the_manifest_library(library: Path, tmp_path: Path) -> None:
    path = _artifact_with_library(tmp_path, library)
    ids = [5, 6, 7]
    # Built here, so trusted by hash; and the batch-invariant graphs give the stock graphs' tokens.
    assert load(path).generate(ids, 12).tokens == load(artifact("ouro-r3")).generate(ids, 12).tokens


def test_c_program_registers_the_library(library: Path, tmp_path: Path) -> None:
    headers = ROOT / ".cdeps" / "usr" / "include" / "onnxruntime" / "onnxruntime_c_api.h"
    if not headers.is_file() or not Path("/usr/include/cjson/cJSON.h").is_file():
        if os.environ.get("LOOPCAST_REQUIRE_C") == "1":
            pytest.fail("C example prerequisites missing")
        pytest.skip("C example prerequisites missing")
    build = tmp_path / "c"
    subprocess.run(
        ["make", "-C", str(ROOT / "tools" / "c_generate"), f"BUILD={build}", f"PYTHON={sys.executable}"],
        check=True,
        capture_output=True,
    )
    path = _artifact_with_library(tmp_path, library)
    proc = subprocess.run(
        [str(build / "c_generate"), str(path), "12", "5,6,7"], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
    assert [int(t) for t in proc.stdout.strip().split(",")] == load(path).generate([5, 6, 7], 12).tokens
    # A new file, not an in-place rewrite: this process has the old one mapped (load() above), and
    # truncating a mapped library crashes the process later with SIGBUS.
    (path / library.name).unlink()
    (path / library.name).write_bytes(b"not a library")  # record no longer matches: refused
    proc = subprocess.run(
        [str(build / "c_generate"), str(path), "12", "5,6,7"], capture_output=True, text=True
    )
    assert proc.returncode == 2 and proc.stderr.startswith("error:") and library.name in proc.stderr
    raw = json.loads((path / "manifest.json").read_text())
    raw["files"][library.name] = {"size": 13, "sha256": hashlib.sha256(b"not a library").hexdigest()}
    (path / "manifest.json").write_text(json.dumps(raw))
    proc = subprocess.run(
        [str(build / "c_generate"), "--trust-ops", str(path), "12", "5,6,7"], capture_output=True, text=True
    )  # trusted, matching, but not a library
    assert proc.returncode == 2 and proc.stderr.startswith("error:") and library.name in proc.stderr


def test_build_errors_are_clear(tmp_path: Path) -> None:
    with pytest.raises(LoopcastError, match="headers not found"):
        build_library(tmp_path, ort_include=tmp_path)
