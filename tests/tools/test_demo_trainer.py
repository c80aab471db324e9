"""tools/demo_model/train_demo_model.py end to end on a tiny synthetic corpus: a smoke run with the
unlikelihood term exports a loadable checkpoint, and the same command resumes instead of
starting over."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch
from loopcast.exporter.checkpoint import load_checkpoint

ROOT = Path(__file__).resolve().parents[2]


def _train(data: Path, run: Path, out: Path, *extra: str) -> str:
    cmd = [
        sys.executable,
        "-m",
        "tools.demo_model.train_demo_model",
        "--smoke",
        "--data",
        str(data),
        "--run-dir",
        str(run),
        "--out",
        str(out),
        "--layers",
        "1",
        "--hidden",
        "64",
        "--intermediate",
        "128",
        *extra,
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def test_smoke_run_with_unlikelihood_exports_and_resumes(tmp_path) -> None:
    rng = np.random.default_rng(0)
    data = tmp_path / "corpus"
    data.mkdir()
    # Short repeating documents: greedy continuations of a barely trained model loop on them,
    # so the unlikelihood term has tokens to penalise.
    np.save(data / "train.npy", np.tile(rng.integers(3, 60, size=40), 200).astype(np.uint16))
    np.save(data / "heldout.npy", rng.integers(3, 60, size=2000).astype(np.uint16))
    run, out = tmp_path / "run", tmp_path / "out"
    first = _train(data, run, out, "--unlikelihood", "1.0", "--ul-every", "1", "--export", "final")
    assert "ul/depth" in first and "exported the final checkpoint" in first
    log = [json.loads(line) for line in (run / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == [10, 20]
    model = load_checkpoint(out, dtype=torch.float32)
    final = torch.load(run / "final.pt", map_location="cpu")
    assert torch.equal(model.lm_head.weight, final["lm_head.weight"].half().float())
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json"):
        assert (out / name).is_file()

    again = _train(data, run, out, "--unlikelihood", "1.0", "--ul-every", "1", "--export", "final")
    assert "resumed at step 20" in again
    assert len((run / "log.jsonl").read_text().splitlines()) == 2  # nothing re-trained
