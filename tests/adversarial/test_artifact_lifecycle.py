"""Adversarial export and load (docs/trust.md, "Export never deletes what it did not write",
"A loaded model pins its files", "Custom-op attributes"; tests/adversarial/cases.py):

- ``export --overwrite`` onto directories that are not loopcast artifacts: refused with one
  line, every file left as it was (API and CLI);
- an artifact overwritten by another model under a live model: the deferred speculative
  sessions refuse to open the new files (an error, never the other model's tokens);
- graphs whose loopcast ops index KV buffers the manifest does not have: refused at load,
  naming the graph and the attribute (API and CLI);
- the CLI's file and disk errors (build-ops, random-checkpoint) are one ``error:`` line, and a
  damaged cached demo artifact is exported again.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import shutil
import signal
from pathlib import Path

import onnx
import pytest
from click.testing import CliRunner
from loopcast.cli import main
from loopcast.exporter.export import ExportOptions, export_checkpoint
from loopcast.ort_runtime import load

from loopcast.errors import ArtifactError, ExportError
from loopcast.manifest import sampled_sha256, sha256_file
from tests.adversarial.cases import Case, Table, assert_one_error_line, within_deadline
from tests.artifacts import artifact, checkpoint


def _cli(*args: object):
    return CliRunner().invoke(main, [str(a) for a in args])


def _snapshot(path: Path) -> dict[str, bytes | str]:
    """Every entry under ``path``: file bytes, symlink targets, directories."""
    out: dict[str, bytes | str] = {}
    for p in sorted(path.rglob("*")):
        rel = str(p.relative_to(path))
        out[rel] = f"-> {os.readlink(p)}" if p.is_symlink() else "dir" if p.is_dir() else p.read_bytes()
    return out


# ---- export --overwrite onto somebody else's directory ------------------------------------


def _foreign_manifest(d: Path) -> None:
    (d / "manifest.json").write_text(json.dumps({"name": "my-web-app", "version": 3, "files": ["a.js"]}))
    (d / "a.js").write_text("console.log(1)\n")
    (d / "thesis.tex").write_text("\\documentclass{article}\n")


def _artifact_with_user_file(d: Path) -> None:
    shutil.copytree(artifact("ouro-r3", ops="stock"), d, dirs_exist_ok=True)
    (d / "my-notes.txt").write_text("results of Tuesday\n")


def _artifact_with_user_dir(d: Path) -> None:
    shutil.copytree(artifact("ouro-r3", ops="stock"), d, dirs_exist_ok=True)
    (d / "photos").mkdir()
    (d / "photos" / "cat.jpg").write_bytes(b"\xff\xd8\xff")


def _manifest_symlink(d: Path) -> None:
    src = artifact("ouro-r3", ops="stock")
    shutil.copytree(src, d, dirs_exist_ok=True)
    (d / "manifest.json").unlink()
    (d / "manifest.json").symlink_to(src / "manifest.json")


def _not_json(d: Path) -> None:
    (d / "manifest.json").write_text("name = my-app\n")
    (d / "data.csv").write_text("a,b\n1,2\n")


def _no_manifest(d: Path) -> None:
    (d / "report.pdf").write_bytes(b"%PDF-1.4\n")


OVERWRITE = Table(
    Case("overwrite_foreign", name, build, ("api", "cli"), expect)
    for name, build, expect in [
        ("other_programs_manifest", _foreign_manifest, "not a loopcast manifest"),
        ("artifact_with_user_file", _artifact_with_user_file, "'my-notes.txt'"),
        ("artifact_with_user_dir", _artifact_with_user_dir, "'photos'"),
        ("manifest_symlink", _manifest_symlink, "not a regular file"),
        ("manifest_not_json", _not_json, "not JSON"),
        ("no_manifest", _no_manifest, "no manifest.json"),
    ]
)


@OVERWRITE.parametrize("api")
def test_overwrite_refuses_foreign_directory_api(tmp_path, case: Case) -> None:
    out = tmp_path / "theirs"
    out.mkdir()
    case.payload(out)
    before = _snapshot(out)
    with pytest.raises(ExportError, match="refusing to replace it") as info:
        export_checkpoint(checkpoint("ouro-r3"), out, ExportOptions(ops="stock"), overwrite=True)
    assert case.expect in str(info.value) and str(out) in str(info.value)
    assert _snapshot(out) == before


@OVERWRITE.parametrize("cli")
def test_overwrite_refuses_foreign_directory_cli(tmp_path, case: Case) -> None:
    out = tmp_path / "theirs"
    out.mkdir()
    case.payload(out)
    before = _snapshot(out)
    result = _cli("export", checkpoint("ouro-r3"), "-o", out, "--ops", "stock", "--overwrite")
    assert_one_error_line(result.exit_code, result.stdout, result.stderr, str(out), case.expect)
    assert _snapshot(out) == before


def test_overwrite_replaces_own_artifact_and_empty_dir(tmp_path) -> None:
    """The control: what --overwrite is for still works."""
    empty = tmp_path / "empty"
    empty.mkdir()
    export_checkpoint(checkpoint("ouro-r3"), empty, ExportOptions(ops="stock"))
    mine = tmp_path / "mine"
    shutil.copytree(artifact("ouro-r3", ops="stock"), mine)
    export_checkpoint(checkpoint("ouro-r3", seed=1), mine, ExportOptions(ops="stock"), overwrite=True)
    assert (mine / "weights.safetensors").read_bytes() != (empty / "weights.safetensors").read_bytes()
    with pytest.raises(ExportError, match="an artifact is already there"):
        export_checkpoint(checkpoint("ouro-r3"), mine, ExportOptions(ops="stock"))


# ---- an artifact overwritten under a live model -------------------------------------------

LIVE = Table(
    [
        Case("live_model", "other_model_same_shapes", ("ouro-r3", 1), ("api",)),
        Case("live_model", "other_model_other_shapes", ("ouro-r2-gqa", 0), ("api",)),
    ]
)
PROMPT = [5, 6, 7, 8]


@LIVE.parametrize("api")
def test_overwrite_under_a_live_model(tmp_path, case: Case) -> None:
    """Self-speculation's draft and verify_tail sessions are made on first use (CPU, stock
    graphs); after another model was exported over the directory they must refuse to open."""
    art = tmp_path / "art"
    shutil.copytree(artifact("ouro-r3", ops="stock"), art)
    model = load(art)
    assert model.loaded.sessions.pending("draft")  # the case is about deferred sessions
    plain = model.generate(PROMPT, 6).tokens
    name, seed = case.payload
    export_checkpoint(checkpoint(name, seed=seed), art, ExportOptions(ops="stock"), overwrite=True)
    assert model.generate(PROMPT, 6).tokens == plain  # the sessions made at load are its own
    with pytest.raises(ArtifactError, match="changed on disk since this model was loaded"):
        model.generate(PROMPT, 6, speculative="self", allow_inexact=True)


def test_live_model_control_unchanged_files(tmp_path) -> None:
    """The control: the same bytes put back in place (a re-copy) are the loaded model's."""
    art = tmp_path / "art"
    src = artifact("ouro-r3", ops="stock")
    shutil.copytree(src, art)
    model = load(art)
    shutil.rmtree(art)
    shutil.copytree(src, art)
    spec = model.generate(PROMPT, 6, speculative="self", allow_inexact=True).tokens
    assert len(spec) == 6


# ---- custom-op attributes that index missing KV buffers -----------------------------------


def _row_buffers(value):
    def edit(node: onnx.NodeProto) -> None:
        attr = next(a for a in node.attribute if a.name == "row_buffers")
        attr.ints[:] = value(list(attr.ints))

    return edit


def _kv_heads(node: onnx.NodeProto) -> None:
    attr = next(a for a in node.attribute if a.name == "kv_num_heads")
    attr.i += 1


def _drop_row_buffers(node: onnx.NodeProto) -> None:
    keep = [a for a in node.attribute if a.name != "row_buffers"]
    del node.attribute[:]
    node.attribute.extend(keep)


OP_ATTRIBUTES = Table(
    Case("op_attributes", name, edit, ("api", "cli"), expect)
    for name, edit, expect in [
        ("row_buffer_past_the_pairs", _row_buffers(lambda r: [r[0] + 7, *r[1:]]), "row_buffers[0]"),
        ("row_buffer_negative", _row_buffers(lambda r: [*r[:-1], -1]), "names no KV buffer pair"),
        ("row_buffers_missing", _drop_row_buffers, "row_buffers is missing"),
        ("kv_heads_not_the_layout", _kv_heads, "kv_num_heads"),
    ]
)


@pytest.fixture(scope="module")
def loopcast_ops_artifact() -> Path:
    from tests.artifacts import require_exact_cpu_artifacts

    require_exact_cpu_artifacts()  # RowAttention needs the loopcast op library
    return artifact("ouro-r3")


def _edited(src: Path, tmp_path: Path, edit) -> Path:
    """A copy whose cycle graph's RowAttention nodes are edited, with the manifest's records
    updated, so that only the attribute is wrong (sizes and hashes match)."""
    art = tmp_path / "art"
    shutil.copytree(src, art)
    graph = art / "cycle.onnx"
    model = onnx.load(str(graph), load_external_data=False)
    nodes = [n for n in model.graph.node if n.op_type == "RowAttention"]
    assert nodes, "the cycle graph has no RowAttention node"
    for node in nodes:
        edit(node)
    graph.write_bytes(model.SerializeToString())
    raw = json.loads((art / "manifest.json").read_text())
    raw["files"]["cycle.onnx"].update(
        size=graph.stat().st_size, sha256=sha256_file(graph), sampled_sha256=sampled_sha256(graph)
    )
    (art / "manifest.json").write_text(json.dumps(raw))
    return art


def test_op_attributes_control(loopcast_ops_artifact, tmp_path) -> None:
    """An edit that keeps the attributes as they were loads (the records are rewritten right)."""
    art = _edited(loopcast_ops_artifact, tmp_path, _row_buffers(lambda r: r))
    load(art)


@OP_ATTRIBUTES.parametrize("api")
def test_op_attributes_refused_at_load_api(loopcast_ops_artifact, tmp_path, case: Case) -> None:
    art = _edited(loopcast_ops_artifact, tmp_path, case.payload)
    with pytest.raises(ArtifactError) as info:
        load(art)
    assert "cycle.onnx" in str(info.value) and case.expect in str(info.value), str(info.value)


@OP_ATTRIBUTES.parametrize("cli")
def test_op_attributes_refused_at_load_cli(loopcast_ops_artifact, tmp_path, case: Case) -> None:
    art = _edited(loopcast_ops_artifact, tmp_path, case.payload)
    result = _cli("generate", art, "--prompt-ids", "1,2,3", "--max-new-tokens", "2")
    assert_one_error_line(result.exit_code, result.stdout, result.stderr, "cycle.onnx", case.expect)


# ---- the CLI's own files and disks --------------------------------------------------------


def _not_a_dir(tmp: Path) -> list[str]:
    (tmp / "a-file").write_text("x")
    return ["build-ops", "-o", str(tmp / "a-file")]


CLI_ERRORS = Table(
    Case("cli_errors", name, args, ("cli",), expect)
    for name, args, expect in [
        ("build_ops_onto_a_file", _not_a_dir, "not a directory"),
        ("build_ops_under_a_file", lambda t: ["build-ops", "-o", str(_not_a_dir(t)[-1]) + "/x"], "a-file"),
        ("build_ops_into_proc", lambda t: ["build-ops", "-o", "/proc"], "/proc"),
        ("build_ops_under_proc", lambda t: ["build-ops", "-o", "/proc/self/x"], "cannot build"),
        ("seed_over_64_bits", lambda t: ["random-checkpoint", str(t / "c"), "--seed", str(2**64)], "--seed"),
        ("seed_negative", lambda t: ["random-checkpoint", str(t / "c"), "--seed", "-1"], "--seed"),
    ]
)


@CLI_ERRORS.parametrize("cli")
def test_cli_errors_are_one_line(tmp_path, case: Case) -> None:
    result = within_deadline(lambda: _cli(*case.payload(tmp_path)))
    assert_one_error_line(result.exit_code, result.stdout, result.stderr, case.expect)


@contextlib.contextmanager
def _file_size_limit(limit: int):
    """Writes past ``limit`` bytes fail with EFBIG, as ENOSPC would on a full disk (this process,
    for the block; SIGXFSZ ignored, as Python does at start-up)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, previous)


@pytest.mark.parametrize("shard_mb", [None, 1], ids=["one_file", "shards"])
def test_random_checkpoint_past_a_file_size_limit(tmp_path, shard_mb) -> None:
    out = tmp_path / "ckpt"
    extra = ["--max-shard-mb", str(shard_mb)] if shard_mb else []
    with _file_size_limit(16 * 1024):
        result = _cli("random-checkpoint", out, *extra)
    assert_one_error_line(
        result.exit_code, result.stdout, result.stderr, str(out), "cannot write the checkpoint"
    )
    assert not out.exists() and [p.name for p in tmp_path.iterdir()] == []  # no staging left


@pytest.mark.parametrize(
    "damage",
    [
        lambda p: (p / "manifest.json").unlink(),
        lambda p: (p / "manifest.json").write_text("{truncated"),
    ],
    ids=["manifest_deleted", "manifest_corrupt"],
)
def test_damaged_demo_cache_is_exported_again(damage) -> None:
    """``loopcast demo`` on a damaged cache entry re-exports it instead of refusing."""
    from loopcast.exporter.demo_artifact import demo_artifact_dir

    cached = demo_artifact_dir()
    damage(cached)
    result = _cli("demo", "--max-new-tokens", "2", "--repeats", "1", "--speculative", "none")
    assert result.exit_code == 0, result.output
    load(cached)  # whole again
