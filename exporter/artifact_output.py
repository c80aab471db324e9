"""The output directory of an export: prepared before any writing (recovered, then checked),
and OS errors while writing it turned into one ExportError line (exporter/export.py)."""

from __future__ import annotations

import contextlib
import errno
from pathlib import Path

from loopcast.exporter.output_dir import check_output_dir
from tqdm import tqdm

from loopcast.errors import ExportError
from loopcast.swap import output_path, recover


def prepare_output(out_dir: str | Path, overwrite: bool, flag: str = "--overwrite") -> Path:
    """The resolved output path, once an earlier killed export is recovered and the directory
    may be written (exporter/output_dir.py: never one the export did not write)."""
    out = output_path(out_dir)
    recover(out)  # a killed earlier export: restore the artifact, remove its leftovers
    check_output_dir(out, overwrite, flag)
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
