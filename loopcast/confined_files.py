"""Reading the files an artifact names without leaving it, blocking or reading without bound
(docs/trust.md, "Paths" and "Files").

Every file the runtime opens from an artifact — ``manifest.json``, the graphs, the weights, the
op library, the tokenizer files, the chat template, ``generation_config.json`` — goes through
here, so one rule holds for all of them:

- the name is a relative path inside the artifact, and its resolved path (symlinks followed, at
  any level) lies inside the resolved artifact directory: a symlink that leaves is refused;
- the file is a regular file: a FIFO, device, socket or directory is refused from ``stat``,
  which never blocks, before anything opens it;
- it is opened with ``O_NONBLOCK | O_NOFOLLOW`` on the checked path and checked again on the
  open descriptor (``fstat``), so a FIFO or symlink swapped in after the check neither blocks
  nor redirects the read;
- its size is bounded before it is read (a cap per kind of file below, or the size the manifest
  records) and the read stops at the bound even if the file grows meanwhile.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path, PurePosixPath
from typing import Any, BinaryIO

from loopcast.errors import ArtifactError

MANIFEST_FILE = "manifest.json"

# Caps on what is read from an artifact. Real files are far below them (a manifest of every
# graph kind: ~30 KB; Llama 3's tokenizer.json 9 MB, Gemma 3's 33 MB; chat templates a few KB).
MANIFEST_MAX_BYTES = 16 << 20
JSON_CONFIG_MAX_BYTES = 16 << 20  # tokenizer_config.json, special_tokens_map.json, generation_config.json
TEMPLATE_MAX_BYTES = 1 << 20  # chat_template.jinja
TOKENIZER_MAX_BYTES = 256 << 20  # tokenizer.json
GRAPH_MAX_BYTES = 2 << 30  # an ONNX graph without a recorded size (protobuf's own limit)

_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


def _not_regular(mode: int) -> str:
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def resolve_inside(artifact_dir: Path, name: object, what: str) -> Path:
    """The path of ``name`` inside the artifact, refusing anything that could leave it: a
    non-string, an absolute path, ``..``, or a symlink (at any level) resolving outside."""
    manifest = Path(artifact_dir) / MANIFEST_FILE
    if not isinstance(name, str) or not name or "\0" in name or "\\" in name:
        raise ArtifactError(f"{manifest}: {what} must be a file name inside the artifact, got {name!r}")
    rel = PurePosixPath(name)
    if rel.is_absolute() or ".." in rel.parts or any(p in ("", ".") for p in name.split("/")):
        raise ArtifactError(
            f"{manifest}: {what} {name!r} must be a relative path inside the artifact "
            "(no absolute paths, no '..')"
        )
    try:
        root = Path(artifact_dir).resolve()
        target = (root / rel).resolve()
    except (OSError, RuntimeError) as exc:  # a symlink loop (RuntimeError before Python 3.13)
        raise ArtifactError(f"{Path(artifact_dir) / name}: {what} cannot be resolved ({exc})") from None
    if not target.is_relative_to(root):
        raise ArtifactError(
            f"{Path(artifact_dir) / name}: {what} resolves outside the artifact directory "
            f"(to {target}); refusing it"
        )
    return Path(artifact_dir) / rel


def confined_file(
    artifact_dir: Path, name: object, what: str, *, max_bytes: int | None = None, required: bool = True
) -> Path | None:
    """The path of the regular file ``name`` inside the artifact, checked without opening it
    (``stat`` does not block on a FIFO). None when it does not exist and is not ``required``;
    a symlink leaving the artifact is refused even then."""
    target = resolve_inside(artifact_dir, name, what)
    try:
        st = os.stat(target)
    except FileNotFoundError:
        if not required:
            return None
        raise ArtifactError(f"{target}: {what} is missing") from None
    except OSError as exc:
        raise ArtifactError(f"{target}: {what} is unreadable ({exc.strerror})") from None
    if not stat.S_ISREG(st.st_mode):
        kind = _not_regular(st.st_mode)
        raise ArtifactError(f"{target}: {what} is {kind}, not a regular file; refusing it")
    if max_bytes is not None and st.st_size > max_bytes:
        raise ArtifactError(_too_big(target, what, st.st_size, max_bytes))
    return target


def _too_big(path: Path, what: str, size: int, cap: int) -> str:
    return f"{path}: {what} has {size} bytes, more than the {cap} loopcast reads for it; refusing it"


def open_regular(path: Path, what: str = "file") -> BinaryIO:
    """``path`` opened for reading only if it is a regular file: ``O_NONBLOCK`` so that opening
    a FIFO cannot block, then ``fstat`` on the descriptor (what was opened is what is checked)."""
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        raise ArtifactError(f"{path}: {what} is unreadable ({exc.strerror})") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise ArtifactError(f"{path}: {what} is {_not_regular(mode)}, not a regular file; refusing it")
    return os.fdopen(fd, "rb")


def read_confined(
    artifact_dir: Path, name: str, what: str, *, max_bytes: int, required: bool = True
) -> bytes | None:
    """The bytes of the artifact's file ``name`` (the rule in the module docstring), at most
    ``max_bytes`` of them. None when it is absent and not ``required``."""
    target = confined_file(artifact_dir, name, what, max_bytes=max_bytes, required=required)
    if target is None:
        return None
    real = target.resolve()  # no symlink left: O_NOFOLLOW refuses one swapped in since
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(real, flags)
    except OSError as exc:
        raise ArtifactError(f"{target}: {what} is unreadable ({exc.strerror})") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ArtifactError(f"{target}: {what} is {_not_regular(st.st_mode)}, not a regular file")
        data = f.read(max_bytes + 1)  # bounded even when the file grows after the stat
    if len(data) > max_bytes:
        raise ArtifactError(_too_big(target, what, len(data), max_bytes))
    return data


def read_confined_text(
    artifact_dir: Path, name: str, what: str, *, max_bytes: int, required: bool = True
) -> str | None:
    data = read_confined(artifact_dir, name, what, max_bytes=max_bytes, required=required)
    if data is None:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        why = f"{what} is not UTF-8 text: {exc}"
        raise ArtifactError(f"{Path(artifact_dir) / name}: unreadable ({why})") from None


def read_confined_json(
    artifact_dir: Path, name: str, what: str, *, max_bytes: int = JSON_CONFIG_MAX_BYTES, required: bool = True
) -> Any:
    """The parsed JSON of the artifact's file ``name`` (None when absent and not ``required``)."""
    text = read_confined_text(artifact_dir, name, what, max_bytes=max_bytes, required=required)
    if text is None:
        return None
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as exc:
        why = f"{what} is not valid JSON: {exc}"
        raise ArtifactError(f"{Path(artifact_dir) / name}: unreadable ({why})") from None
