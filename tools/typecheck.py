"""The type check: mypy over the namespace as it installs (``package-dir`` of pyproject.toml).

mypy resolves ``loopcast.ort_runtime`` by folders, and this repository keeps ``ort_runtime/``,
``graphs/``, … at the top (the design card's layout) and maps them into the namespace at install
time, so this builds that namespace as a tree of symbolic links in a temporary folder and runs
mypy there with the settings of ``[tool.mypy]`` (its ``files`` name the checked modules).
Usage: ``python tools/typecheck.py`` (exit status: mypy's).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def build_namespace(target: Path, package_dir: dict[str, str]) -> None:
    """``target/loopcast/...`` with every mapped folder's files linked at its package path."""
    for package, folder in sorted(package_dir.items(), key=lambda item: item[0].count(".")):
        base = target.joinpath(*package.split("."))
        base.mkdir(parents=True, exist_ok=True)
        for path in (ROOT / folder).rglob("*.py"):
            rel = path.relative_to(ROOT / folder)
            if package == "loopcast" and len(rel.parts) > 1:
                continue  # loopcast/'s own files only; its subpackages come from their folders
            link = base / rel
            link.parent.mkdir(parents=True, exist_ok=True)
            if not link.exists():
                link.symlink_to(path)


def main() -> int:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    package_dir = pyproject["tool"]["setuptools"]["package-dir"]
    files = pyproject["tool"]["mypy"]["files"]
    with tempfile.TemporaryDirectory(prefix="loopcast-typecheck-") as tmp:
        build_namespace(Path(tmp), package_dir)
        modules = []
        for name in files:
            modules += ["-m", name]
        cmd = [sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml"), *modules]
        env = {**os.environ, "MYPYPATH": tmp}
        return subprocess.call(cmd, cwd=tmp, env=env)


if __name__ == "__main__":
    sys.exit(main())
