"""The trust rule for native code and paths (docs/trust.md): an artifact's op library runs only
when its graphs need it, it is a regular file inside the artifact whose SHA-256 matches the
manifest, and the user trusts it; every path the manifest names stays inside the artifact.

The hostile library writes a marker file from its constructor, so "its code never ran" is
observable: the marker must not exist after any refused load.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from loopcast.custom_ops.build import find_ort_include
from loopcast.ort_runtime import load
from loopcast.ort_runtime.loading.describe import describe_artifact

from loopcast.errors import ArtifactError
from tests.artifacts import artifact

MARKER_SOURCE = r"""
#include <stdio.h>
__attribute__((constructor)) static void loopcast_test_marker(void) {
    FILE *f = fopen(MARKER_PATH, "w");
    if (f) { fputs("constructor ran\n", f); fclose(f); }
}
"""


@pytest.fixture(scope="module")
def hostile(tmp_path_factory) -> tuple[Path, Path]:
    """(library, marker path): a shared library whose constructor creates the marker."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler to build the marker library")
    root = tmp_path_factory.mktemp("hostile")
    marker = root / "marker"
    (root / "marker.c").write_text(MARKER_SOURCE)
    library = root / "libhostile.so"
    subprocess.run(
        [cc, "-shared", "-fPIC", f'-DMARKER_PATH="{marker}"', str(root / "marker.c"), "-o", str(library)],
        check=True,
        capture_output=True,
    )
    return library, marker


@pytest.fixture(scope="module")
def batch_invariant() -> Path:
    """An artifact whose graphs really use loopcast-domain ops (the library is needed)."""
    if find_ort_include() is None or shutil.which("c++") is None:
        if os.environ.get("LOOPCAST_REQUIRE_C") == "1":
            pytest.fail("ORT C++ headers or a C++ compiler missing")
        pytest.skip("ORT C++ headers or a C++ compiler missing (tools/c_generate/fetch_deps.sh)")
    return artifact("ouro-r3", batch_invariant=True)


def _copy(src: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "art"
    shutil.copytree(src, dst, symlinks=True)
    return dst


def _edit(path: Path, **changes) -> dict:
    raw = json.loads((path / "manifest.json").read_text())
    raw.update(changes)
    (path / "manifest.json").write_text(json.dumps(raw))
    return raw


def _plant(path: Path, library: Path, name: str | None = None, *, record: bool = True) -> str:
    """Put ``library`` into the artifact as its op library, with a matching manifest record."""
    raw = json.loads((path / "manifest.json").read_text())
    name = name or raw.get("custom_op_library") or library.name
    shutil.copy(library, path / name)
    files = dict(raw.get("files", {}))
    if record:
        data = library.read_bytes()
        files[name] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    _edit(path, custom_op_library=name, custom_ops=raw["custom_ops"] or ["BatchInvariantMatMul"], files=files)
    return name


def test_needed_library_not_built_here_is_refused_without_trust(hostile, batch_invariant, tmp_path) -> None:
    library, marker = hostile
    path = _copy(batch_invariant, tmp_path)
    _plant(path, library)
    with pytest.raises(ArtifactError, match="not one you built.*--trust-ops"):
        load(path)
    assert not marker.exists()
    # The same artifact with trust: the constructor runs (so the marker check above can fail),
    # and ORT then refuses it as an op library: still a clean error.
    with pytest.raises(ArtifactError, match="could not be loaded"):
        load(path, trust_ops=True)
    assert marker.exists()
    marker.unlink()


def test_library_the_graphs_do_not_need_is_never_loaded(hostile, tmp_path) -> None:
    library, marker = hostile
    path = _copy(artifact("ouro-r3", ops="stock"), tmp_path)  # stock graphs: no loopcast-domain node
    _plant(path, library)
    ids = [5, 6, 7]
    assert (
        load(path, trust_ops=True).generate(ids, 6).tokens
        == load(artifact("ouro-r3", ops="stock")).generate(ids, 6).tokens
    )
    assert not marker.exists()


def test_hash_mismatch_is_refused_even_with_trust(hostile, batch_invariant, tmp_path) -> None:
    library, marker = hostile
    path = _copy(batch_invariant, tmp_path)
    name = json.loads((path / "manifest.json").read_text())["custom_op_library"]
    shutil.copy(library, path / name)  # swapped in, record left as exported
    raw = json.loads((path / "manifest.json").read_text())
    raw["files"][name]["size"] = library.stat().st_size
    _edit(path, files=raw["files"])
    with pytest.raises(ArtifactError, match="sampled SHA-256 differs"):  # the cheap check on every load
        load(path, trust_ops=True)
    del raw["files"][name]["sampled_sha256"]
    _edit(path, files=raw["files"])
    with pytest.raises(ArtifactError, match="SHA-256 .* does not match"):  # the full hash before loading code
        load(path, trust_ops=True)
    assert not marker.exists()


def test_library_without_a_recorded_hash_is_refused(hostile, batch_invariant, tmp_path) -> None:
    library, marker = hostile
    path = _copy(batch_invariant, tmp_path)
    _plant(path, library, record=False)
    raw = json.loads((path / "manifest.json").read_text())
    del raw["files"][raw["custom_op_library"]]
    _edit(path, files=raw["files"])
    with pytest.raises(ArtifactError, match="records no SHA-256"):
        load(path, trust_ops=True)
    assert not marker.exists()


def test_symlinked_library_leaving_the_artifact_is_refused(hostile, batch_invariant, tmp_path) -> None:
    library, marker = hostile
    path = _copy(batch_invariant, tmp_path)
    name = _plant(path, library)
    (path / name).unlink()
    (path / name).symlink_to(library)  # same bytes, same hash, but outside
    with pytest.raises(ArtifactError, match="resolves outside the artifact"):
        load(path, trust_ops=True)
    assert not marker.exists()


@pytest.mark.parametrize("value", ["/tmp/libx.so", "../libx.so", "sub/libx.so", "", 7])
def test_library_name_must_be_a_plain_file_name(batch_invariant, tmp_path, value) -> None:
    path = _copy(batch_invariant, tmp_path)
    _edit(path, custom_op_library=value)
    with pytest.raises(ArtifactError, match="custom_op_library"):
        load(path, trust_ops=True)


def test_locally_built_library_is_trusted_by_hash_and_only_by_hash(
    batch_invariant, tmp_path, monkeypatch
) -> None:
    # Exported here: the library is this user's own build, recorded in the cache, so no flag is needed.
    ids = [5, 6, 7]
    tokens = load(batch_invariant).generate(ids, 6).tokens
    assert "libloopcast_ops.so, built here" in describe_artifact(batch_invariant)
    # With another cache (another user's registry) the same artifact needs trust.
    monkeypatch.setenv("LOOPCAST_CACHE", str(tmp_path / "other-cache"))
    with pytest.raises(ArtifactError, match="not one you built"):
        load(batch_invariant)
    assert "not built here: loading needs --trust-ops" in describe_artifact(batch_invariant)
    assert load(batch_invariant, trust_ops=True).generate(ids, 6).tokens == tokens


@pytest.mark.parametrize(
    "field,value",
    [
        ("weights_file", "/etc/passwd"),
        ("weights_file", "../weights.safetensors"),
        ("graph", "/tmp/decode.onnx"),
        ("graph", "../art/decode.onnx"),
        ("graph", "./decode.onnx"),
        ("tokenizer_files", ["../tokenizer.json"]),
    ],
)
def test_manifest_paths_stay_inside(tmp_path, field, value) -> None:
    path = _copy(artifact("ouro-r3", ops="stock"), tmp_path)
    raw = json.loads((path / "manifest.json").read_text())
    if field == "graph":
        raw["graphs"]["decode"]["file"] = value
    else:
        raw[field] = value
    (path / "manifest.json").write_text(json.dumps(raw))
    with pytest.raises(ArtifactError, match="inside the artifact"):
        load(path)


@pytest.mark.parametrize("what", ["decode.onnx", "weights.safetensors", "tokenizer.json"])
def test_symlinks_leaving_the_artifact_are_refused(tmp_path, what) -> None:
    src = artifact("demo", ops="stock")
    path = _copy(src, tmp_path)
    outside = tmp_path / f"outside-{what}"
    shutil.move(path / what, outside)
    (path / what).symlink_to(outside)
    with pytest.raises(ArtifactError, match="resolves outside the artifact"):
        load(path)


def test_symlink_inside_the_artifact_is_fine(tmp_path) -> None:
    path = _copy(artifact("ouro-r3", ops="stock"), tmp_path)
    (path / "sub").mkdir()
    shutil.move(path / "decode.onnx", path / "sub" / "decode.onnx")
    (path / "decode.onnx").symlink_to(Path("sub") / "decode.onnx")
    assert (
        load(path).generate([5, 6, 7], 4).tokens
        == load(artifact("ouro-r3", ops="stock")).generate([5, 6, 7], 4).tokens
    )


@pytest.mark.parametrize("location", ["../weights.safetensors", "/etc/hostname", "outside-link"])
def test_graph_external_data_cannot_leave_the_artifact(tmp_path, location) -> None:
    """Graphs reach their weights as ONNX external data; ONNX Runtime refuses locations outside
    the model's directory, including through a symlink, and that surfaces as one ArtifactError.
    (The prefill graph is the one tampered with: on the CPU decode and verify run on prefill's
    session and their own files are not opened, see ort_runtime/loading/artifact.py.)"""
    import onnx

    path = _copy(artifact("ouro-r3", ops="stock"), tmp_path)
    (tmp_path / "weights.safetensors").write_bytes((path / "weights.safetensors").read_bytes())
    (path / "outside-link").symlink_to(tmp_path / "weights.safetensors")
    model = onnx.load(str(path / "prefill.onnx"), load_external_data=False)
    for tensor in model.graph.initializer:
        for entry in tensor.external_data:
            if entry.key == "location":
                entry.value = location
    onnx.save(model, str(path / "prefill.onnx"))
    data = (path / "prefill.onnx").read_bytes()
    raw = json.loads((path / "manifest.json").read_text())
    raw["files"]["prefill.onnx"] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (path / "manifest.json").write_text(json.dumps(raw))
    with pytest.raises(ArtifactError, match="could not load the 'prefill' graph"):
        load(path)
