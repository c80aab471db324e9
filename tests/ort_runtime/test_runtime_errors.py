"""Bad artifacts and bad requests: clear errors, and the model stays usable."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from loopcast.ort_runtime import load

from loopcast.errors import ArtifactError, RequestError
from tests.artifacts import artifact, require_exact_cpu_artifacts


def _copy(tmp_path: Path, name: str = "ouro-r3") -> Path:
    dst = tmp_path / "art"
    shutil.copytree(artifact(name, ops="stock"), dst)  # stock graphs: these checks are about the files
    return dst


def _edit_manifest(path: Path, **changes) -> None:
    raw = json.loads((path / "manifest.json").read_text())
    raw.update(changes)
    (path / "manifest.json").write_text(json.dumps(raw))


def test_missing_artifact(tmp_path: Path) -> None:
    with pytest.raises(ArtifactError, match="not found"):
        load(tmp_path / "nope")


def test_missing_manifest(tmp_path: Path) -> None:
    path = _copy(tmp_path)
    (path / "manifest.json").unlink()
    with pytest.raises(ArtifactError, match="manifest.json not found"):
        load(path)


def test_corrupt_manifest(tmp_path: Path) -> None:
    path = _copy(tmp_path)
    (path / "manifest.json").write_text("{not json")
    with pytest.raises(ArtifactError, match="corrupt manifest"):
        load(path)


def test_schema_mismatch(tmp_path: Path) -> None:
    path = _copy(tmp_path)
    _edit_manifest(path, schema_version=99)
    with pytest.raises(ArtifactError, match="schema version 99"):
        load(path)


def test_missing_graph_file(tmp_path: Path) -> None:
    path = _copy(tmp_path)
    (path / "decode.onnx").unlink()
    with pytest.raises(ArtifactError, match="decode.onnx.*missing"):
        load(path)


def test_corrupt_graph_file(tmp_path: Path) -> None:
    """(draft: on the CPU decode and verify run on prefill's session, ort_runtime/loading/artifact.py)"""
    path = _copy(tmp_path)
    size = (path / "draft.onnx").stat().st_size
    (path / "draft.onnx").write_bytes(b"\x00garbage".ljust(size, b"\xff"))  # same size: past the size check
    with pytest.raises(ArtifactError, match="draft.onnx.*does not match the manifest"):
        load(path)
    _edit_manifest(path, files={})  # an artifact without records: ORT's own error
    with pytest.raises(ArtifactError, match="could not load the 'draft' graph"):
        load(path)
    (path / "draft.onnx").write_bytes(b"\x00garbage")
    with pytest.raises(ArtifactError, match="could not load the 'draft' graph"):
        load(path)


def test_missing_weights(tmp_path: Path) -> None:
    path = _copy(tmp_path)
    (path / "weights.safetensors").unlink()
    with pytest.raises(ArtifactError, match="weights file is missing"):
        load(path)


def test_custom_op_library_the_graphs_do_not_use(tmp_path: Path) -> None:
    path = _copy(tmp_path)
    (path / "libbroken.so").write_bytes(b"not an ELF file")
    raw = json.loads((path / "manifest.json").read_text())
    files = {
        **raw["files"],
        "libbroken.so": {"size": 15, "sha256": hashlib.sha256(b"not an ELF file").hexdigest()},
    }
    _edit_manifest(path, custom_op_library="libbroken.so", custom_ops=["BatchInvariantMatMul"], files=files)
    # The stock graphs use no loopcast-domain node, so the library is not needed and never loaded
    # (a library that is needed but cannot load: tests/ort_runtime/test_trust.py).
    assert (
        load(path, trust_ops=True).generate([5, 6, 7], 3).tokens
        == load(artifact("ouro-r3", ops="stock")).generate([5, 6, 7], 3).tokens
    )


@pytest.fixture(scope="module")
def model():
    return load(artifact("ouro-r3", max_length=32))


@pytest.mark.parametrize(
    "ids,kwargs,match",
    [
        ([], {}, "empty"),
        ([1, 2, 1000], {}, "outside the vocabulary"),
        ([-1], {}, "outside the vocabulary"),
        (list(range(33)), {}, "longer than the max length"),
        ([1, 2], {"max_new_tokens": -1}, "max_new_tokens"),
    ],
)
def test_bad_requests_leave_the_model_usable(model, ids, kwargs, match) -> None:
    good = model.generate([4, 5, 6], 10, stop_ids=()).tokens
    with pytest.raises(RequestError, match=match):
        model.generate(ids, **({"max_new_tokens": 5} | kwargs))
    assert model.generate([4, 5, 6], 10, stop_ids=()).tokens == good


def test_rewind_out_of_range(model) -> None:
    gen = model.new_generator()
    gen.prefill([1, 2, 3])
    with pytest.raises(RequestError, match="rewind"):
        gen.rewind(4)
    gen.rewind(1)
    assert gen.n == 1


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "loopcast.cli", *args], capture_output=True, text=True)


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--prompt-ids", "1,2,100000"], "outside the vocabulary"),
        (["--prompt-ids", "1,x"], "comma-separated"),
        (["--prompt-ids", ",".join(["3"] * 40)], "longer than the max length"),
        (["--prompt", "hi"], "tokenizer"),
        (["--prompt-ids", "1,2", "--speculative", "self", "--num-draft-tokens", "9"], "num-draft-tokens"),
        (["--prompt-ids", "1,2", "--device", "cuda"], "CUDAExecutionProvider"),
    ],
)
def test_cli_generate_errors_are_one_line(args, needle) -> None:
    proc = _cli("generate", str(artifact("ouro-r3", max_length=32)), "--max-new-tokens", "4", *args)
    assert proc.returncode != 0
    assert proc.stderr.startswith("error:") and proc.stderr.strip().count("\n") == 0, proc.stderr
    assert needle in proc.stderr and "Traceback" not in proc.stderr


def test_cli_generate_json_and_stream() -> None:
    require_exact_cpu_artifacts()
    path = str(artifact("demo"))
    proc = _cli(
        "generate",
        path,
        "--prompt",
        "def add(a, b):\n",
        "--max-new-tokens",
        "12",
        "--json",
        "--speculative",
        "prompt-lookup",
        "--gate",
        "cost",
    )
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert len(data["tokens"]) == 12 and isinstance(data["text"], str)
    for key in (
        "rounds",
        "proposed",
        "accepted",
        "tokens_per_round",
        "steps",
        "step_seconds",
        "near_tie_rejections",
    ):
        assert key in data["stats"]
    plain = json.loads(
        _cli("generate", path, "--prompt", "def add(a, b):\n", "--max-new-tokens", "12", "--json").stdout
    )
    assert plain["tokens"] == data["tokens"]
    streamed = _cli("generate", path, "--prompt", "def add(a, b):\n", "--max-new-tokens", "12", "--stream")
    assert streamed.returncode == 0 and streamed.stdout.rstrip("\n") == plain["text"].rstrip("\n")


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_half_precision_artifact_on_cpu_gets_a_clear_error(dtype: str, tmp_path) -> None:
    """Asked for on a CPU-only install with the default op set, fp16/bf16 is refused at export
    (it could only fail at load); built anyway for a GPU (an explicit op set), the CPU refuses
    it at load in one clear line."""
    from loopcast.exporter.export import ExportOptions, export_checkpoint

    from loopcast.devices import cuda_available
    from loopcast.errors import ExportError
    from tests.artifacts import checkpoint

    if not cuda_available():
        with pytest.raises(
            ExportError, match=f"--dtype {dtype}: {dtype} artifacts run on the CUDA device only"
        ):
            export_checkpoint(checkpoint("ouro-r2-gqa"), tmp_path / "a", ExportOptions(dtype=dtype))
        assert not (tmp_path / "a").exists()
    with pytest.raises(ArtifactError, match=f"{dtype} artifacts need the CUDA device"):
        load(artifact("ouro-r2-gqa", dtype=dtype, ops="stock"))
