"""Continuous batching: requests join and leave a running batch between decode steps.

One engine thread owns a BatchGenerator (ort_runtime/binding/batch_generator.py) and loops:

    cancel → admit (waiting requests into free slots, with their cached prefix) → prefill (at
    most ``prefill_chunk`` prompt tokens, in place; a finished prompt emits its first token) →
    one decode_batch step over every decoding request → emit, finish, free slots

- **Admission control.** A request needs one sequence slot (each slot holds the full max
  length of KV); it waits in a bounded FIFO while every slot is busy, and ``submit`` refuses it
  (``CapacityError``) when the queue is full. A prompt that does not fit the KV capacity is
  refused at submission (``RequestError``); generation stops with "length" when a sequence
  reaches it.
- **Per request**: max tokens, stop ids (the stop token is emitted, as in
  ``ort_runtime/decoding/speculate.py``), sampling parameters (``ort_runtime/decoding/sampling.py``: the row's
  logits are pulled and drawn on the host with the request's own RNG; greedy rows use the
  device argmax), cancellation (takes effect at the next step boundary). Stop *strings* are
  text: the caller watches the text (``StopStringMatcher``) and cancels.
- **Speculation per request** (``speculative="prompt-lookup"``, greedy requests): each step,
  requests whose prompt-lookup proposer (ort_runtime/decoding/proposers.py) offers drafts are verified in
  one ``verify_batch`` step together with every other running request (one real row each);
  ``accept_round`` (the one accept path of both engines) takes the accepted prefix and the
  verifier's token, and the slot commits
  1 + accepted rows. ``BatchCostGate`` decides per step, from measured step costs per width and the
  observed acceptance, whether that verify step yields more tokens per second than a decode
  step. Sampled requests (and artifacts whose verify rows are not exact on the device) decode
  plainly; ``Completion.speculative`` says which applied and why. Greedy tokens equal plain
  greedy's of ``loopcast generate`` either way (tests/ort_runtime/test_batching.py).
- **Prefix caching** (ort_runtime/batching/prefix_cache.py): a prompt starts from the longest
  prefix whose KV a freed or running slot holds (``Completion.cached_tokens``).
- **Chunked prefill**: prompts are prefilled ``prefill_chunk`` tokens at a time, at most one
  chunk in all between two decode steps, so a joining prompt delays the running requests by at
  most one chunk; a slot whose prompt is still being prefilled runs no row in a decode step (a
  slot inside the batch without a row writes a dummy row past its committed KV).
- Both are on where a row does not depend on the rows sharing its call (``exact_verify`` on the
  device), so they never change a token (tests/ort_runtime/test_prefix_cache.py,
  test_chunked_prefill.py); elsewhere prompts run whole and uncached.
- Options a request sets (``BatchRequest.config``) are honoured or refused by name
  (``BATCHED_OPTIONS``, ort_runtime/batching/options.py).
- ``SequentialEngine`` (ort_runtime/batching/sequential.py) is the same interface over one
  Generator, one request at a time.

Events reach a request's ``on_event(kind, value)`` from the engine thread: ``("token", id)``,
then one ``("done", finish_reason)`` or ``("error", message)``. ``Completion`` also offers a
blocking iterator over them.
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import numpy as np
from loopcast.ort_runtime.batching.options import check_honoured
from loopcast.ort_runtime.batching.prefix_cache import PrefixCache, PrefixPlan
from loopcast.ort_runtime.binding.batch_generator import BatchGenerator
from loopcast.ort_runtime.decoding.acceptors import GreedyAcceptor, SampledAcceptor, accept_round
from loopcast.ort_runtime.decoding.finish import FinishRule
from loopcast.ort_runtime.decoding.gates import BatchCostGate
from loopcast.ort_runtime.decoding.generation_config import GenerationConfig
from loopcast.ort_runtime.decoding.proposers import PromptLookupProposer, Proposal
from loopcast.ort_runtime.decoding.sampling import SamplingParams
from loopcast.ort_runtime.decoding.verifiers import Verified

from loopcast.errors import LoopcastError, RequestError
from loopcast.manifest import DECODE_BATCH, VERIFY_BATCH
from loopcast.vocab import SpeculativeMode

EventSink = Callable[[str, object], None]
# Prompt tokens prefilled between two decode steps (BatchingEngine's prefill_chunk).
DEFAULT_PREFILL_CHUNK = 256


SPECULATIVE_MODES = (SpeculativeMode.NONE.value, SpeculativeMode.PROMPT_LOOKUP.value)
# Modes a request may name; each engine says which of them it runs (``speculative_modes``).
REQUEST_MODES = tuple(m.value for m in SpeculativeMode if m != SpeculativeMode.CUSTOM)
# GenerationConfig keyword options (ort_runtime/batching/options.py) the batching engine honours
# per request: BatchRequest's own fields, and the speculation options of its prompt lookup.
BATCHED_OPTIONS = frozenset(
    {"max_new_tokens", "sampling", "stop_ids", "speculative", "num_draft_tokens", "min_ngram", "max_ngram"}
)
__all__ = [
    "BatchCostGate",
    "BatchRequest",
    "BatchingEngine",
    "CapacityError",
    "Completion",
]


class CapacityError(LoopcastError):
    """Every slot is busy and the waiting queue is full: retry later (HTTP 503)."""


@dataclass(frozen=True)
class BatchRequest:
    ids: list[int]
    max_new_tokens: int = 64
    stop_ids: tuple[int, ...] = ()
    sampling: SamplingParams | None = None
    speculative: str = "none"  # one of the engine's speculative_modes
    # the request's other generation options (num_draft_tokens, min_ngram, ...); an engine refuses
    # a set option it does not honour (ort_runtime/batching/options.py)
    config: GenerationConfig = GenerationConfig()

    def __post_init__(self) -> None:
        if self.speculative not in REQUEST_MODES:
            raise RequestError(
                f"speculative must be one of {', '.join(REQUEST_MODES)}, got {self.speculative!r}",
                parameter="speculative",
            )
        if not isinstance(self.config, GenerationConfig):
            raise RequestError(f"config must be a GenerationConfig, got {type(self.config).__name__}")
        if not self.ids:
            raise RequestError("prompt is empty: give at least one token")
        if self.max_new_tokens < 1:
            raise RequestError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.sampling is not None and not isinstance(self.sampling, SamplingParams):
            raise RequestError(
                f"sampling must be a SamplingParams or None, got {type(self.sampling).__name__}"
            )


@dataclass(eq=False)
class Completion:
    """One submitted request: its tokens so far, how it finished, and a cancel switch."""

    request: BatchRequest
    on_event: EventSink | None = None
    id: int = 0
    tokens: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None
    speculative: str = "none"
    proposed: int = 0  # drafts offered by this request's proposer and verified
    accepted: int = 0
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    submitted: float = field(default_factory=time.perf_counter)
    token_times: list[float] = field(default_factory=list)
    _cancel: threading.Event = field(default_factory=threading.Event)
    _events: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)
    _done: threading.Event = field(default_factory=threading.Event)

    def cancel(self) -> None:
        self._cancel.set()

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    def _emit(self, kind: str, value) -> None:
        if kind == "token":
            self.tokens.append(value)
            self.token_times.append(time.perf_counter())
        elif kind == "done":
            self.finish_reason = value
        else:
            self.error = value
        self._events.put((kind, value))
        if self.on_event is not None:
            self.on_event(kind, value)
        if kind != "token":
            self._done.set()

    def events(self, timeout: float | None = None) -> Iterator[tuple[str, object]]:
        """Blocking iterator over this request's events, ending after "done"/"error"."""
        while True:
            kind, value = self._events.get(timeout=timeout)
            yield kind, value
            if kind != "token":
                return

    def result(self, timeout: float | None = None) -> list[int]:
        """Wait for the end; the tokens, or RequestError if the request failed."""
        if not self._done.wait(timeout):
            raise TimeoutError("request did not finish in time")
        if self.error is not None:
            raise RequestError(self.error)
        return list(self.tokens)


@dataclass
class _Running:
    """A running request: the same acceptor (greedy or sampled: its tokens, its rejection rule,
    its random stream) and finish rule as a one-sequence generation (ort_runtime/decoding/)."""

    completion: Completion
    slot: int
    pending: int  # last emitted token: its KV is written by the next step
    context: list[int]  # prompt + emitted tokens (repetition penalty's and the proposer's context)
    acceptor: GreedyAcceptor | SampledAcceptor
    rule: FinishRule
    proposer: PromptLookupProposer | None = None
    todo: list[int] = field(default_factory=list)  # prompt tokens not prefilled yet

    @property
    def sampled(self) -> bool:
        return self.acceptor.sampled


class _EngineBase:
    def __init__(self, max_length: int, max_waiting: int) -> None:
        self.max_length, self.max_waiting = max_length, max_waiting
        self._waiting: deque[Completion] = deque()
        self._cv = threading.Condition()
        self._stopping = False
        self._ids = itertools.count(1)
        self._thread = threading.Thread(target=self._loop, name=type(self).__name__, daemon=True)
        self.steps = 0

    def start(self):
        self._thread.start()
        return self

    speculative_modes: tuple[str, ...] = ("none",)

    def check(self, request: BatchRequest) -> None:
        """Refuse (RequestError naming the option) what this engine cannot serve."""
        if request.speculative not in self.speculative_modes:
            raise RequestError(
                f"speculative {request.speculative!r} is not served by this {self.kind}; it serves "
                f"{', '.join(self.speculative_modes)}{self.modes_note}",
                parameter="speculative",
            )

    kind = "engine"
    modes_note = ""

    def submit(self, request: BatchRequest, on_event: EventSink | None = None) -> Completion:
        self.check(request)
        if len(request.ids) >= self.max_length:
            raise RequestError(
                f"prompt of {len(request.ids)} tokens does not fit the KV capacity "
                f"({self.max_length} tokens, one of them for the first generated token)"
            )
        completion = Completion(request, on_event, next(self._ids))
        with self._cv:
            if self._stopping:
                raise CapacityError("the engine is shutting down")
            if len(self._waiting) >= self.max_waiting:
                raise CapacityError(
                    f"{len(self._waiting)} requests are already waiting for a slot "
                    f"(max_waiting={self.max_waiting}); retry later"
                )
            self._waiting.append(completion)
            self._cv.notify()
        return completion

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop admitting, let running requests finish (up to ``timeout`` s), cancel the rest."""
        with self._cv:
            self._stopping = True
            self._cv.notify()
        self._thread.join(timeout)
        if self._thread.is_alive():
            self._cancel_all()
            self._thread.join(5.0)

    def _cancel_all(self) -> None:
        with self._cv:
            waiting = list(self._waiting)
        for c in waiting + self._active_completions():
            c.cancel()

    def _take_waiting(self) -> Completion | None:
        with self._cv:
            return self._waiting.popleft() if self._waiting else None

    def _idle_wait(self) -> bool:
        """Block until there is work; False when the engine should exit."""
        with self._cv:
            while not self._waiting and not self._stopping:
                self._cv.wait(0.5)
            return not (self._stopping and not self._waiting)

    def _active_completions(self) -> list[Completion]:
        return []

    def _loop(self) -> None:
        raise NotImplementedError


class BatchingEngine(_EngineBase):
    """Continuous batching over a BatchGenerator of ``max_batch`` slots."""

    def __init__(
        self,
        generator: BatchGenerator,
        *,
        max_waiting: int = 256,
        gate: BatchCostGate | None = None,
        proposer_factory: Callable[[], object] | None = None,
        prefix_caching: bool = True,
        prefill_chunk: int | None = DEFAULT_PREFILL_CHUNK,
    ) -> None:
        """``proposer_factory``: one proposer per speculating request (default: prompt lookup
        with the request's n-gram range). ``prefix_caching``: reuse the KV of common prompt
        prefixes (ort_runtime/batching/prefix_cache.py) where that is exact. ``prefill_chunk``:
        prompt tokens prefilled between two decode steps (None or 0: whole prompts), where
        that is exact."""
        super().__init__(generator.max_length, max_waiting)
        self.gen = generator
        self.gate = gate or BatchCostGate()
        self.proposer_factory = proposer_factory
        self._running: dict[int, _Running] = {}  # slot -> request
        self._prefilling: dict[int, _Running] = {}  # slot -> request whose prompt is being prefilled
        self.peak_batch = 0
        self.stats = {"decode_steps": 0, "verify_steps": 0, "proposed": 0, "accepted": 0}
        model = generator.model
        # A cached prefix is the cold one bit for bit where rows do not depend on their call
        # (exact_verify on this device); the KV-row copy is a host copy on the CPU, the op
        # library's device copy on CUDA.
        off = (
            "turned off"
            if not prefix_caching
            else f"needs exact rows on {model.device} (manifest exact_verify)"
            if not model.exact_verify
            else "copying KV rows on the device needs the artifact's custom-op library"
            if model.device != "cpu" and not model.manifest.custom_op_library
            else None
        )
        self.prefix = PrefixCache(generator.max_batch, self.stats) if off is None else None
        self.prefix_caching = "on" if off is None else f"off ({off})"
        if prefill_chunk is not None and prefill_chunk < 0:
            raise RequestError(f"prefill_chunk must be >= 0, got {prefill_chunk}", parameter="prefill_chunk")
        # A prompt prefilled in chunks writes the rows of a whole-prompt prefill where a row does
        # not depend on the rows sharing its call (exact_verify); elsewhere prompts run whole.
        self.prefill_chunk = (prefill_chunk or None) if model.exact_verify else None
        # Speculation needs verify rows bit-identical to decode rows on this device (manifest exact_verify).
        self.speculation = (
            None
            if generator.verify_width is None
            else ""
            if model.exact_verify
            else f"verify rows are not exact on {model.device} for this artifact (manifest exact_verify)"
        )

    kind = "batching engine"
    speculative_modes = SPECULATIVE_MODES
    modes_note = " (self-speculation and the pipeline have no batched graphs yet)"

    def check(self, request: BatchRequest) -> None:
        super().check(request)
        check_honoured(request.config, BATCHED_OPTIONS, self.kind)
        k, W = request.config.speculation.num_draft_tokens, self.gen.verify_width
        if k is not None and W is not None and not 1 <= k <= W - 1:
            raise RequestError(
                f"num_draft_tokens must be in 1..{W - 1} (verify width {W}), got {k}",
                parameter="num_draft_tokens",
            )

    def _speculation_for(self, request: BatchRequest) -> tuple[PromptLookupProposer | None, str]:
        if request.speculative == "none":
            return None, "none"
        if request.sampling is not None and not request.sampling.greedy:
            return None, "none (batched speculation is greedy-only; this request samples)"
        if self.speculation is None:
            return None, "none (the artifact has no verify_batch graph)"
        if self.speculation:
            return None, f"none ({self.speculation})"
        if self.proposer_factory is not None:
            return self.proposer_factory(), "prompt-lookup"
        spec = request.config.speculation
        return PromptLookupProposer(spec.min_ngram, spec.max_ngram), "prompt-lookup"

    @property
    def running(self) -> int:
        """Requests holding a slot: decoding, or with their prompt being prefilled."""
        return len(self._running) + len(self._prefilling)

    def _active_completions(self) -> list[Completion]:
        return [r.completion for r in [*self._running.values(), *self._prefilling.values()]]

    def _loop(self) -> None:
        while True:
            if not self._running and not self._prefilling and not self._idle_wait():
                return
            self._drop_cancelled()
            self._admit()
            self._prefill()
            if self._running:
                try:
                    self._step()
                except Exception as exc:  # a failed step fails its requests, not the server
                    message = f"decode step failed: {type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
                    for slot in list(self._running):
                        self._finish(slot, error=message)
            elif self._stopping and not self._waiting and not self._prefilling:
                return

    def _drop_cancelled(self) -> None:
        with self._cv:
            for c in [c for c in self._waiting if c.cancelled]:
                self._waiting.remove(c)
                c._emit("done", "cancelled")
        for slot, r in [*self._running.items(), *self._prefilling.items()]:
            if r.completion.cancelled:
                self._finish(slot, "cancelled")

    def _admit(self) -> None:
        """Give waiting requests free slots, their cached prefix in place (prefix_cache.py); their
        prompts' remaining tokens are prefilled by ``_prefill``."""
        occupied = {**self._running, **self._prefilling}
        free = [s for s in range(self.gen.max_batch) if s not in occupied]
        while free:
            completion = self._take_waiting()
            if completion is None:
                return
            if completion.cancelled:
                completion._emit("done", "cancelled")
                continue
            request = completion.request
            if self.prefix is not None:
                held = {s: r.context[: self.gen.lengths[s]] for s, r in occupied.items()}
                plan = self.prefix.plan(request.ids, free, held)
            else:
                plan = PrefixPlan(free[0], None, 0)  # lowest free slot: keeps the batch's prefix short
            slot = plan.slot
            free.remove(slot)
            sampled = request.sampling is not None and not request.sampling.greedy
            proposer, completion.speculative = self._speculation_for(request)
            acceptor = SampledAcceptor(request.sampling) if sampled else GreedyAcceptor()
            rule = FinishRule(request.max_new_tokens, frozenset(request.stop_ids), self.max_length)
            todo = list(request.ids[plan.cached :])
            running = _Running(completion, slot, -1, list(request.ids), acceptor, rule, proposer, todo)
            occupied[slot] = self._prefilling[slot] = running
            try:
                if plan.source is not None and plan.source != slot:
                    self.gen.copy_prefix(plan.source, slot, plan.cached)
                if self.prefix is not None:
                    self.prefix.occupy(slot)
                self.gen.begin(slot, plan.cached)
            except Exception as exc:
                self._finish(slot, error=f"prefill failed: {str(exc).splitlines()[0][:300]}")
                del occupied[slot]
                free.insert(0, slot)
                continue
            completion.cached_tokens = plan.cached

    def _prefill(self) -> None:
        """Prefill the admitted prompts in admission order, at most ``prefill_chunk`` tokens in
        all before the next decode step (so a joining prompt delays the running requests by at
        most one chunk); a prompt whose last token is prefilled emits its first token and decodes
        from the next step on. Each chunk continues its slot's committed prefix (positions n..)."""
        budget = self.prefill_chunk or self.max_length * self.gen.max_batch
        for slot, r in list(self._prefilling.items()):
            if budget <= 0:
                break
            part, r.todo = r.todo[:budget], r.todo[budget:]
            budget -= len(part)
            last = not r.todo
            try:
                start = self.gen.lengths[slot]
                out_id, logits = self.gen.prefill(slot, part, start=start, want_logits=last and r.sampled)
            except Exception as exc:
                self._finish(slot, error=f"prefill failed: {str(exc).splitlines()[0][:300]}")
                continue
            if last:
                self._running[slot] = self._prefilling.pop(slot)
                self._deliver(slot, r.acceptor.choose(out_id, logits, r.context), self.gen.lengths[slot])
        self.peak_batch = max(self.peak_batch, len(self._running))

    def _step(self) -> None:
        proposals = self._proposals()
        width = max(self._running) + 1
        if proposals and self.gate.engage(width, len(self._running), len(proposals)):
            self._verify_step(proposals, width)
            return
        sampled = any(r.sampled for r in self._running.values())
        t0 = time.perf_counter()
        out = self.gen.decode({slot: r.pending for slot, r in self._running.items()}, want_logits=sampled)
        self.gate.observe_cost(DECODE_BATCH, width, time.perf_counter() - t0)
        self.steps += 1
        self.stats["decode_steps"] += 1
        for slot, token in out.next_ids.items():
            r = self._running[slot]
            logits = out.logits[slot] if r.sampled else None
            self._deliver(slot, r.acceptor.choose(token, logits, r.context), self.gen.lengths[slot])

    def _proposals(self) -> dict[int, list[int]]:
        """Drafts per slot from the requests' proposers, when a verify step fits every running slot."""
        W = self.gen.verify_width
        if not W or not any(r.proposer for r in self._running.values()):
            return {}
        if any(self.gen.lengths[s] + W > self.max_length for s in [*self._running, *self._prefilling]):
            # verify rows (or a prefilling slot's dummy rows, written at its n..) would pass some
            # slot's KV capacity: decode this step
            return {}
        proposals = {}
        for slot, r in self._running.items():
            request = r.completion.request
            k = min(
                request.config.speculation.num_draft_tokens or W - 1,
                request.max_new_tokens - len(r.completion.tokens) - 1,
            )
            if r.proposer is not None and k > 0:
                drafts = r.proposer.propose(r.context, k)
                if drafts:
                    proposals[slot] = [int(t) for t in drafts]
        return proposals

    def _verify_step(self, proposals: dict[int, list[int]], width: int) -> None:
        """One verify_batch step: every running slot's pending token, plus drafts where proposed.
        Invariant: a slot commits 1 + accepted rows; its rows past those hold stale KV that its next
        step rewrites before any row reads it (positions >= its committed length are never read)."""
        sampled = any(r.sampled for r in self._running.values())
        rows = {slot: [r.pending] + proposals.get(slot, []) for slot, r in self._running.items()}
        t0 = time.perf_counter()
        targets, logits = self.gen.verify(rows, want_logits=sampled)
        self.gate.observe_cost(VERIFY_BATCH, width, time.perf_counter() - t0)
        self.steps += 1
        self.stats["verify_steps"] += 1
        accepted_total = 0
        for slot, r in list(self._running.items()):
            # Sampled requests propose nothing (batched speculation is greedy-only): their round is
            # the pending row alone, drawn by the same rule as a one-sequence round.
            drafts = proposals.get(slot, [])
            rows_used = len(drafts) + 1
            verified = Verified(
                np.asarray(targets[slot][:rows_used]),
                logits[slot][:rows_used] if r.sampled else None,
            )
            result, emit = accept_round(r.acceptor, r.context, Proposal(drafts), verified)
            if drafts:
                accepted_total += result.accepted
                r.completion.proposed += len(drafts)
                r.completion.accepted += result.accepted
                self.stats["proposed"] += len(drafts)
                self.stats["accepted"] += result.accepted
            base = self.gen.lengths[slot]
            self.gen.advance(slot, len(emit))
            for i, token in enumerate(emit):  # as plain greedy would emit them, one committed row at a time
                self._deliver(slot, token, base + 1 + i)
                if slot not in self._running:
                    break
        self.gate.observe_accept(accepted_total / len(proposals))

    def _deliver(self, slot: int, token: int, committed: int) -> None:
        """Emit ``token`` for the request in ``slot`` and finish it by the request's FinishRule
        (the one of one-sequence generation); ``committed`` is the slot's length once the rows
        before ``token`` are written."""
        r = self._running[slot]
        r.pending = token
        r.context.append(token)
        c = r.completion
        c._emit("token", token)
        reason = r.rule.after(token, len(c.tokens), committed)
        if reason is not None:
            self._finish(slot, reason)

    def _finish(self, slot: int, reason: str | None = None, *, error: str | None = None) -> None:
        r = self._running.pop(slot) if slot in self._running else self._prefilling.pop(slot)
        # a finished sequence's committed KV stays in its slot for the prefix cache (not after an
        # error: its KV may be incomplete)
        keep = self.gen.lengths[slot] if self.prefix is not None and error is None else 0
        kept = self.gen.release(slot, keep)
        if self.prefix is not None:
            self.prefix.release(slot, r.context[:kept])
        r.completion._emit("error", error) if error is not None else r.completion._emit("done", reason)
