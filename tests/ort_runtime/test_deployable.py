"""docs/architecture.md §5: the runtime needs onnxruntime, numpy and tokenizers only."""

import subprocess
import sys

from tests.artifacts import artifact


def test_runtime_imports_neither_torch_nor_the_exporter() -> None:
    code = (
        "import sys\n"
        "from loopcast.ort_runtime import load\n"
        f"m = load({str(artifact('demo'))!r})\n"
        "r = m.generate('def f(x):', 16, speculative='self', gate='cost', allow_inexact=True)\n"
        "assert len(r.tokens) == 16\n"
        "heavy = ('torch.', 'loopcast.exporter', 'safetensors')\n"
        "bad = sorted(n for n in sys.modules if n == 'torch' or n.startswith(heavy))\n"
        "print('LOADED', bad)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "LOADED []" in proc.stdout, proc.stdout
