"""Edit-shaped training rows for the demo model's copy fine-tune (docs/demo-model.md, stage 4).

A code edit re-emits most of a block the context already holds: the block, a blank line or
two, then the block again with at most a few lines changed. Stage 3's unlikelihood term taught
the demo not to repeat itself and, with it, not to copy even a function it has just read, so
prompt lookup had nothing to find. A row here packs such (block, edited block) pairs, the
blocks cut at line boundaries from the train split and re-tokenized as text, so their tokens
are the tokenizer's own (a token-level splice would teach tokenizations no prompt produces).

    rows = copy_rows(train, tokenizer, rng, count=8, length=1025)   # int64 [8, 1025]

The edit on the second copy, by the row's RNG: none (40 %), or one or two of: replace a line
with a line from elsewhere (kept at the replaced line's indentation), delete a line, insert a
line, rename one identifier throughout the copy.
"""

from __future__ import annotations

import re

import numpy as np

EOT_ID = 0
_IDENT = re.compile(r"\b[A-Za-z_][A-Za-z0-9_]{2,}\b")
_HEAD = re.compile(r"^\s*(def|class|async def|for|if|with|while) ")


def _window_lines(train: np.ndarray, tokenizer, rng, tokens: int = 768) -> list[str]:
    """The whole lines of a random train-split window, inside one document."""
    for _ in range(1000):
        start = int(rng.integers(0, len(train) - tokens))
        window = np.asarray(train[start : start + tokens])
        ends = np.flatnonzero(window == EOT_ID)
        if len(ends):
            window = window[: ends[0]]
        lines = tokenizer.decode(window.tolist()).split("\n")[1:-1]  # drop the partial ends
        if len(lines) >= 6:
            return lines
    raise SystemExit("--copy-frac: no train-split window of 6 whole lines in 1000 tries; is the corpus code?")


def _block(lines: list[str], rng) -> list[str]:
    """4-40 consecutive lines, starting at a statement head (def, class, ...) when one exists."""
    heads = [i for i, line in enumerate(lines[:-3]) if _HEAD.match(line)]
    first = int(rng.choice(heads)) if heads and rng.random() < 0.8 else int(rng.integers(0, len(lines) - 3))
    count = int(rng.integers(4, 41))
    return lines[first : first + count]


def _indent(line: str) -> str:
    return line[: len(line) - len(line.lstrip())]


def _edit(block: list[str], donor: list[str], rng) -> list[str]:
    out = list(block)
    for _ in range(int(rng.integers(1, 3))):
        kind = int(rng.integers(0, 4))
        at = int(rng.integers(0, len(out)))
        line = donor[int(rng.integers(0, len(donor)))]
        if kind == 0:  # replace, at the replaced line's indentation
            out[at] = _indent(out[at]) + line.lstrip()
        elif kind == 1 and len(out) > 2:
            del out[at]
        elif kind == 2:
            out.insert(at, _indent(out[at]) + line.lstrip())
        else:  # rename one identifier of the block throughout
            names = sorted(set(_IDENT.findall("\n".join(out))))
            fresh = sorted(set(_IDENT.findall(line)) - set(names))
            if names and fresh:
                old, new = names[int(rng.integers(0, len(names)))], fresh[int(rng.integers(0, len(fresh)))]
                out = [re.sub(rf"\b{old}\b", new, x) for x in out]
    return out


def edit_pair(train: np.ndarray, tokenizer, rng) -> tuple[list[str], list[str], int]:
    """(block, its copy, blank lines between): the copy edited in 60 % of pairs."""
    block = _block(_window_lines(train, tokenizer, rng), rng)
    copy = block if rng.random() < 0.4 else _edit(block, _window_lines(train, tokenizer, rng), rng)
    return block, copy, int(rng.integers(1, 4))


def edit_pair_text(train: np.ndarray, tokenizer, rng) -> str:
    block, copy, blank = edit_pair(train, tokenizer, rng)
    return "\n".join(block) + "\n" * (blank + 1) + "\n".join(copy) + "\n"


def copy_rows(train: np.ndarray, tokenizer, rng, count: int, length: int) -> np.ndarray:
    """``count`` rows of ``length`` token ids, each edit pairs back to back (cut at ``length``)."""
    rows = np.empty((count, length), dtype=np.int64)
    for r in range(count):
        ids: list[int] = []
        while len(ids) < length:
            ids += tokenizer.encode(edit_pair_text(train, tokenizer, rng) + "\n\n").ids
        rows[r] = ids[:length]
    return rows
