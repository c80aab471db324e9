"""The demo model's training corpus: the Python standard library's own ``.py`` sources.

Everything here is a pure function of the files under the stdlib root, so the corpus is
reproducible wherever the same Python version is installed. The exact bytes differ between
Python versions; the committed tokenizer and the numbers in docs/demo-corpus.md were produced
from CPython ``BUILT_WITH_PYTHON``. The sources are under the PSF License Agreement.

Selection, in order:
  1. every ``*.py`` file below the stdlib root, skipping ``EXCLUDED_DIRS`` and build-generated
     ``_sysconfigdata_*`` modules;
  2. of the ``test/`` package (about half of the stdlib's source bytes) only the files whose
     hash bucket falls below ``TEST_KEEP_PER_10K``, so the corpus stays near 20 MB;
  3. files that are not valid UTF-8 are skipped (a property of the bytes, so deterministic).

Split: a file is held out when ``sha256(relpath)`` falls below ``HELDOUT_PER_10K``, with
``relpath`` the POSIX path relative to the stdlib root (e.g. ``"json/decoder.py"``).
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
from collections.abc import Iterator
from pathlib import Path
from typing import Literal, NamedTuple

Split = Literal["train", "heldout"]
SPLITS: tuple[Split, ...] = ("train", "heldout")

BUILT_WITH_PYTHON = "3.11.7"
LICENSE = "PSF-2.0"  # the Python Software Foundation License Agreement

HELDOUT_PER_10K = 500  # 5 % of files
TEST_KEEP_PER_10K = 10000  # all of test/ (a smaller share overfits the demo model)

# Relative to the stdlib root. The data directories hold deliberately malformed inputs
# (Python 2 syntax, CRLF, non-UTF-8 cookies) that teach the model nothing about Python.
EXCLUDED_DIRS = frozenset(
    {
        "site-packages",
        "lib2to3/tests/data",
        "test/encoded_modules",
        "test/tokenizedata",
    }
)
# Generated at build time with the build machine's paths and flags, so not portable.
EXCLUDED_PREFIX = "_sysconfigdata_"
TEST_PACKAGE = "test/"


class CorpusFile(NamedTuple):
    """One corpus document: its path relative to the stdlib root and its split."""

    relpath: str
    split: Split


def stdlib_root() -> Path:
    """The running interpreter's stdlib directory."""
    return Path(sysconfig.get_paths()["stdlib"])


def hash_bucket(key: str) -> int:
    """A stable bucket in [0, 10000) from the first 8 bytes of sha256(key)."""
    digest = hashlib.sha256(key.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") % 10_000


def split_of(relpath: str) -> Split:
    """The split a file belongs to, decided by its relative path alone."""
    return "heldout" if hash_bucket(relpath) < HELDOUT_PER_10K else "train"


def is_selected(relpath: str) -> bool:
    """Whether a ``.py`` path passes the exclusion and test-subset rules (not the UTF-8 one)."""
    if Path(relpath).name.startswith(EXCLUDED_PREFIX):
        return False
    if relpath.startswith(TEST_PACKAGE):
        # A salt keeps the subset independent of the held-out split.
        return hash_bucket("test-subset:" + relpath) < TEST_KEEP_PER_10K
    return True


def candidate_relpaths(root: Path) -> list[str]:
    """Sorted relative paths of the selected ``.py`` files below ``root``."""
    found: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root):
        rel_dir = Path(dirpath).relative_to(root).as_posix()
        prefix = "" if rel_dir == "." else rel_dir + "/"
        dirnames[:] = [d for d in dirnames if prefix + d not in EXCLUDED_DIRS]
        for name in filenames:
            path = Path(dirpath, name)
            if name.endswith(".py") and path.is_file() and not path.is_symlink():
                found.append(prefix + name)
    # Sorting makes the order independent of the file system's directory order.
    return sorted(r for r in found if is_selected(r))


def read_document(root: Path, relpath: str) -> str | None:
    """The file's exact text (no newline translation), or None if it is not UTF-8."""
    try:
        return (root / relpath).read_bytes().decode("utf-8")
    except UnicodeDecodeError:
        return None


def iter_documents(root: Path | None = None) -> Iterator[tuple[CorpusFile, str]]:
    """Every corpus file with its text, in sorted relpath order."""
    base = stdlib_root() if root is None else Path(root)
    for relpath in candidate_relpaths(base):
        text = read_document(base, relpath)
        if text is not None:
            yield CorpusFile(relpath, split_of(relpath)), text


def corpus_files(root: Path | None = None) -> list[CorpusFile]:
    """All corpus files as ``(relpath, split)``, sorted by relpath."""
    return [file for file, _ in iter_documents(root)]


def read_split_with_paths(split: Split, root: Path | None = None) -> list[tuple[str, str]]:
    """``(relpath, text)`` for every document of one split, sorted by relpath."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    return [(file.relpath, text) for file, text in iter_documents(root) if file.split == split]


def read_split(split: Split, root: Path | None = None) -> list[str]:
    """The documents (file texts) of one split, sorted by relpath."""
    return [text for _, text in read_split_with_paths(split, root)]
