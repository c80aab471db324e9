"""The layer check: every import between loopcast's packages goes down the layers of pyproject.toml.

import-linter cannot see this layout (its graph builder walks the folder of ``loopcast`` only, and
``exporter/``, ``graphs/``, … are mapped into the namespace by ``package-dir``), so this reads the
same kind of contract from ``[tool.loopcast.layers]`` and checks it with ``ast``: every ``import``
and ``from … import`` anywhere in a module (function-level imports included) counts as an edge.

- ``layers``: top to bottom; a module may import its own layer's module and any layer below.
  Within one entry, ``a | b`` are independent siblings (neither imports the other) and ``a : b``
  may import each other.
- ``containers``: the same rule inside one package (its subpackages as layers).
- ``forbidden``: modules a package must never import (external ones included).

Exit status 1 and one line per broken edge; 0 prints the number of edges checked.
"""

from __future__ import annotations

import ast
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Edge:
    importer: str
    imported: str
    file: Path
    line: int


def module_files(package_dir: dict[str, str]) -> dict[str, Path]:
    """Module name -> file, over the folders that ``package-dir`` maps into the namespace."""
    modules: dict[str, Path] = {}
    for package, folder in package_dir.items():
        base = ROOT / folder
        for path in sorted(base.rglob("*.py")):
            rel = path.relative_to(base).with_suffix("").parts
            if any(part in package_dir.values() for part in rel[:1]) and package == "loopcast":
                continue
            parts = rel[:-1] if rel[-1] == "__init__" else rel
            name = ".".join((package, *parts))
            modules.setdefault(name, path)
    return modules


def imports_of(name: str, path: Path) -> list[tuple[str, int]]:
    tree = ast.parse(path.read_text(), filename=str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: list[tuple[str, int]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            found.append((target, node.lineno))
            # `from pkg import submodule` is an edge to the submodule
            found += [(f"{target}.{alias.name}", node.lineno) for alias in node.names]
    return found


def owner(module: str, layers: list[list[str]]) -> tuple[int, str] | None:
    """(layer index, the layer entry's module) that ``module`` belongs to."""
    best: tuple[int, str] | None = None
    for index, entry in enumerate(layers):
        for member in entry:
            if module == member or module.startswith(member + "."):
                if best is None or len(member) > len(best[1]):
                    best = (index, member)
    return best


def parse_layers(spec: list[str], prefix: str = "") -> tuple[list[list[str]], set[frozenset[str]]]:
    layers, independent = [], set()
    for entry in spec:
        if "|" in entry:
            members = [prefix + m.strip() for m in entry.split("|")]
            independent |= {frozenset((a, b)) for a in members for b in members if a != b}
        else:
            members = [prefix + m.strip() for m in entry.split(":")]
        layers.append(members)
    return layers, independent


def check(layers_spec: list[str], modules: dict[str, Path], edges: list[Edge], prefix: str = "") -> list[str]:
    layers, independent = parse_layers(layers_spec, prefix)
    errors = []
    for edge in edges:
        src, dst = owner(edge.importer, layers), owner(edge.imported, layers)
        if src is None or dst is None or src[1] == dst[1]:
            continue
        if dst[0] < src[0] or frozenset((src[1], dst[1])) in independent:
            errors.append(
                f"{edge.file.relative_to(ROOT)}:{edge.line}: {edge.importer} imports {edge.imported} "
                f"({src[1]} may not import {dst[1]})"
            )
    return errors


def main() -> int:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    package_dir = pyproject["tool"]["setuptools"]["package-dir"]
    contract = pyproject["tool"]["loopcast"]["layers"]
    modules = module_files(package_dir)
    edges = [
        Edge(name, target, path, line)
        for name, path in modules.items()
        for target, line in imports_of(name, path)
    ]
    internal = [edge for edge in edges if edge.imported in modules]
    errors = check(contract["layers"], modules, internal)
    for container, spec in contract.get("containers", {}).items():
        errors += check(spec, modules, internal, prefix=container + ".")
    for source, banned in contract.get("forbidden", {}).items():
        for edge in edges:
            if edge.importer == source or edge.importer.startswith(source + "."):
                hit = [b for b in banned if edge.imported == b or edge.imported.startswith(b + ".")]
                if hit:
                    errors.append(
                        f"{edge.file.relative_to(ROOT)}:{edge.line}: {edge.importer} imports "
                        f"{edge.imported} ({source} must not import {hit[0]})"
                    )
    for line in sorted(set(errors)):
        print(line)
    if not errors:
        print(f"layers ok: {len(internal)} imports between {len(modules)} modules")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
