"""The exporter's exactness declaration, measured on a two-layer twin of the artifact
(exporter/exactness_probe.py), agrees with the full check on exact and inexact artifacts and
leaves nothing behind; the streamed weights file and its hash are what a second pass gives."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
from loopcast.exporter.exactness_probe import PROBE_DIR, rows_match_shallow, shallow_config
from loopcast.ort_runtime.decoding.exactness import rows_match_on_cpu

from loopcast.manifest import WEIGHTS_FILE, Manifest, sha256_file
from tests.artifacts import artifact, require_exact_cpu_artifacts


@pytest.mark.parametrize("kw", [{}, {"ops": "stock"}, {"draft_depth": 2}, {"batch_invariant": True}])
def test_shallow_twin_agrees_with_the_full_check(kw) -> None:
    require_exact_cpu_artifacts()
    path = artifact("demo", **kw)
    manifest = Manifest.read(path)
    assert shallow_config(manifest.config).num_layers < manifest.config.num_layers  # a real twin
    before = sorted(p.name for p in path.iterdir())
    full = rows_match_on_cpu(path)
    assert rows_match_shallow(path) == full
    assert full == (
        kw.get("ops") != "stock"
    )  # stock GroupQueryAttention rows differ; the loopcast op's do not
    assert sorted(p.name for p in path.iterdir()) == before and not (path / PROBE_DIR).exists()


def test_manifest_declares_the_measured_answer() -> None:
    require_exact_cpu_artifacts()
    assert Manifest.read(artifact("demo")).exact_verify == {"cpu": True, "cuda": False}
    assert Manifest.read(artifact("demo", ops="stock")).exact_verify == {"cpu": False, "cuda": False}


def _chunked_reference(path) -> str:
    """loopcast/manifest.py's chunked scheme, written out sequentially: SHA-256 of the size (8
    bytes, little endian) and the SHA-256 of each 64 MiB chunk."""
    data = path.read_bytes()
    digests = b"".join(
        hashlib.sha256(data[i : i + (64 << 20)]).digest() for i in range(0, len(data), 64 << 20)
    )
    return hashlib.sha256(len(data).to_bytes(8, "little") + digests).hexdigest()


def test_weights_record_is_the_chunked_hash_of_the_file(make_checkpoint, tmp_path) -> None:
    """The weights are hashed in parallel 64 MiB chunks after they are written: the record must be
    that scheme's digest of the file on disk, alignment padding included, and verify."""
    from loopcast.exporter.export import ExportOptions, export_checkpoint

    from loopcast.manifest import CHUNKED_SHA256
    from loopcast.manifest_schema import verify_hashes
    from loopcast.presets import PRESETS

    config = PRESETS["tiny-llama"].replace(qkv_bias=True, o_bias=True, tie_word_embeddings=False)
    manifest = export_checkpoint(make_checkpoint(config), tmp_path / "art", ExportOptions(max_length=48))
    record = manifest.files[WEIGHTS_FILE]
    assert record.hash == CHUNKED_SHA256
    assert record.sha256 == _chunked_reference(tmp_path / "art" / WEIGHTS_FILE)
    assert record.size == (tmp_path / "art" / WEIGHTS_FILE).stat().st_size
    assert all(r.hash == "sha256" for name, r in manifest.files.items() if name != WEIGHTS_FILE)
    assert any("weights.safetensors" in line for line in verify_hashes(manifest, tmp_path / "art"))


def test_chunked_hash_across_chunks(tmp_path) -> None:
    """Past one chunk: the parallel digest is the sequential definition's, and a byte changed in
    the second chunk (or one byte more) changes it."""
    from loopcast.manifest import chunked_sha256

    path = tmp_path / "big"
    data = bytearray(np.random.default_rng(0).integers(0, 256, (64 << 20) + 1000, dtype=np.uint8).tobytes())
    path.write_bytes(data)
    first = chunked_sha256(path)
    assert first == _chunked_reference(path)
    data[(64 << 20) + 7] ^= 1
    path.write_bytes(data)
    assert chunked_sha256(path) not in (first,) and chunked_sha256(path) == _chunked_reference(path)
    path.write_bytes(bytes(data) + b"\0")
    assert chunked_sha256(path) == _chunked_reference(path)
    empty = tmp_path / "empty"
    empty.write_bytes(b"")
    assert chunked_sha256(empty) == _chunked_reference(empty)


def test_streamed_writer_matches_an_unhashed_write(tmp_path) -> None:
    """Writing with and without the hashing thread gives the same bytes, and the digest is theirs."""
    from loopcast.exporter.checkpoint import validate_checkpoint
    from loopcast.exporter.weights import checkpoint_reader, weight_layout, write_weights

    from tests.artifacts import checkpoint, config_of

    ckpt, config = checkpoint("ouro-r3"), config_of("ouro-r3")
    read, close = checkpoint_reader(validate_checkpoint(ckpt, config))
    try:
        digest = hashlib.sha256()
        hashed = write_weights(tmp_path / "a", config, 40, "fp32", read, sha256=digest)
        plain = write_weights(tmp_path / "b", config, 40, "fp32", read)
        assert hashed == plain == weight_layout(config, 40, "fp32", read)
    finally:
        close()
    assert (tmp_path / "a").read_bytes() == (tmp_path / "b").read_bytes()
    assert digest.hexdigest() == sha256_file(tmp_path / "a")


def test_records_without_a_scheme_are_plain_sha256(tmp_path) -> None:
    """Manifests written before the chunked scheme have no ``hash`` key: their digests are the
    files' SHA-256 and still verify; a record whose digest does not match its scheme fails."""
    import json
    import shutil

    from loopcast.errors import ArtifactError
    from loopcast.manifest_schema import verify_hashes

    path = tmp_path / "art"
    shutil.copytree(artifact("ouro-r3", ops="stock"), path)
    raw = json.loads((path / "manifest.json").read_text())
    record = raw["files"][WEIGHTS_FILE]
    chunked = record["sha256"]
    record.pop("hash")
    record["sha256"] = sha256_file(path / WEIGHTS_FILE)
    (path / "manifest.json").write_text(json.dumps(raw))
    assert any(WEIGHTS_FILE in line for line in verify_hashes(Manifest.read(path), path))
    record["sha256"] = chunked  # the chunked digest read as a plain one
    (path / "manifest.json").write_text(json.dumps(raw))
    with pytest.raises(ArtifactError, match="does not match the manifest"):
        verify_hashes(Manifest.read(path), path)
