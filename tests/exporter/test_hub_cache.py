"""``org/name`` ids resolved offline from a fabricated Hugging Face hub cache."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner
from loopcast.cli import main
from loopcast.exporter.checkpoint import resolve_checkpoint
from loopcast.exporter.hub_cache import hub_cache_dir

from loopcast.errors import CheckpointError
from loopcast.presets import PRESETS


def fabricate_cache(
    root: Path, source: Path, model_id: str = "tiny-org/tiny-llama", commit: str = "0123abcd"
) -> Path:
    """The layout huggingface_hub writes: files are symlinks from the snapshot into blobs/."""
    repo = root / ("models--" + model_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    for i, path in enumerate(sorted(source.iterdir())):
        blob = repo / "blobs" / f"blob{i}"
        shutil.copy(path, blob)
        os.symlink(os.path.relpath(blob, snapshot), snapshot / path.name)
    return snapshot


@pytest.fixture
def cache(make_checkpoint, tmp_path, monkeypatch) -> Path:
    root = tmp_path / "hub"
    snapshot = fabricate_cache(root, make_checkpoint(PRESETS["tiny-llama"]))
    monkeypatch.setenv("HF_HUB_CACHE", str(root))
    monkeypatch.chdir(tmp_path)  # "tiny-org/tiny-llama" must not exist as a relative path
    return snapshot


def test_cache_dir_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    assert hub_cache_dir() == tmp_path / "home" / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "c"))
    assert hub_cache_dir() == tmp_path / "c"
    monkeypatch.delenv("HF_HUB_CACHE")
    monkeypatch.delenv("HF_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "user"))
    assert hub_cache_dir() == tmp_path / "user" / ".cache" / "huggingface" / "hub"


def test_id_resolves_to_the_main_snapshot(cache):
    assert resolve_checkpoint("tiny-org/tiny-llama") == cache


def test_export_inspect_and_torch_generate_take_an_id(cache, tmp_path):
    runner = CliRunner()
    result = runner.invoke(
        main, ["export", "tiny-org/tiny-llama", "-o", str(tmp_path / "art"), "--max-length", "32"]
    )
    assert result.exit_code == 0, result.output
    result = runner.invoke(main, ["inspect", "tiny-org/tiny-llama"])
    assert result.exit_code == 0 and str(cache) in result.output
    ort = runner.invoke(
        main, ["generate", str(tmp_path / "art"), "--prompt-ids", "3,4,5", "--max-new-tokens", "4"]
    )
    ref = runner.invoke(
        main,
        [
            "generate",
            "tiny-org/tiny-llama",
            "--backend",
            "torch",
            "--prompt-ids",
            "3,4,5",
            "--max-new-tokens",
            "4",
        ],
    )
    assert ort.exit_code == 0 and ref.exit_code == 0
    assert ort.output == ref.output


@pytest.mark.parametrize(
    "model_id, fragment",
    [
        ("tiny-org/absent", "not in the Hugging Face cache"),
        ("tiny-org/tiny-llama@x", "checkpoint directory not found"),
    ],
)
def test_absent_id_is_one_clear_line(cache, model_id, fragment):
    result = CliRunner().invoke(main, ["export", model_id, "-o", "art"])
    assert result.exit_code == 2
    assert result.output.count("\n") == 1 and fragment in result.output, result.output


def test_missing_snapshot_is_named(cache):
    shutil.rmtree(cache)
    with pytest.raises(CheckpointError, match="revision 'main' is not in the Hugging Face cache"):
        resolve_checkpoint("tiny-org/tiny-llama")
