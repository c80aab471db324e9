"""Running and inspecting never import torch (docs/architecture.md §5: the runtime is deployable alone; and
importing torch costs seconds). Each command runs in a fresh interpreter that reports whether
``torch`` ended up in ``sys.modules``; torch is installed here, so only laziness keeps it out."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.artifacts import artifact

PROBE = """
import sys
from loopcast.cli import main
try:
    main(sys.argv[1:], prog_name="loopcast")
except SystemExit as exc:
    code = exc.code
else:
    code = 0
print(f"exit={code} torch={'torch' in sys.modules}", file=sys.stderr)
"""


def _cli(*args: str) -> str:
    proc = subprocess.run([sys.executable, "-c", PROBE, *args], capture_output=True, text=True, timeout=120)
    return proc.stderr.strip().splitlines()[-1]


def test_import_ort_runtime_does_not_import_torch() -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys, loopcast.ort_runtime, loopcast.cli; print('torch' in sys.modules)",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.stdout.strip() == "False", proc.stderr


def test_generate_and_inspect_an_artifact_do_not_import_torch() -> None:
    art = str(artifact("ouro-r3", draft_depth=1))
    assert _cli("generate", art, "--prompt-ids", "3,4,5", "--max-new-tokens", "4") == "exit=0 torch=False"
    assert (
        _cli("generate", art, "--prompt-ids", "3,4,5", "--max-new-tokens", "4", "--speculative", "self")
        == "exit=0 torch=False"
    )
    assert _cli("inspect", art) == "exit=0 torch=False"


def test_bench_refusal_does_not_import_torch() -> None:
    from loopcast.devices import cuda_available

    if cuda_available():
        pytest.skip("this install can run CUDA")
    assert _cli("bench", "demo", "--device", "cuda") == "exit=2 torch=False"


def test_inspect_a_checkpoint_does_not_import_torch() -> None:
    assert _cli("inspect", "demo") == "exit=0 torch=False"
