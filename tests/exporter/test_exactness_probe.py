"""The exporter's exactness declaration, measured on a two-layer twin of the artifact
(exporter/exactness_probe.py), agrees with the full check on exact and inexact artifacts and
leaves nothing behind; the streamed weights file and its hash are what a second pass gives."""

from __future__ import annotations

import hashlib

import pytest

from loopcast.exporter.exactness_probe import PROBE_DIR, rows_match_shallow, shallow_config
from loopcast.manifest import WEIGHTS_FILE, Manifest, sha256_file
from loopcast.ort_runtime.exactness import rows_match_on_cpu
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
    assert full == (kw.get("ops") != "stock")   # stock GroupQueryAttention rows differ; the loopcast op's do not
    assert sorted(p.name for p in path.iterdir()) == before and not (path / PROBE_DIR).exists()


def test_manifest_declares_the_measured_answer() -> None:
    require_exact_cpu_artifacts()
    assert Manifest.read(artifact("demo")).exact_verify == {"cpu": True, "cuda": False}
    assert Manifest.read(artifact("demo", ops="stock")).exact_verify == {"cpu": False, "cuda": False}


def test_weights_hash_recorded_while_writing_is_the_files_hash(make_checkpoint, tmp_path) -> None:
    """The weights are hashed as they are written (no second pass): the record must still be
    the SHA-256 of the file on disk, alignment padding included."""
    from loopcast.config import PRESETS
    from loopcast.exporter.export import ExportOptions, export_checkpoint

    config = PRESETS["tiny-llama"].replace(qkv_bias=True, o_bias=True, tie_word_embeddings=False)
    manifest = export_checkpoint(make_checkpoint(config), tmp_path / "art", ExportOptions(max_length=48))
    assert manifest.files[WEIGHTS_FILE].sha256 == sha256_file(tmp_path / "art" / WEIGHTS_FILE)
    assert manifest.files[WEIGHTS_FILE].size == (tmp_path / "art" / WEIGHTS_FILE).stat().st_size


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
