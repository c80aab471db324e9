"""Prefix caching over the batch's static KV slots (docs/serving.md, "Prefix caching").

Every sequence slot's KV buffers hold, at positions 0..k-1 of every (loop, layer) slot, the KV
of some token prefix: a running request's committed tokens, or a finished request's, which stay
in its freed slot until a new request overwrites them. ``PrefixCache`` remembers which tokens
each slot holds and, for a joining prompt, finds the longest common prefix among them:

- the match lies in a **free** slot: the prompt takes that slot and its prefix is already in
  place (nothing is copied);
- it lies in a **running** slot: the prompt takes a free slot and the prefix's KV rows are copied
  there (``BatchGenerator.copy_prefix``: positions 0..k-1 of every KV slot);
- then only the prompt's remaining tokens are prefilled, at positions k.. (at least one: the
  last prompt token's row gives the first generated token).

Free slots are the cache's capacity: a prompt that matches nothing takes the least recently
freed one (LRU), which evicts that slot's prefix. A freed slot keeps its prefix intact because
the dummy rows a step runs for free slots inside the batch write past it
(``BatchGenerator.release(slot, keep)``).

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
        free slots' held prefixes and ``running`` (slot -> tokens whose KV it has committed)."""
        if not free:
            raise ValueError("no free slot")
        limit = len(ids) - 1  # the last prompt token is always run: its row gives the first token
        best_free, best_free_len = None, 0
        for slot in free:
            k = min(common_prefix(self._held[slot], ids), limit)
            if k > best_free_len:
                best_free, best_free_len = slot, k
        best_run, best_run_len = None, 0
        for slot, tokens in running.items():
            k = min(common_prefix(tokens, ids), limit)
            if k > best_run_len:
                best_run, best_run_len = slot, k
        self.stats["prefix_queries"] += 1
        self.stats["prefix_query_tokens"] += len(ids)
        if best_free is not None and best_free_len >= best_run_len:
            plan = PrefixPlan(best_free, best_free, best_free_len)
        else:
            # least recently freed (never-used slots first, lowest first): evicts its prefix
            slot = min(free, key=lambda s: (self._freed_at[s], s))
            plan = PrefixPlan(slot, best_run, best_run_len)  # best_run None: nothing cached
        if plan.cached:
            self.stats["prefix_hits"] += 1
            self.stats["prefix_hit_tokens"] += plan.cached
        return plan

    def occupy(self, slot: int) -> None:
        """``slot`` is running a new sequence: what it held is being overwritten."""
        self._held[slot] = []

    def release(self, slot: int, tokens: list[int]) -> None:
        """``slot`` is free and its KV holds ``tokens`` (at positions 0..len-1)."""
        self._held[slot] = list(tokens)
        self._clock += 1
        self._freed_at[slot] = self._clock
