"""Fuzz over manifest fields and graph swaps: every case either runs correctly (the tokens of the
intact artifact) or ends in exactly one `error:` line with exit status 2 — never a traceback,
never a silently wrong run. One artifact is exported per module and copied per case."""

from __future__ import annotations

import copy
import hashlib
import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner
from loopcast.cli import main
from loopcast.ort_runtime import load

from tests.artifacts import artifact

PROMPT, NEW = [5, 6, 7], 6

_MISSING = object()


def _set(raw: dict, path: str, value) -> None:
    *parents, last = path.split(".")
    node = raw
    for key in parents:
        node = node[key]
    if value is _MISSING:
        node.pop(last, None)
    else:
        node[last] = value


# (id, manifest field path, value): wrong types, out-of-range values, inconsistent values.
FIELD_CASES = [
    ("max_length-str", "max_length", "32"),
    ("max_length-float", "max_length", 32.5),
    ("max_length-neg", "max_length", -1),
    ("max_length-huge", "max_length", 10**12),
    ("max_length-other", "max_length", 16),
    ("max_length-bool", "max_length", True),
    ("rows-str", "graphs.verify.rows", "5"),
    ("rows-other", "graphs.verify.rows", 3),
    ("rows-null", "graphs.decode.rows", None),
    ("rows-float", "graphs.decode.rows", 1.0),
    ("file-int", "graphs.decode.file", 5),
    ("file-null", "graphs.decode.file", None),
    ("file-empty", "graphs.decode.file", ""),
    ("file-abs", "graphs.decode.file", "/etc/passwd"),
    ("file-dotdot", "graphs.decode.file", "../decode.onnx"),
    ("file-other-kind", "graphs.verify.file", "decode.onnx"),
    ("file-draft-is-tail", "graphs.draft.file", "verify_tail.onnx"),
    ("eos-str", "eos_token_ids", "0"),
    ("eos-null-item", "eos_token_ids", [None]),
    ("eos-neg", "eos_token_ids", [-1]),
    ("eos-huge", "eos_token_ids", [10**6]),
    ("eos-int", "eos_token_ids", 0),
    ("slots-unknown", "graphs.decode.kv_slots", [0, 1, 2, 3, 4, 99]),
    ("slots-empty", "graphs.decode.kv_slots", []),
    ("slots-str", "graphs.decode.kv_slots", ["0"]),
    ("slots-dup", "graphs.decode.kv_slots", [0, 0, 1, 2, 3, 4]),
    ("no-decode", "graphs.decode", _MISSING),
    ("no-prefill", "graphs.prefill", _MISSING),
    ("graphs-list", "graphs", []),
    ("graph-str", "graphs.decode", "x"),
    ("unknown-kind", "graphs.tree", {}),
    ("kind-mislabel", "graphs.decode.kind", "verify"),
    ("first-loop", "graphs.verify_tail.first_loop", 0),
    ("last-loop-missing", "graphs.draft.last_loop", _MISSING),
    ("first-loop-str", "graphs.decode.first_loop", "0"),
    ("draft-depth-str", "draft_depth", "1"),
    ("draft-depth-null", "draft_depth", None),
    ("verify-width-null", "verify_width", None),
    ("model-null", "model", None),
    ("graphs-null", "graphs", None),
    ("inputs-dropped", "graphs.decode.inputs", ["input_ids_BS"]),
    ("vocab-other", "model.vocab_size", 50),
    ("vocab-str", "model.vocab_size", "97"),
    ("loops-other", "model.total_ut_steps", 4),
    ("layers-other", "model.num_hidden_layers", 3),
    ("model-type", "model.model_type", "gpt2"),
    ("hidden-other", "model.hidden_size", 65),
    ("heads-other", "model.num_attention_heads", 8),
    ("kv-heads-other", "model.num_key_value_heads", 2),
    ("head-dim-other", "model.head_dim", 32),
    ("eps-other", "model.rms_norm_eps", 1.0),
    ("max-positions-small", "model.max_position_embeddings", 16),
    ("model-list", "model", [1]),
    ("draft-depth-0", "draft_depth", 0),
    ("draft-depth-big", "draft_depth", 5),
    ("verify-width-other", "verify_width", 3),
    ("verify-width-1", "verify_width", 1),
    ("kv-layout-empty", "kv_layout", {}),
    ("kv-shape", "kv_layout.shape", [1, 4, 64, 16]),
    ("kv-slots", "kv_layout.slots", 7),
    ("dtype-fp64", "dtype", "fp64"),
    ("dtype-int", "dtype", 5),
    ("custom-ops-str", "custom_ops", "x"),
    ("custom-ops-int-item", "custom_ops", [1]),
    ("library-int", "custom_op_library", 5),
    ("weights-int", "weights_file", 3),
    ("weights-missing", "weights_file", "nope.safetensors"),
    ("files-size-str", "files.weights.safetensors", {"size": "x", "sha256": "0" * 64}),
    ("files-sha-bad", "files.decode.onnx", {"size": 1, "sha256": "zz"}),
    ("files-hash-unknown", "files.decode.onnx", {"size": 1, "sha256": "0" * 64, "hash": "md5"}),
    ("files-hash-int", "files.decode.onnx", {"size": 1, "sha256": "0" * 64, "hash": 3}),
    ("exact-verify-str", "exact_verify", {"cpu": "yes"}),
    ("tokenizer-files-str", "tokenizer_files", "x"),
    ("schema-str", "schema_version", "1"),
    ("exporter-version-int", "exporter_version", 1),
    ("no-files", "files", _MISSING),  # schema 3+: every field is required
    ("no-op-set", "op_set", _MISSING),
    ("no-exact-verify", "exact_verify", _MISSING),
    ("no-quantization", "quantization", _MISSING),  # schema 4
    ("quantization-str", "quantization", "int4"),
    (
        "quantization-block-48",
        "quantization",
        {
            "method": "rtn",
            "layers": "int4",
            "block_size": 48,
            "symmetric": True,
            "head": "int4",
            "embedding": "float",
            "accuracy_level": 4,
        },
    ),
    # Valid edits: must run, with the tokens the edit implies.
    ("exact-verify-ok", "exact_verify", {"cpu": True}),
    ("eos-other", "eos_token_ids", []),
]

# (id, graph file replaced, replacement source, update the size/hash records too).
SWAP_CASES = [
    ("verify<-decode", "verify.onnx", "decode.onnx", False),
    ("verify<-decode+records", "verify.onnx", "decode.onnx", True),
    ("decode<-prefill+records", "decode.onnx", "prefill.onnx", True),
    ("prefill<-decode+records", "prefill.onnx", "decode.onnx", True),
    ("draft<-decode+records", "draft.onnx", "decode.onnx", True),
    ("tail<-verify+records", "verify_tail.onnx", "verify.onnx", True),
    ("verify<-other-max-length+records", "verify.onnx", "other:verify.onnx", True),
    ("decode<-other-max-length+records", "decode.onnx", "other:decode.onnx", True),
    ("decode<-garbage+records", "decode.onnx", "garbage", True),
    ("weights<-zeros", "weights.safetensors", "zeros", False),  # same size, header intact
    ("decode<-garbage", "decode.onnx", "garbage", False),
    ("verify<-decode-same-size", "verify.onnx", "decode.onnx", False),
]


@pytest.fixture(scope="module")
def base() -> tuple[Path, Path, list[int]]:
    path = artifact("ouro-r3", draft_depth=1, max_length=32)
    other = artifact("ouro-r3", draft_depth=1, max_length=64)
    full = load(path).generate(PROMPT, NEW, stop_ids=()).tokens  # no stop ids: every token
    return path, other, full


def _expected(full: list[int], eos: list[int]) -> list[int]:
    for i, t in enumerate(full):
        if t in eos:
            return full[: i + 1]
    return full


def _run(path: Path, full: list[int]) -> None:
    result = CliRunner().invoke(
        main,
        [
            "generate",
            str(path),
            "--prompt-ids",
            " ".join(map(str, PROMPT)),
            "--max-new-tokens",
            str(NEW),
            "--json",
        ],
    )
    assert result.exception is None or isinstance(result.exception, SystemExit), (
        f"traceback: {result.exception!r}"
    )
    if result.exit_code == 0:
        raw = json.loads((path / "manifest.json").read_text())
        tokens = json.loads(result.stdout)["tokens"]
        assert tokens == _expected(full, raw["eos_token_ids"]), "a silently wrong run"
        return
    assert result.exit_code == 2, result.output
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and result.stdout == "", result.stderr


def _copy(src: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "art"
    shutil.copytree(src, dst)
    return dst


@pytest.mark.parametrize("case", FIELD_CASES, ids=[c[0] for c in FIELD_CASES])
def test_manifest_field(base, tmp_path, case) -> None:
    path = _copy(base[0], tmp_path)
    raw = json.loads((path / "manifest.json").read_text())
    _, field, value = case
    if field.startswith("files."):
        raw["files"][field.split(".", 1)[1]] = value
    else:
        _set(raw, field, value if value is _MISSING else copy.deepcopy(value))
    (path / "manifest.json").write_text(json.dumps(raw))
    _run(path, base[2])


@pytest.mark.parametrize("case", SWAP_CASES, ids=[c[0] for c in SWAP_CASES])
def test_graph_swap(base, tmp_path, case) -> None:
    path = _copy(base[0], tmp_path)
    _, target, source, records = case
    size = (path / target).stat().st_size
    if source == "garbage":
        data = (bytes(range(256)) * (size // 256 + 1))[:size]
    elif source == "zeros":
        old = (path / target).read_bytes()
        keep = 8 + int.from_bytes(old[:8], "little")  # the safetensors header
        data = old[:keep] + bytes(size - keep)
    else:
        data = ((base[1] / source[6:]) if source.startswith("other:") else (path / source)).read_bytes()
    (path / target).write_bytes(data)
    if records:
        raw = json.loads((path / "manifest.json").read_text())
        raw["files"][target] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
        (path / "manifest.json").write_text(json.dumps(raw))
    _run(path, base[2])


@pytest.mark.parametrize("text", ["[]", "null", "{}", '{"schema_version": 1}', "{", "\x00\xff", "1e999"])
def test_manifest_text(base, tmp_path, text) -> None:
    path = _copy(base[0], tmp_path)
    (path / "manifest.json").write_bytes(text.encode("latin-1"))
    _run(path, base[2])


def _leaves(node, prefix=()):
    if isinstance(node, dict):
        for key, value in node.items():
            yield from _leaves(value, (*prefix, key))
    elif isinstance(node, list) and node:
        for i, value in enumerate(node):
            yield from _leaves(value, (*prefix, i))
    else:
        yield prefix


RANDOM_VALUES = [None, "x", "", -1, 0, 1, 2, 3, 64, 2**40, 1.5, True, [], {}, [1], "../x", "/etc/passwd"]


@pytest.mark.parametrize("seed", range(40))
def test_random_leaf(base, tmp_path, seed) -> None:
    """One leaf anywhere in the manifest replaced by one value from a pool of troublemakers."""
    import random

    rng = random.Random(seed)
    path = _copy(base[0], tmp_path)
    raw = json.loads((path / "manifest.json").read_text())
    # Group leaves by their first two keys (graphs.decode, model.vocab_size, ...) so the long
    # IO-name lists do not crowd out the scalar fields.
    groups: dict[tuple, list] = {}
    for leaf in _leaves(raw):
        groups.setdefault(leaf[:2], []).append(leaf)
    where = rng.choice(groups[rng.choice(sorted(groups, key=repr))])
    node = raw
    for key in where[:-1]:
        node = node[key]
    node[where[-1]] = rng.choice(RANDOM_VALUES)
    (path / "manifest.json").write_text(json.dumps(raw))
    _run(path, base[2])
