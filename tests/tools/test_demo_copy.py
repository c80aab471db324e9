"""tools/demo_model/demo_copy.py: the edit-shaped rows of the demo model's copy fine-tune are a block of
whole lines and its copy with at most two edits, tokenized as text, and the trainer mixes them
into its batches with --copy-frac."""

from __future__ import annotations

import difflib
import inspect
import subprocess
import sys
from pathlib import Path

import loopcast.ort_runtime.decoding.proposers as code_source  # (any real Python file will do)
import numpy as np
import pytest

from tools.demo_model.demo_copy import _edit, copy_rows, edit_pair, edit_pair_text
from tools.demo_model.pack_demo_corpus import load_tokenizer

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def corpus():
    tokenizer = load_tokenizer(ROOT / "loopcast" / "demo_model" / "tokenizer.json")
    ids = tokenizer.encode(inspect.getsource(code_source)).ids
    return np.asarray(ids * 4, dtype=np.uint16), tokenizer


def test_edit_pairs_are_a_block_and_a_lightly_edited_copy(corpus) -> None:
    train, tokenizer = corpus
    rng = np.random.default_rng(0)
    exact = 0
    for _ in range(40):
        block, copy, blank = edit_pair(train, tokenizer, rng)
        assert 4 <= len(block) <= 40 and 1 <= blank <= 3
        if copy == block:
            exact += 1
            continue
        same = sum(
            m.size for m in difflib.SequenceMatcher(a=block, b=copy, autojunk=False).get_matching_blocks()
        )
        # at most two line edits, or a rename that touches every line holding the identifier
        assert same >= len(block) - 2 or len(copy) == len(block)
    assert 8 <= exact <= 32  # 40 % of pairs are exact copies


def test_edits_keep_indentation_and_touch_at_most_two_lines() -> None:
    block = ["def area(width, height):", "    size = width * height", "    return size"]
    donor = ["x = compute(y)", "    total += 1"]
    for seed in range(50):
        out = _edit(block, donor, np.random.default_rng(seed))
        assert 1 <= len(out) <= len(block) + 2
        indents = {line[: len(line) - len(line.lstrip())] for line in block}
        for line in out:  # a donor line takes the indentation of the block line it replaces
            assert line[: len(line) - len(line.lstrip())] in indents


def test_copy_rows_are_the_tokenizers_own_ids(corpus) -> None:
    train, tokenizer = corpus
    rows = copy_rows(train, tokenizer, np.random.default_rng(1), count=3, length=300)
    assert rows.shape == (3, 300) and rows.dtype == np.int64
    rng = np.random.default_rng(1)  # the same draws: each row is its pairs' text, tokenized
    shared = 0
    for row in rows:
        ids: list[int] = []
        while len(ids) < 300:
            ids += tokenizer.encode(edit_pair_text(train, tokenizer, rng) + "\n\n").ids
        assert row.tolist() == ids[:300]
        lines = [line for line in tokenizer.decode(row.tolist()).split("\n") if line.strip()]
        shared += len(set(lines)) < len(lines)
    # a block and its copy share lines (a rename may touch every line of one pair, so per run)
    assert shared >= 1


def _train(data: Path, tmp: Path, *extra: str) -> subprocess.CompletedProcess:
    cmd = [
        sys.executable,
        "-m",
        "tools.demo_model.train_demo_model",
        "--smoke",
        "--data",
        str(data),
        "--run-dir",
        str(tmp / "run"),
        "--layers",
        "1",
        "--hidden",
        "64",
        "--intermediate",
        "128",
        *extra,
    ]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)


def test_trainer_mixes_copy_rows_and_refuses_a_bad_fraction(corpus, tmp_path) -> None:
    train, _ = corpus
    data = tmp_path / "corpus"
    data.mkdir()
    np.save(data / "train.npy", train)
    np.save(data / "heldout.npy", train[:2000])
    done = _train(data, tmp_path, "--copy-frac", "0.5")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "eval step 20" in done.stdout
    bad = _train(data, tmp_path / "bad", "--copy-frac", "1.5")
    assert bad.returncode != 0 and "--copy-frac must be in [0, 1], got 1.5" in bad.stderr


def test_statement_heads_are_def_and_class_lines(corpus) -> None:
    from tools.demo_model.demo_unlikelihood import statement_heads

    train, tokenizer = corpus
    heads = statement_heads(train, tokenizer)
    assert len(heads) > 10
    for at in heads:
        before = tokenizer.decode(train[max(0, at - 8) : at].tolist())
        line = tokenizer.decode(train[at : at + 6].tolist())
        assert before.endswith("\n") or before.rsplit("\n", 1)[-1].strip(" ") == ""  # a line start
        assert line.lstrip(" ").startswith(("def ", "class "))
    source = tokenizer.decode(train.tolist())
    lines = source.split("\n")
    assert len(heads) == sum(line.lstrip(" ").startswith(("def ", "class ")) for line in lines)
