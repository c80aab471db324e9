"""How a generation ends: one rule for one sequence and for every request of a batch.

``FinishRule`` decides after each emitted token: a stop id ends it ("eos", the stop token is
emitted), so do the token budget and the KV capacity ("length": no room is left for the pending
token's KV). ``Finisher`` applies it to one sequence's generator: it hands the tokens out, sets
``n`` to what plain decoding leaves and fills in the stats; the batching engine applies the same
rule to each of its requests (ort_runtime/batching/engine.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from loopcast.ort_runtime.binding.generator import Generator
from loopcast.ort_runtime.decoding.stats import GenerationStats

from loopcast.manifest import CYCLE, CYCLE_RUN, PREFILL
from loopcast.vocab import parse_graph_key


@dataclass(frozen=True)
class FinishRule:
    max_new_tokens: int
    stop_ids: frozenset[int]
    max_length: int  # KV capacity of the sequence

    def after(self, token: int, emitted: int, committed: int) -> str | None:
        """The finish reason after emitting ``token``, the ``emitted``-th new token, when the
        sequence holds ``committed`` tokens of KV (those before ``token``), or None."""
        if token in self.stop_ids:
            return "eos"
        if emitted >= self.max_new_tokens or committed >= self.max_length:
            return "length"
        return None


class Finisher:
    """Hands a generation's tokens out and ends it: stops at a stop id (yielded), at
    ``max_new_tokens`` or at the KV capacity, sets ``n`` to what plain decoding leaves (the
    prefix, the input and every yielded token but the last, which is pending) and fills in the
    stats. Shared by the greedy and the sampled loops; ``on_finish`` runs first (a gate's report)."""

    def __init__(self, gen: Generator, stats: GenerationStats, input_len: int, rule: FinishRule) -> None:
        self.gen, self.stats, self.input_len, self.rule = gen, stats, input_len, rule
        self.max_new_tokens = rule.max_new_tokens
        self.emitted, self.on_finish = 0, None
        # passes the prompt's last row ran as loop steps (the exit gate's first row): prefill's
        # work, excluded as prefill is, so every depth policy counts the same rows
        self.prompt_passes = 0
        self.base, self.start = gen.n, time.perf_counter()
        self.clock0 = gen.clock.reading()
        stats.finish_reason = ""  # a reused stats record must not make an early close skip the rewind

    @property
    def remaining(self) -> int:
        return self.max_new_tokens - self.emitted

    def emit(self, tokens: list[int]):
        """Yield ``tokens`` (a round's, committed up to the last one); returns True when the
        generation has finished (``yield from``)."""
        last = len(tokens) - 1
        for i, token in enumerate(tokens):
            self.emitted += 1
            self.stats.new_tokens = self.emitted
            yield token
            reason = self.rule.after(token, self.emitted, self.gen.n - (last - i))
            if reason is not None:
                self(reason, self.emitted)
                return True
        return False

    def __call__(self, reason: str, emitted: int = 0) -> None:
        gen, stats = self.gen, self.stats
        if self.on_finish is not None:
            self.on_finish()
        stats.finish_reason = reason
        gen.rewind(min(gen.n, self.base + self.input_len + emitted - 1))
        stats.seconds = time.perf_counter() - self.start
        stats.new_tokens = emitted
        stats.tokens_per_second = emitted / stats.seconds if stats.seconds > 0 else 0.0
        stats.tokens_per_round = (stats.accepted + stats.rounds) / stats.rounds if stats.rounds else 0.0
        # Passes over the core layers: a step of a graph running loops a..b-1 is b-a passes
        # whatever its rows (prefill excluded); a cycle is one pass, a cycle run K.
        since = gen.clock.since(self.clock0)
        ran = since.runs
        graphs = gen.model.manifest.graphs
        cycle_run = gen.cycle_run.cycles if ran.get(CYCLE_RUN) and gen.cycle_run is not None else 0
        per_call: dict[str, int] = {CYCLE: 1, CYCLE_RUN: cycle_run}

        def loops(kind: str) -> int:
            spec = graphs[kind]
            return spec.last_loop - spec.first_loop

        passes = sum(
            n * per_call.get(k, loops(k)) for k, n in ran.items() if parse_graph_key(k)[0] != PREFILL
        )
        passes = max(passes - self.prompt_passes, 0)
        stats.cycles = ran.get(CYCLE, 0) + ran.get(CYCLE_RUN, 0) * per_call[CYCLE_RUN]
        if stats.cycles:
            stats.tokens_per_round = 1.0 if stats.rounds else 0.0  # a pipeline round ends with one token
        stats.core_passes = passes
        stats.core_calls_per_token = round(passes / emitted, 4) if emitted else 0.0
        stats.steps, stats.step_seconds = dict(since.runs), dict(since.seconds)

    def abandoned(self) -> None:
        """A consumer that stops early (close(), break) or an error mid-round must not leave
        ``n`` past the yielded tokens: rounds commit drafts before yielding them."""
        if not self.stats.finish_reason:
            emitted = self.stats.new_tokens
            self.gen.rewind(
                min(self.gen.n, self.base + self.input_len + emitted - 1) if emitted else self.base
            )
