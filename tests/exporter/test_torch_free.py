"""Export, generate and inspect need no torch (it is the ``[torch]`` extra): run the CLI in a
subprocess where ``import torch`` fails, and check the result against the torch reference."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch
from loopcast.exporter.checkpoint import load_checkpoint
from loopcast.exporter.reference_generate import greedy_generate

from loopcast.presets import PRESETS

REPO = Path(__file__).resolve().parents[2]


def run_without_torch(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    shim = tmp_path / "no-torch"
    shim.mkdir(exist_ok=True)
    # sys.modules[name] = None makes every `import torch` raise ImportError.
    (shim / "sitecustomize.py").write_text("import sys\nsys.modules['torch'] = None\n")
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(shim), str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    return subprocess.run(
        [sys.executable, "-c", "from loopcast.cli import main; main()", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_export_generate_inspect_without_torch(make_checkpoint, tmp_path):
    config = PRESETS["tiny-qwen2"]
    checkpoint = make_checkpoint(config)
    art = tmp_path / "art"
    done = run_without_torch(tmp_path, "export", str(checkpoint), "-o", str(art), "--max-length", "32")
    assert done.returncode == 0, done.stderr
    prompt = [5, 9, 17, 4]
    done = run_without_torch(
        tmp_path, "generate", str(art), "--prompt-ids", ",".join(map(str, prompt)), "--max-new-tokens", "8"
    )
    assert done.returncode == 0, done.stderr
    reference = load_checkpoint(checkpoint, dtype=torch.float32)
    expected = greedy_generate(reference, prompt, 8, stop_ids=config.eos_token_ids).tokens
    assert done.stdout.strip() == ",".join(map(str, expected))
    for target in (checkpoint, art):
        done = run_without_torch(tmp_path, "inspect", str(target))
        assert done.returncode == 0, done.stderr
        assert "qwen2" in done.stdout


def test_torch_commands_name_the_extra(tmp_path, make_checkpoint):
    checkpoint = make_checkpoint(PRESETS["tiny-llama"])
    for args in (
        ["generate", str(checkpoint), "--backend", "torch", "--prompt-ids", "1,2"],
        ["random-checkpoint", str(tmp_path / "ckpt")],
    ):
        done = run_without_torch(tmp_path, *args)
        assert done.returncode == 2
        assert done.stderr.count("\n") == 1 and "[torch]" in done.stderr, done.stderr
