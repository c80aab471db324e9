"""Which native op libraries the user trusts (docs/trust.md).

Loading a shared library runs its constructors, so an artifact's ``custom_op_library`` is
code from whoever made the artifact. The runtime loads it only when the graphs need it and the
user trusts it: explicitly (``trust_ops=True`` / ``--trust-ops``) or because its SHA-256 equals
that of a library this user built locally (``loopcast build-ops``, or the build an export
triggers). Every local build records its hash here, one hex digest per line, in the loopcast
cache (``$LOOPCAST_CACHE``, default ``~/.cache/loopcast``); the file is the user's own, never
the artifact's, so an artifact cannot vouch for itself.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

REGISTRY_FILE = "trusted-ops.sha256"
_LINE = re.compile(r"([0-9a-f]{64})\b")


def cache_root() -> Path:
    return Path(os.environ.get("LOOPCAST_CACHE", Path.home() / ".cache" / "loopcast"))


def registry_path() -> Path:
    return cache_root() / REGISTRY_FILE


def locally_built_hashes() -> frozenset[str]:
    try:
        text = registry_path().read_text()
    except (OSError, UnicodeDecodeError):
        return frozenset()
    return frozenset(m.group(1) for line in text.splitlines() if (m := _LINE.match(line)))


def record_local_build(library: str | os.PathLike) -> str:
    """Remember a library this user built (its hash), so artifacts carrying it load without
    ``--trust-ops``. Idempotent; one short appended line, so concurrent builds do not clash."""
    from loopcast.manifest import sha256_file

    digest = sha256_file(Path(library))
    if digest not in locally_built_hashes():
        path = registry_path()
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path, "a") as f:
                f.write(f"{digest}  {Path(library).resolve()}\n")
        except OSError:
            pass  # an unwritable cache: the build still works, its artifacts then need --trust-ops
    return digest
