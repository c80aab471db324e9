"""Prefix caching over the batch's static KV slots (docs/serving.md, "Prefix caching").

Every sequence slot's KV buffers hold, at positions 0..k-1 of every (loop, layer) slot, the KV
of some token prefix: a running request's committed tokens, or a finished request's, which stay
in its freed slot until a new request overwrites them. ``PrefixCache`` remembers which tokens
each slot holds and, for a joining prompt, finds the longest common prefix among them:

- the prompt takes a free slot that keeps the batch narrow (a decode step runs every slot up to
  the highest occupied one, free ones as dummy rows): one inside the occupied range, else the
  lowest free slot; among them the one that holds the match (its prefix is already in place),
  else the least recently freed one (LRU), whose prefix it evicts;
- a match held elsewhere (a freed slot outside that range, or a running one) is copied there
  (``BatchGenerator.copy_prefix``: positions 0..k-1 of every KV slot, a host copy);
- then only the prompt's remaining tokens are prefilled, at positions k.. (at least one: the
  last prompt token's row gives the first generated token).

Free slots are the cache's capacity. A freed slot keeps its prefix intact because the dummy rows
a step runs for free slots inside the batch write past it (``BatchGenerator.release(slot, keep)``).

**Exactness.** The KV of position i depends only on tokens 0..i, and on an artifact whose rows
do not depend on the rows that share a call (``exact_verify`` on the device: decode, verify and
prefill rows are the same arithmetic), the copied or resident rows are bit for bit the ones a
cold prefill would write, and so are the rows of the remaining tokens. So a cached prefix gives
the tokens of a cold one; elsewhere caching stays off (``BatchingEngine.prefix_caching`` says why).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PrefixPlan:
    """Where a joining prompt goes: ``slot``; its first ``cached`` tokens' KV comes from ``source``
    (``slot`` itself: already in place; another slot: copied; None: nothing cached)."""

    slot: int
    source: int | None
    cached: int


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class PrefixCache:
    """The token prefix held by each sequence slot, and the LRU order of the free ones."""

    STATS = ("prefix_queries", "prefix_hits", "prefix_query_tokens", "prefix_hit_tokens")

    def __init__(self, slots: int, stats: dict[str, int] | None = None) -> None:
        """``stats``: the dict the lookups are counted in (an engine's), the STATS keys added."""
        self._held: list[list[int]] = [[] for _ in range(slots)]
        self._freed_at = [0] * slots  # release counter: 0 = never used (oldest)
        self._clock = 0
        self.stats = stats if stats is not None else {}
        for key in self.STATS:
            self.stats.setdefault(key, 0)

    def held(self, slot: int) -> list[int]:
        return list(self._held[slot])

    def plan(self, ids: list[int], free: list[int], running: dict[int, list[int]]) -> PrefixPlan:
        """The slot for prompt ``ids`` among ``free`` ones, and its longest cached prefix over the
        free slots' held prefixes and ``running`` (occupied slot -> tokens whose KV it holds).

        The slot keeps the batch narrow (a step runs every slot up to the highest occupied one,
        free ones as dummy rows): a free slot inside the occupied range if there is one, else
        the lowest free slot. Among those it takes the one holding the match (in place), else
        the least recently freed (LRU: evicts that slot's prefix), and the match is copied."""
        if not free:
            raise ValueError("no free slot")
        limit = len(ids) - 1  # the last prompt token is always run: its row gives the first token
        source, cached = None, 0
        for slot, tokens in [*((s, self._held[s]) for s in free), *running.items()]:
            k = min(common_prefix(tokens, ids), limit)
            if k > cached:
                source, cached = slot, k
        width = max(running) + 1 if running else 0
        candidates = [s for s in free if s < width] or [min(free)]
        if source in candidates:
            slot = source
        else:  # least recently freed (never-used slots first, lowest first)
            slot = min(candidates, key=lambda s: (self._freed_at[s], s))
        self.stats["prefix_queries"] += 1
        self.stats["prefix_query_tokens"] += len(ids)
        if cached:
            self.stats["prefix_hits"] += 1
            self.stats["prefix_hit_tokens"] += cached
        return PrefixPlan(slot, source if cached else None, cached)

    def occupy(self, slot: int) -> None:
        """``slot`` is running a new sequence: what it held is being overwritten."""
        self._held[slot] = []

    def release(self, slot: int, tokens: list[int]) -> None:
        """``slot`` is free and its KV holds ``tokens`` (at positions 0..len-1)."""
        self._held[slot] = list(tokens)
        self._clock += 1
        self._freed_at[slot] = self._clock
