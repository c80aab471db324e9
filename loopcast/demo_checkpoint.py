"""Where the shipped demo checkpoint lives: a small trained Ouro-architecture model inside the package."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from loopcast.errors import CheckpointError

DEMO_PROMPT = 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n'


def demo_checkpoint_dir() -> Path:
    path = Path(str(resources.files("loopcast") / "demo_model"))
    if not (path / "config.json").is_file() or not (path / "model.safetensors").is_file():
        raise CheckpointError(f"{path}: the demo model is not in this installation")
    return path
