"""Code prompts cut from held-out demo-corpus documents, shared by tools/bench/bench_cpu.py (speed)
and tools/demo_model/eval_demo_model.py (greedy continuations): the same documents, the same cuts.

The documents come either from the stdlib of the running interpreter
(``demo_corpus.read_split_with_paths``) or from the packed ``heldout.npy`` (documents end with
EOT, ordered by path as packed): on CPython 3.11.7 both give the same texts, and the packed
array gives them on any interpreter.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import numpy as np

CODE_CHARS, EDIT_CHARS, EDIT_REPEAT_CHARS = 200, 300, 40
DEF_LINE = re.compile(r"^[ \t]*def ", re.MULTILINE)
EOT_ID = 0


def select_snippets(documents: Iterable[tuple[str, str]], count: int) -> list[tuple[str, int, str]]:
    """``count`` documents evenly spaced among those with a ``def`` line and EDIT_CHARS after it
    (in the given order), each as (name, offset of its first ``def`` line, text)."""
    found = []
    for name, text in documents:
        match = DEF_LINE.search(text)
        if match and len(text) - match.start() >= EDIT_CHARS:
            found.append((name, match.start(), text))
    if len(found) < count:
        raise SystemExit(f"only {len(found)} held-out documents with a def line; asked for {count}")
    return [found[i * len(found) // count] for i in range(count)]


def cut_at_line_end(text: str, limit: int) -> str:
    """``text[:limit]`` shortened to its last complete line (trailing blank lines and newline
    dropped), so a prompt does not end inside a token; the first line if that is over ``limit``."""
    end = text.rfind("\n", 0, limit + 1)
    if end <= 0:
        end = text.find("\n") if "\n" in text else len(text)
    return text[:end].rstrip()


def cut_at_word_end(text: str, limit: int) -> str:
    """``text[:limit]`` shortened to end just before a space or newline that follows a word."""
    ends = [m.start() for m in re.finditer(r"(?<=\S)\s", text[: limit + 1])]
    return text[: ends[-1]] if ends else text[:limit]


def code_prompts(documents: Iterable[tuple[str, str]], count: int) -> list[str]:
    """The ``code`` workload: ~CODE_CHARS from each selected document's first ``def``, whole lines."""
    return [cut_at_line_end(text[start:], CODE_CHARS) for _, start, text in select_snippets(documents, count)]


def packed_documents(ids: np.ndarray, tokenizer) -> list[tuple[str, str]]:
    """The documents of a packed split (each one's ids followed by EOT), decoded, named by index."""
    ends = np.flatnonzero(ids == EOT_ID)
    starts = np.concatenate(([0], ends[:-1] + 1))
    return [
        (f"doc{i}", tokenizer.decode(ids[s:e].tolist(), skip_special_tokens=False))
        for i, (s, e) in enumerate(zip(starts, ends))
    ]
