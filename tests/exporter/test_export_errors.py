"""Export refuses what it cannot honour, with a clear error and nothing written."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from loopcast.exporter.export import ExportOptions, export_checkpoint

from loopcast.errors import ConfigError, ExportError, LoopcastError
from tests.artifacts import checkpoint


def _edited_checkpoint(tmp_path: Path, **changes) -> Path:
    src = checkpoint("ouro-r3")
    dst = tmp_path / "ckpt"
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    raw = json.loads((dst / "config.json").read_text())
    raw.update(changes)
    (dst / "config.json").write_text(json.dumps(raw))
    return dst


@pytest.mark.parametrize(
    "changes,match",
    [
        ({"use_sliding_window": True, "sliding_window": 16}, "sliding-window"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}}, "rope type 'longrope'"),
        ({"model_type": "gpt2"}, "model_type"),
        ({"model_type": "mistral"}, "is not understood for model_type 'mistral'"),
    ],
)
def test_unsupported_configs(tmp_path: Path, changes, match) -> None:
    ckpt = _edited_checkpoint(tmp_path, **changes)
    with pytest.raises(ConfigError, match=match):
        export_checkpoint(ckpt, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_head_dim_not_multiple_of_16(tmp_path: Path) -> None:
    ckpt = _edited_checkpoint(tmp_path)
    raw = json.loads((ckpt / "config.json").read_text())
    assert raw["head_dim"] == 16


def test_batch_invariant_refuses_biases(tmp_path: Path, make_checkpoint) -> None:
    from loopcast.presets import PRESETS

    with pytest.raises(ExportError, match="--batch-invariant .* biases"):
        export_checkpoint(
            make_checkpoint(PRESETS["tiny-qwen2"]), tmp_path / "out", ExportOptions(batch_invariant=True)
        )
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "options,match",
    [
        (ExportOptions(verify_width=1), "verify-width"),
        (ExportOptions(verify_width=33), "verify-width"),
        (ExportOptions(draft_depth=3), "draft-depth"),
        (ExportOptions(draft_depth=0), "draft-depth"),
        (ExportOptions(max_length=100_000), "max-length"),
        (ExportOptions(dtype="int8"), "dtype"),
    ],
)
def test_bad_options(tmp_path: Path, options, match) -> None:
    with pytest.raises(ExportError, match=match):
        export_checkpoint(checkpoint("ouro-r3"), tmp_path / "out", options)
    assert not (tmp_path / "out").exists()
    assert list(tmp_path.iterdir()) == []


def test_draft_depth_on_llama_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ExportError, match="R=1"):
        export_checkpoint(checkpoint("llama-tied-gqa"), tmp_path / "out", ExportOptions(draft_depth=1))


def test_output_is_a_file_or_unrelated_directory(tmp_path: Path) -> None:
    target = tmp_path / "file"
    target.write_text("x")
    with pytest.raises(ExportError, match="is a file"):
        export_checkpoint(checkpoint("ouro-r3"), target)
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "notes.txt").write_text("keep me")
    with pytest.raises(ExportError, match="not empty"):
        export_checkpoint(checkpoint("ouro-r3"), busy)
    assert [p.name for p in busy.iterdir()] == ["notes.txt"]


def test_failed_export_leaves_nothing(tmp_path: Path) -> None:
    """A checkpoint whose tensor is truncated fails mid-export; no artifact appears."""
    ckpt = _edited_checkpoint(tmp_path)
    weights = ckpt / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-64])
    with pytest.raises(Exception):  # noqa: B017  (any failure: the test is about what is left behind)
        export_checkpoint(ckpt, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]


def test_cli_export_error_is_one_line(tmp_path: Path) -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "loopcast.cli",
            "export",
            str(checkpoint("ouro-r3")),
            "-o",
            str(tmp_path / "out"),
            "--verify-width",
            "1",
        ],
        capture_output=True,
        text=True,
    )
    assert proc.returncode != 0
    assert proc.stderr.strip().count("\n") == 0 and proc.stderr.startswith("error:"), proc.stderr
    assert "verify-width" in proc.stderr


def test_cli_export_and_inspect(tmp_path: Path) -> None:
    out = tmp_path / "art"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "loopcast.cli",
            "export",
            str(checkpoint("ouro-r3")),
            "-o",
            str(out),
            "--verify-width",
            "4",
            "--draft-depth",
            "2",
        ],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["verify_width"] == 4 and manifest["draft_depth"] == 2
    pipeline = (
        {"cycle", "cycle_run"} if manifest["op_set"] != "stock" else set()
    )  # stock ops: no row-addressed attention
    depths = {f"{kind}@{k}" for k in manifest["exit_depths"] for kind in ("prefill", "decode", "verify")}
    assert manifest["exit_depths"] == list(range(1, manifest["model"]["total_ut_steps"]))
    assert (
        set(manifest["graphs"])
        == {
            "prefill",
            "decode",
            "verify",
            "draft",
            "verify_tail",
            "exits",
            "loop_embed",
            "loop_step",
            "exit_head",
        }
        | pipeline
        | depths
    )
    proc = subprocess.run(
        [sys.executable, "-m", "loopcast.cli", "inspect", str(out)], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
    for word in ("verify_tail", "rows 4", "loops 2..2", "fp32", "past_key"):
        assert word in proc.stdout
    assert issubclass(ExportError, LoopcastError)


def test_output_under_a_file_is_refused(tmp_path: Path) -> None:
    blocker = tmp_path / "f"
    blocker.write_text("x")
    with pytest.raises(ExportError, match="not a directory"):
        export_checkpoint(checkpoint("ouro-r3"), blocker / "art")


def test_max_length_zero_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ExportError, match="max-length 0"):
        export_checkpoint(checkpoint("ouro-r3"), tmp_path / "out", ExportOptions(max_length=0))


def test_overwrite_replaces_an_artifact_atomically(tmp_path: Path) -> None:
    out = tmp_path / "art"
    export_checkpoint(checkpoint("ouro-r3"), out, ExportOptions(verify_width=3))
    with pytest.raises(ExportError, match="--overwrite"):
        export_checkpoint(checkpoint("ouro-r3"), out, ExportOptions(verify_width=4))
    export_checkpoint(checkpoint("ouro-r3"), out, ExportOptions(verify_width=4), overwrite=True)
    assert json.loads((out / "manifest.json").read_text())["verify_width"] == 4
    assert [p.name for p in tmp_path.iterdir()] == ["art"]  # no staging or backup left behind


def test_with_verify_width_shares_weights_and_matches(tmp_path) -> None:
    """Graphs re-emitted at another verify width read the same weights file (hard link) and
    give the same verify rows as a fresh export at that width."""
    import numpy as np
    from loopcast.exporter.export import with_verify_width
    from loopcast.ort_runtime import load

    from loopcast.manifest import VERIFY
    from tests.artifacts import artifact

    src = artifact("ouro-r3", draft_depth=1)
    derived = with_verify_width(src, tmp_path / "w3", 3)
    assert derived.verify_width == 3 and derived.graphs[VERIFY].rows == 3
    assert (tmp_path / "w3" / "weights.safetensors").stat().st_ino == (
        src / "weights.safetensors"
    ).stat().st_ino
    fresh = load(artifact("ouro-r3", verify_width=3, draft_depth=1))
    model = load(tmp_path / "w3")
    ids = [5, 9, 2, 7]
    a, b = model.new_generator(), fresh.new_generator()
    a.prefill(ids)
    b.prefill(ids)
    assert np.array_equal(
        a.run(VERIFY, 4, tokens=[1, 2, 3]).logits, b.run(VERIFY, 4, tokens=[1, 2, 3]).logits
    )
    with pytest.raises(ExportError, match="verify width"):
        with_verify_width(src, tmp_path / "bad", 1)
    assert not (tmp_path / "bad").exists()
    with pytest.raises(ExportError, match="differ from the source"):
        with_verify_width(src, src, 3)
    assert (src / "weights.safetensors").is_file()
    with pytest.raises(ExportError, match="already there"):
        with_verify_width(src, tmp_path / "w3", 4)
    assert with_verify_width(src, tmp_path / "w3", 4, overwrite=True).verify_width == 4
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no staging left behind


def test_with_verify_width_keeps_the_custom_op_library(tmp_path) -> None:
    from loopcast.custom_ops.build import find_ort_include
    from loopcast.exporter.export import with_verify_width

    from loopcast.manifest import Manifest
    from tests.artifacts import artifact

    if find_ort_include() is None:
        pytest.skip("ORT C++ headers missing (tools/c_generate/fetch_deps.sh)")
    src = artifact("ouro-r3", draft_depth=1, batch_invariant=True)
    derived = with_verify_width(src, tmp_path / "w2", 2)
    assert derived.custom_ops == Manifest.read(src).custom_ops
    assert (tmp_path / "w2" / derived.custom_op_library).is_file()
    assert b"BatchInvariantAttention" in (tmp_path / "w2" / "verify.onnx").read_bytes()
