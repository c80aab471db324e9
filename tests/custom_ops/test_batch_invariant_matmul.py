"""The `loopcast` custom-op library: BatchInvariantMatMul against numpy, row invariance, and
loading from Python and from the C example."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from loopcast.custom_ops.build import build_library, find_ort_include
from loopcast.errors import LoopcastError
from loopcast.ort_runtime import load
from tests.artifacts import artifact

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def library(tmp_path_factory) -> Path:
    if find_ort_include() is None or shutil.which("c++") is None:
        if os.environ.get("LOOPCAST_REQUIRE_C") == "1":
            pytest.fail("ORT C++ headers or a C++ compiler missing")
        pytest.skip("ORT C++ headers or a C++ compiler missing (tools/c_generate/fetch_deps.sh)")
    return build_library(tmp_path_factory.mktemp("ops"))


def _session(library: Path, K: int, N: int, dtype: int) -> ort.InferenceSession:
    a = helper.make_tensor_value_info("A", dtype, ["M", K])
    b = helper.make_tensor_value_info("B", dtype, [K, N])
    y = helper.make_tensor_value_info("Y", dtype, ["M", N])
    node = helper.make_node("BatchInvariantMatMul", ["A", "B"], ["Y"], domain="loopcast", name="/matmul")
    model = helper.make_model(helper.make_graph([node], "bi_matmul", [a, b], [y]), ir_version=10,
                              opset_imports=[helper.make_opsetid("", 23), helper.make_opsetid("loopcast", 1)])
    so = ort.SessionOptions()
    so.register_custom_ops_library(str(library))
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


@pytest.mark.parametrize("dtype,np_dtype,tol", [(TensorProto.FLOAT, np.float32, 1e-4),
                                                (TensorProto.FLOAT16, np.float16, 2e-2)])
def test_matches_numpy(library: Path, dtype, np_dtype, tol) -> None:
    rng = np.random.default_rng(1)
    for K, N in [(64, 48), (384, 1152), (7, 3)]:
        A = rng.standard_normal((9, K)).astype(np_dtype)
        B = (rng.standard_normal((K, N)) / np.sqrt(K)).astype(np_dtype)
        got = _session(library, K, N, dtype).run(None, {"A": A, "B": B})[0]
        expected = A.astype(np.float64) @ B.astype(np.float64)
        assert got.dtype == np_dtype
        np.testing.assert_allclose(got.astype(np.float64), expected, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype,np_dtype", [(TensorProto.FLOAT, np.float32), (TensorProto.FLOAT16, np.float16)])
def test_rows_do_not_depend_on_the_number_of_rows(library: Path, dtype, np_dtype) -> None:
    rng = np.random.default_rng(2)
    K, N = 384, 640
    session = _session(library, K, N, dtype)
    A = rng.standard_normal((32, K)).astype(np_dtype)
    B = rng.standard_normal((K, N)).astype(np_dtype)
    single = np.concatenate([session.run(None, {"A": A[i:i + 1], "B": B})[0] for i in range(32)])
    for m in (2, 5, 8, 17, 32):
        assert np.array_equal(session.run(None, {"A": A[:m], "B": B})[0], single[:m]), m


def _artifact_with_library(tmp_path: Path, library: Path) -> Path:
    path = tmp_path / "art"
    shutil.copytree(artifact("ouro-r3"), path)
    shutil.copy(library, path / library.name)
    raw = json.loads((path / "manifest.json").read_text())
    raw["custom_op_library"], raw["custom_ops"] = library.name, ["BatchInvariantMatMul"]
    (path / "manifest.json").write_text(json.dumps(raw))
    return path


def test_runtime_registers_the_manifest_library(library: Path, tmp_path: Path) -> None:
    path = _artifact_with_library(tmp_path, library)
    ids = [5, 6, 7]
    assert load(path).generate(ids, 12).tokens == load(artifact("ouro-r3")).generate(ids, 12).tokens


def test_c_program_registers_the_library(library: Path, tmp_path: Path) -> None:
    headers = ROOT / ".cdeps" / "usr" / "include" / "onnxruntime" / "onnxruntime_c_api.h"
    if not headers.is_file() or not Path("/usr/include/cjson/cJSON.h").is_file():
        if os.environ.get("LOOPCAST_REQUIRE_C") == "1":
            pytest.fail("C example prerequisites missing")
        pytest.skip("C example prerequisites missing")
    build = tmp_path / "c"
    subprocess.run(["make", "-C", str(ROOT / "tools" / "c_generate"), f"BUILD={build}", f"PYTHON={sys.executable}"],
                   check=True, capture_output=True)
    path = _artifact_with_library(tmp_path, library)
    proc = subprocess.run([str(build / "c_generate"), str(path), "12", "5,6,7"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert [int(t) for t in proc.stdout.strip().split(",")] == load(path).generate([5, 6, 7], 12).tokens
    (path / library.name).write_bytes(b"not a library")
    proc = subprocess.run([str(build / "c_generate"), str(path), "12", "5,6,7"], capture_output=True, text=True)
    assert proc.returncode == 2 and proc.stderr.startswith("error:") and library.name in proc.stderr


def test_build_errors_are_clear(tmp_path: Path) -> None:
    with pytest.raises(LoopcastError, match="headers not found"):
        build_library(tmp_path, ort_include=tmp_path)
