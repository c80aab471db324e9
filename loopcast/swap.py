"""Crash-safe replacement of an artifact directory (export, ``with_verify_width``). Torch-free:
the runtime uses ``recover`` too.

An artifact is assembled in a staging directory beside the destination, ``.NAME.staging.XXXX``,
and swapped into place only when complete:

- where Linux offers it, the swap is one atomic ``renameat2(RENAME_EXCHANGE)``: at every
  instant ``NAME`` is either the whole old artifact or the whole new one. The old one then sits
  under the staging name and is removed.
- elsewhere the old artifact is first renamed aside to ``.NAME.old.XXXX``. A kill between the
  two renames leaves ``NAME`` missing; the next export *or load* of ``NAME`` renames the
  backup back (``recover``).

Leftovers of killed runs (stagings, backups) are removed by the next export into the same
place. A live export holds an ``flock`` on its staging directory for its whole life, and the
swap and the clean-up run under an ``flock`` of the parent directory, so clean-up never touches
a concurrent export's work.

Test hook: ``LOOPCAST_TEST_CRASH_AT=aside`` (after the old artifact was moved aside, before the
new one is in: the two-rename path only) or ``=swapped`` (after the swap, before the old copy is
removed) kills the process with SIGKILL at that point; ``LOOPCAST_SWAP=rename`` forces the
two-rename path (file systems without RENAME_EXCHANGE take it anyway).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import os
import shutil
import signal
import tempfile
from pathlib import Path

from loopcast.errors import ExportError

_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def output_path(out_dir: str | os.PathLike) -> Path:
    """The absolute destination; refuses ones that cannot be swapped (``.``, ``/``, the current
    directory or one of its parents: replacing it would pull the directory out from under the
    shell)."""
    out = Path(os.path.abspath(out_dir))
    if out.parent == out:
        raise ExportError(f"{out_dir}: cannot write an artifact over the file-system root")
    cwd = Path(os.path.abspath(os.getcwd()))
    if out == cwd or out in cwd.parents:
        raise ExportError(
            f"{out_dir}: the output is the current directory (or contains it); give a "
            "subdirectory, e.g. -o ./artifact"
        )
    return out


@contextlib.contextmanager
def _locked(directory: Path, blocking: bool = True):
    """An flock on a directory; yields whether it was taken."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
        except BlockingIOError:
            yield False
            return
        yield True
    finally:
        os.close(fd)


class Staging:
    """A locked staging directory beside ``out``; ``install`` swaps it in, ``discard`` removes it."""

    def __init__(self, out: Path) -> None:
        self.out = out
        out.parent.mkdir(parents=True, exist_ok=True)
        self.path = Path(tempfile.mkdtemp(prefix=f".{out.name}.staging.", dir=out.parent))
        self._fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY)
        fcntl.flock(self._fd, fcntl.LOCK_EX)  # marks it live for other processes' clean-up
        self.path.chmod(0o755)  # mkdtemp makes it private; an artifact is meant to be shared

    def install(self) -> None:
        out = self.out
        with _locked(out.parent):
            if not out.exists():
                self.path.rename(out)
            elif os.environ.get("LOOPCAST_SWAP") != "rename" and _exchange(self.path, out):
                _crash_point("swapped")
                shutil.rmtree(self.path, ignore_errors=True)  # now the old artifact
            else:
                backup = Path(tempfile.mkdtemp(prefix=f".{out.name}.old.", dir=out.parent))
                backup.rmdir()
                out.rename(backup)
                _crash_point("aside")
                try:
                    self.path.rename(out)
                except BaseException:
                    backup.rename(out)
                    raise
                _crash_point("swapped")
                shutil.rmtree(backup, ignore_errors=True)
        self._close()

    def discard(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)
        self._close()

    def _close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two paths; False where the system or file system cannot."""
    renameat2 = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if renameat2 is None:
        return False
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False
    raise OSError(code, os.strerror(code), str(b))


def _crash_point(name: str) -> None:
    if os.environ.get("LOOPCAST_TEST_CRASH_AT") == name:
        os.kill(os.getpid(), signal.SIGKILL)


def recover(out: Path, *, clean: bool = True) -> bool:
    """Undo what a killed swap left: if ``out`` is missing, rename the newest complete backup
    back; with ``clean``, remove stagings and backups no live process holds. Returns whether
    ``out`` was restored. Errors here never hide the caller's own error: they are ignored."""
    out = Path(os.path.abspath(out))
    parent = out.parent
    if not parent.is_dir():
        return False
    restored = False
    try:
        with _locked(parent):
            dead = []
            for entry in parent.iterdir():
                if (
                    entry.is_dir()
                    and not entry.is_symlink()
                    and entry.name.startswith((f".{out.name}.staging.", f".{out.name}.old."))
                ):
                    with _locked(entry, blocking=False) as free:
                        if free:
                            dead.append(entry)
            if not out.exists():
                backups = sorted(
                    (
                        d
                        for d in dead
                        if d.name.startswith(f".{out.name}.old.") and (d / "manifest.json").is_file()
                    ),
                    key=lambda d: d.stat().st_mtime,
                )
                if backups:
                    backups[-1].rename(out)
                    dead.remove(backups[-1])
                    restored = True
            if clean:
                for entry in dead:
                    shutil.rmtree(entry, ignore_errors=True)
    except OSError:
        pass
    return restored
