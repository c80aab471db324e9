"""The output directory of an export: checked before any writing, and OS errors while writing
it turned into one ExportError line (exporter/export.py)."""

from __future__ import annotations

import contextlib
import errno
from pathlib import Path

from tqdm import tqdm

from loopcast.errors import ExportError
from loopcast.manifest import MANIFEST_FILE
from loopcast.swap import output_path, recover


def check_output_dir(out: Path) -> None:
    if out.exists() and not out.is_dir():
        raise ExportError(f"{out}: output path exists and is a file")
    for parent in out.parents:
        if parent.exists():
            if not parent.is_dir():
                raise ExportError(f"{out}: {parent} is not a directory")
            break
    if out.is_dir() and any(out.iterdir()) and not (out / MANIFEST_FILE).is_file():
        raise ExportError(f"{out}: output directory is not empty and is not a loopcast artifact")


def prepare_output(out_dir: str | Path, overwrite: bool) -> Path:
    out = output_path(out_dir)
    recover(out)  # a killed earlier export: restore the artifact, remove its leftovers
    check_output_dir(out)
    if (out / MANIFEST_FILE).is_file() and not overwrite:
        raise ExportError(f"{out}: an artifact is already there (pass --overwrite to replace it)")
    return out


@contextlib.contextmanager
def os_errors(out: Path):
    """An OS error while staging or swapping (full disk, permissions, read-only file system, a
    busy mount point) is the environment's, not a bug: one ExportError line naming the file."""
    try:
        yield
        return
    except OSError as exc:
        reason = exc.strerror or str(exc)
        hint = {
            errno.ENOSPC: "; free some space",
            errno.EDQUOT: "; over the disk quota",
            errno.EFBIG: "; over the file-size limit",
            errno.EROFS: "; the file system is read-only",
            errno.EACCES: "; no permission",
            errno.EPERM: "; no permission",
            errno.EBUSY: "; is it a mount point or in use?",
        }.get(exc.errno, "")
        where = f"{exc.filename}: " if exc.filename and Path(exc.filename) != out else ""
        message = f"{out}: cannot write the artifact ({where}{reason}{hint}); nothing was replaced"
    # A progress bar left open by the failed write would redraw itself at exit, after the error
    # line; finish it now so the error stays the last line.
    for bar in list(getattr(tqdm, "_instances", ())):
        bar.close()
    raise ExportError(message)
