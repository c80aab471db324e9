"""Which output directories an export may replace (docs/trust.md, "Export never deletes what it
did not write").

An export writes into a staging directory and swaps it in (loopcast/swap.py), and the swap
removes what was there. So before anything is written, the output must be new, an empty
directory, or a loopcast artifact that ``--overwrite`` names: a regular ``manifest.json``
that parses as a loopcast manifest (any schema version, so an old artifact can be re-exported
in place) and nothing in the directory that the manifest does not name. Anything else —
somebody's directory that happens to hold a ``manifest.json`` of another program, an artifact
into which the user saved their own notes — is refused with one line naming the directory.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

from loopcast.confined_files import MANIFEST_MAX_BYTES, read_confined_text
from loopcast.errors import ExportError, LoopcastError
from loopcast.manifest import MANIFEST_FILE

# fields every loopcast manifest has had, in every schema version
_SIGNATURE = {"schema_version": int, "exporter_version": str, "model": dict, "graphs": dict}


def check_output_dir(out: Path, overwrite: bool, flag: str) -> None:
    """Raise ExportError unless an export may write ``out`` (``flag``: how the caller spells
    overwrite, ``--overwrite`` or ``overwrite=True``)."""
    if os.path.lexists(out) and not out.is_dir():
        raise ExportError(f"{out}: output path exists and is a file")
    if out.is_symlink():
        raise ExportError(f"{out}: output path is a symlink; name the directory itself")
    for parent in out.parents:
        if parent.exists():
            if not parent.is_dir():
                raise ExportError(f"{out}: {parent} is not a directory")
            break
    if not out.is_dir():
        return
    try:
        entries = sorted(entry.name for entry in out.iterdir())
    except OSError as exc:
        raise ExportError(f"{out}: output directory cannot be listed ({exc.strerror})") from None
    if not entries:
        return
    why = _not_an_artifact(out, entries)
    if why is not None:
        raise ExportError(
            f"{out}: output directory is not empty and is not a loopcast artifact ({why}); "
            "refusing to replace it: choose another directory or empty it first"
        )
    if not overwrite:
        raise ExportError(f"{out}: an artifact is already there (pass {flag} to replace it)")


def _not_an_artifact(out: Path, entries: list[str]) -> str | None:
    """Why ``out`` is not a directory that a loopcast export wrote, or None when it is."""
    if MANIFEST_FILE not in entries:
        return f"no {MANIFEST_FILE}"
    if not stat.S_ISREG(os.lstat(out / MANIFEST_FILE).st_mode):
        return f"its {MANIFEST_FILE} is not a regular file"
    try:
        raw = json.loads(
            read_confined_text(out, MANIFEST_FILE, "manifest", max_bytes=MANIFEST_MAX_BYTES) or ""
        )
    except (LoopcastError, ValueError, RecursionError):
        return f"its {MANIFEST_FILE} is not JSON"
    if not isinstance(raw, dict) or any(not isinstance(raw.get(k), t) for k, t in _SIGNATURE.items()):
        return f"its {MANIFEST_FILE} is not a loopcast manifest"
    named = {MANIFEST_FILE}
    for graph in raw["graphs"].values():
        named.add(graph.get("file") if isinstance(graph, dict) else None)
    named |= {raw.get("weights_file"), raw.get("custom_op_library")}
    for key in ("tokenizer_files", "genai_files", "files"):
        value = raw.get(key)
        named |= {v for v in value if isinstance(v, str)} if isinstance(value, (list, dict)) else set()
    top = {name.split("/")[0] for name in named if isinstance(name, str) and name}
    foreign = [name for name in entries if name not in top]
    if foreign:
        return f"it holds {foreign[0]!r}, which its manifest does not name"
    return None
