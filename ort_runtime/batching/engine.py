"""Continuous batching: requests join and leave a running batch between decode steps.

One engine thread owns a generator of sequence slots (ort_runtime/binding/batch_slots.py: the
looped family's BatchGenerator, or a recurrent-depth RecurrentBatchGenerator) and loops:

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
- **Speculation per request** (``speculative="prompt-lookup"``): requests whose proposer offers
  drafts are verified in one ``verify_batch`` step with every other running request (one real
  row each); ``accept_round`` (the one accept path of both engines) settles each slot, which
  commits 1 + accepted rows. ``BatchCostGate`` decides per step, from measured step costs per
  width and the observed acceptance, whether that beats a decode step; ``Completion.speculative``
  says what applied and why. Greedy tokens equal ``loopcast generate``'s either way.
- **Self-speculation in the batch** (``speculative="self"``, self_round.py): the gate picks which
  self-speculating requests draft this step (``engage_self``); one round drafts for them (the
  looped family's draft_batch rows, a recurrent-depth model's rows at fewer core steps) and
  verifies every running request, prompt-lookup drafts riding along, through the same
  ``accept_round``.
- **Prefix caching** (ort_runtime/batching/prefix_cache.py): a prompt starts from the longest
  prefix whose KV a freed or running slot holds (``Completion.cached_tokens``).
- **Chunked prefill**: prompts are prefilled ``prefill_chunk`` tokens at a time, at most one
  chunk in all between two decode steps, so a joining prompt delays the running requests by at
  most one chunk; a slot whose prompt is still being prefilled runs no row in a decode step (a
  slot inside the batch without a row writes a dummy row past its committed KV).
- Both are on where a row does not depend on the rows sharing its call (``exact_verify`` on the
  device), so they never change a token (tests/ort_runtime/test_prefix_cache.py,
  test_chunked_prefill.py); elsewhere prompts run whole and uncached (and recurrent-depth ones
  uncached: their KV holds their request's depth).
- Options a request sets (``BatchRequest.config``) are honoured or refused by name
  (``BATCHED_OPTIONS``, options.py, and the generator's ``caps.request_options``).
- ``SequentialEngine`` (ort_runtime/batching/sequential.py) is the same interface over one
  Generator, one request at a time.

Requests and their events: ort_runtime/batching/requests.py; the waiting queue and the engine
thread: admission.py.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
from loopcast.ort_runtime.batching.admission import CapacityError, EngineBase
from loopcast.ort_runtime.batching.batch_gate import BatchCostGate
from loopcast.ort_runtime.batching.options import check_honoured
from loopcast.ort_runtime.batching.pipeline_lanes import BatchedPipeline
from loopcast.ort_runtime.batching.prefix_cache import PrefixCache, PrefixPlan
from loopcast.ort_runtime.batching.requests import BatchRequest, Completion
from loopcast.ort_runtime.batching.self_round import RoundRows, self_round
from loopcast.ort_runtime.binding.batch_slots import BatchSlots
from loopcast.ort_runtime.decoding.acceptors import GreedyAcceptor, SampledAcceptor, accept_round
from loopcast.ort_runtime.decoding.finish import FinishRule
from loopcast.ort_runtime.decoding.proposers import PromptLookupProposer, Proposal
from loopcast.ort_runtime.decoding.verifiers import Verified

from loopcast.errors import RequestError
from loopcast.manifest import CYCLE_BATCH, DECODE_BATCH, VERIFY_BATCH
from loopcast.vocab import SpeculativeMode

# Prompt tokens prefilled between two decode steps (BatchingEngine's prefill_chunk).
DEFAULT_PREFILL_CHUNK = 256
NONE, PROMPT_LOOKUP, SELF, PIPELINE = (
    m.value
    for m in (
        SpeculativeMode.NONE,
        SpeculativeMode.PROMPT_LOOKUP,
        SpeculativeMode.SELF,
        SpeculativeMode.PIPELINE,
    )
)
# GenerationConfig keyword options (ort_runtime/batching/options.py) the batching engine honours
# per request: BatchRequest's own fields, and the speculation options of its drafts.
BATCHED_OPTIONS = frozenset(
    {"max_new_tokens", "sampling", "stop_ids", "speculative", "num_draft_tokens", "min_ngram", "max_ngram"}
)
__all__ = ["BatchCostGate", "BatchRequest", "BatchingEngine", "CapacityError", "Completion"]


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
    self_draft: bool = False  # drafts with the shallow loops (self_round.py)
    pipeline: bool = False  # runs lanes in the batched cycle (pipeline_lanes.py)

    @property
    def sampled(self) -> bool:
        return self.acceptor.sampled


class BatchingEngine(EngineBase):
    """Continuous batching over the ``max_batch`` slots of a generator."""

    def __init__(
        self,
        generator: BatchSlots,
        *,
        max_waiting: int = 256,
        gate: BatchCostGate | None = None,
        proposer_factory: Callable[[], object] | None = None,
        prefix_caching: bool = True,
        prefill_chunk: int | None = DEFAULT_PREFILL_CHUNK,
        draft_row_budget: int | None = None,
        self_perturb: Callable[[list[int], int], int] | None = None,
        warm_up: bool = True,
    ) -> None:
        """``proposer_factory``: one proposer per prompt-lookup request (default: prompt lookup
        with the request's n-gram range). ``prefix_caching``: reuse the KV of common prompt
        prefixes (ort_runtime/batching/prefix_cache.py) where that is exact. ``prefill_chunk``:
        prompt tokens prefilled between two decode steps (None or 0: whole prompts), where
        that is exact. ``draft_row_budget``: self-draft rows (k + 1 per drafting request) per
        step (default: every slot's). ``self_perturb(sequence, token) -> token`` replaces a
        self-drafted token (``sequence``: the request's tokens and drafts before it) before it is
        fed on: forced rejections, or an oracle's drafts, in tests (the pipeline's exit-loop drafts
        too). ``warm_up``: capture every width of every captured kind at ``start``."""
        super().__init__(generator.max_length, max_waiting)
        self.gen = generator
        self.gate = gate or BatchCostGate()
        self.proposer_factory = proposer_factory
        self.self_perturb = self_perturb
        W = generator.tail_width or generator.verify_width or 1  # a draft chain and its pending row
        self.draft_row_budget = draft_row_budget or generator.max_batch * W
        if self.draft_row_budget < 2:
            raise RequestError(
                f"draft_row_budget must be >= 2 (one draft and its pending row), got {draft_row_budget}",
                parameter="draft_row_budget",
            )
        self._running: dict[int, _Running] = {}  # slot -> request
        self._prefilling: dict[int, _Running] = {}  # slot -> request whose prompt is being prefilled
        self.peak_batch = 0
        self.stats = {"decode_steps": 0, "verify_steps": 0, "self_rounds": 0, "proposed": 0, "accepted": 0}
        model = generator.model
        # A cached prefix is the cold one bit for bit where rows do not depend on their call
        # (exact_verify on this device); the KV-row copy is a host copy on the CPU, the op
        # library's device copy on CUDA.
        off = (
            "turned off"
            if not prefix_caching
            else generator.caps.prefix_reuse
            if generator.caps.prefix_reuse
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
        # self-speculation where the model drafts with its shallow loops (a draft depth), in
        # rounds of the batched draft and verify_tail kinds (self_round.py) where rows are exact
        recurrent = generator.caps.recurrent_self  # drafts at fewer core steps, verified by verify
        self.speculative_modes = (NONE, PROMPT_LOOKUP) + (
            (SELF,) if model.manifest.draft_depth or recurrent else ()
        )
        self.self_speculation = (
            "off (the model has no draft depth)"
            if not model.manifest.draft_depth and not recurrent
            else "off (the artifact has no draft_batch graph: re-export with --max-batch)"
            if generator.tail_width is None and not recurrent
            else "off (its batched verify needs the loopcast attention op)"
            if recurrent and generator.verify_width is None
            else f"off (rows are not exact on {model.device} for this artifact: exact_verify)"
            if not model.exact_verify
            else "on"
        )
        # the pipeline where the artifact has the batched cycle and its rows are exact
        self.pipeline: BatchedPipeline | None = None
        self.pipeline_state = (
            "off (the artifact has no cycle_batch graph: a looped model exported with --max-batch and "
            "the loopcast attention op)"
            if CYCLE_BATCH not in model.sessions
            else f"off (rows are not exact on {model.device} for this artifact: exact_verify)"
            if not model.exact_verify
            else "on"
        )
        if self.pipeline_state == "on":
            hook = (
                None
                if self_perturb is None
                else lambda s, lanes, t: self_perturb(self._running[s].context + lanes, t)
            )
            self.pipeline = BatchedPipeline(generator, hook=hook)
            self.speculative_modes += (PIPELINE,)
        self.stats["pipeline_cycles"] = 0
        self.stats["warm_up_runs"], self._warm_up = 0, warm_up

    def _prepare(self) -> None:  # on the engine thread (EngineBase.start), whose steps replay graphs
        if self._warm_up:
            cycle = self.pipeline.cycle.warm_up() if self.pipeline is not None else 0
            self.stats["warm_up_runs"] = self.gen.warm_up() + cycle

    kind = "batching engine"
    modes_note = " (the pipeline where it has cycle_batch; serve --sequential: every mode, one at a time)"

    def check(self, request: BatchRequest) -> None:
        super().check(request)
        check_honoured(request.config, BATCHED_OPTIONS | self.gen.caps.request_options, self.kind)
        self.gen.check_options(self._slot_options(request))
        k, W = request.config.speculation.num_draft_tokens, self.gen.verify_width or self.gen.tail_width
        if k is not None and W is not None and not 1 <= k <= W - 1:
            raise RequestError(
                f"num_draft_tokens must be in 1..{W - 1} (verify width {W}), got {k}",
                parameter="num_draft_tokens",
            )

    def _slot_options(self, request: BatchRequest) -> dict[str, object]:  # the generator's caps
        values = {name: request.config.value(name) for name in self.gen.caps.request_options}
        return {**values, "speculative": request.speculative} if "speculative" in values else values

    def _speculation_for(self, request: BatchRequest) -> tuple[PromptLookupProposer | None, str]:
        """The request's proposer (prompt lookup) and what serves it ("self": its round's drafts)."""
        if request.speculative == NONE:
            return None, NONE
        if request.speculative == SELF:
            on = self.self_speculation == "on"
            return None, SELF if on else "none" + self.self_speculation.removeprefix("off")
        if request.speculative == PIPELINE:
            if request.sampling is not None and not request.sampling.greedy:
                return None, "none (the batched pipeline runs greedy requests only)"
            return None, PIPELINE
        if self.speculation is None:
            return None, "none (the artifact has no verify_batch graph)"
        if self.speculation:
            return None, f"none ({self.speculation})"
        if self.proposer_factory is not None:
            return self.proposer_factory(), PROMPT_LOOKUP
        spec = request.config.speculation
        return PromptLookupProposer(spec.min_ngram, spec.max_ngram), PROMPT_LOOKUP

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
            t0 = time.perf_counter()
            self._drop_cancelled()
            self._admit()
            t1 = time.perf_counter()
            self._prefill()
            t2 = time.perf_counter()
            self._timed("admit", t1 - t0)
            self._timed("prefill", t2 - t1)
            if self._running:
                try:
                    self._step()
                    self._timed("step", time.perf_counter() - t2)
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
            running.self_draft = completion.speculative == SELF
            running.pipeline = completion.speculative == PIPELINE
            occupied[slot] = self._prefilling[slot] = running
            try:
                if plan.source is not None and plan.source != slot:
                    self.gen.copy_prefix(plan.source, slot, plan.cached)
                if self.prefix is not None:
                    self.prefix.occupy(slot)
                self.gen.begin(slot, plan.cached, self._slot_options(request))
            except Exception as exc:
                self._finish(slot, error=f"prefill failed: {str(exc).splitlines()[0][:300]}")
                del occupied[slot]
                free.insert(0, slot)
                continue
            completion.cached_tokens = plan.cached

    def _prefill(self) -> None:
        """Prefill the admitted prompts in admission order, at most ``prefill_chunk`` tokens in
        all before the next decode step (a joining prompt delays the running requests by at most
        one chunk; one the generator prefills whole takes its call); a finished prompt emits its
        first token. Each chunk continues its slot's committed prefix. With the captured prefill
        (``prefill_rows`` = C, where rows are exact) every chunk is C tokens: a prompt's last
        chunk ends at its last token and so starts inside the chunk before, whose rows it
        recomputes bit for bit (a prompt shorter than C runs whole)."""
        C = self.gen.prefill_rows if self.prefill_chunk else None
        budget = C or self.prefill_chunk or self.max_length * self.gen.max_batch
        for slot, r in list(self._prefilling.items()):
            if budget <= 0:
                break
            start, whole = self.gen.lengths[slot], self.gen.prefills_whole(slot)  # (a KL exit's prompt)
            end = start + (len(r.todo) if whole else min(len(r.todo), budget))
            if C and end - start < C <= end:  # the last chunk, shifted back to C tokens
                start = end - C
            part, r.todo = r.context[start:end], r.todo[end - self.gen.lengths[slot] :]
            budget -= len(part)
            last = not r.todo
            try:
                out_id, logits = self.gen.prefill(slot, part, start=start, want_logits=last and r.sampled)
            except Exception as exc:
                self._finish(slot, error=f"prefill failed: {str(exc).splitlines()[0][:300]}")
                continue
            if last:
                self._running[slot] = self._prefilling.pop(slot)
                self._deliver(slot, r.acceptor.choose(out_id, logits, r.context), self.gen.lengths[slot])
        self.peak_batch = max(self.peak_batch, len(self._running))

    def _step(self) -> None:
        width = max(self._running) + 1
        if self.pipeline is not None:
            piped = [s for s, r in self._running.items() if r.pipeline]
            chosen = (
                self.gate.engage_pipeline(width, len(self._running), piped, self.pipeline.loops)
                if piped
                else set()
            )
            if chosen:
                self._pipeline_step(width, chosen)
                return
            for slot in piped:  # the gate stood the pipeline down: plain rows, lanes dropped
                self._drop_lanes(slot)
        room = self._room()
        drafting = self._self_drafts(width) if room else {}
        proposals = self._proposals() if room else {}
        if drafting:
            self._self_step(drafting, proposals, width)
            return
        if proposals and self.gate.engage(width, len(self._running), len(proposals)):
            self._verify_step(proposals, width)
            return
        self._decode_step(self._running, width)

    def _decode_step(self, rows: dict[int, _Running], width: int) -> None:
        """One decode_batch step: one plain row for each request of ``rows``."""
        sampled = any(r.sampled for r in rows.values())
        t0 = time.perf_counter()
        out = self.gen.decode({slot: r.pending for slot, r in rows.items()}, want_logits=sampled)
        self.gate.observe_cost(DECODE_BATCH, width, time.perf_counter() - t0)
        self.steps += 1
        self.stats["decode_steps"] += 1
        for slot, token in out.next_ids.items():
            r = self._running[slot]
            logits = out.logits[slot] if r.sampled else None
            self._deliver(slot, r.acceptor.choose(token, logits, r.context), self.gen.lengths[slot])

    def _drop_lanes(self, slot: int) -> None:
        assert self.pipeline is not None
        if slot in self.pipeline.lanes:
            self.pipeline.drop(slot)
            self.gate.pipeline_stopped(slot)

    def _pipeline_step(self, width: int, chosen: set[int]) -> None:
        """A step with pipeline requests: one cycle_batch call over the lanes of those the gate
        chose (pipeline_lanes.py), then one decode_batch call with a plain row for every other
        request (their drafts wait for a step without lanes). A pipeline request too close to the
        KV capacity for a lane and the widest step's dummy rows past it takes a plain row instead."""
        assert self.pipeline is not None
        W = max(self.gen.verify_width or 1, self.gen.tail_width or 1)
        room = self.max_length - 1 - W  # the last position a lane may sit at
        lanes, plain = {}, {}
        for slot, r in self._running.items():
            n = self.gen.lengths[slot]
            if slot in chosen and n <= room:
                left = r.completion.request.max_new_tokens - len(r.completion.tokens)
                lanes[slot] = min(room, n + left - 1)
            else:
                self._drop_lanes(slot)
                plain[slot] = r
        if lanes:
            t0 = time.perf_counter()
            outcomes = self.pipeline.step({s: self._running[s].pending for s in lanes}, lanes)
            self.gate.observe_cost(CYCLE_BATCH, width, time.perf_counter() - t0)
            self.stats["pipeline_cycles"] += 1
            for slot, out in outcomes.items():
                self.gate.observe_pipeline(slot, out.token is not None)
                c = self._running[slot].completion
                c.proposed += out.verified
                c.accepted += out.accepted
                self.stats["proposed"] += out.verified
                self.stats["accepted"] += out.accepted
                if out.token is not None:
                    self._deliver(slot, out.token, self.gen.lengths[slot])
        if plain:
            self._decode_step(plain, width)  # counts the step
        else:
            self.steps += 1

    def _room(self) -> bool:
        """Whether a speculative step fits every slot: W rows (or a prefilling slot's dummy rows,
        written at its n..) past each one's committed length, within its KV capacity."""
        W = max(self.gen.verify_width or 0, self.gen.tail_width or 0)
        slots = [*self._running, *self._prefilling]
        return bool(W) and all(self.gen.lengths[s] + W <= self.max_length for s in slots)

    def _draft_limit(self, r: _Running, W: int) -> int:
        """The most drafts a round may give ``r``: its num_draft_tokens, and one token short of its
        budget (the round's last token is the verifier's)."""
        request = r.completion.request
        return min(
            request.config.speculation.num_draft_tokens or W - 1,
            request.max_new_tokens - len(r.completion.tokens) - 1,
        )

    def _proposals(self) -> dict[int, list[int]]:
        """Drafts per slot from the prompt-lookup requests' proposers."""
        W = self.gen.verify_width or self.gen.tail_width
        if not W or not any(r.proposer for r in self._running.values()):
            return {}
        proposals = {}
        for slot, r in self._running.items():
            k = self._draft_limit(r, W)
            if r.proposer is not None and k > 0:
                raw = r.proposer.propose(r.context, k)  # a list from a test's own proposer
                drafts = raw.tokens if isinstance(raw, Proposal) else raw
                if drafts:
                    proposals[slot] = [int(t) for t in drafts]
        return proposals

    def _self_drafts(self, width: int) -> dict[int, int]:
        """Slot -> drafts of the self-speculating requests that draft this step (the gate's choice)."""
        W = self.gen.verify_width if self.gen.caps.recurrent_self else self.gen.tail_width
        if not W:
            return {}
        candidates = {
            slot: k
            for slot, r in self._running.items()
            if r.self_draft and (k := self._draft_limit(r, W)) > 0
        }
        if not candidates:
            return {}
        return self.gate.engage_self(width, len(self._running), candidates, self.draft_row_budget)

    def _self_step(self, drafting: dict[int, int], proposals: dict[int, list[int]], width: int) -> None:
        """One self-speculation round over every running slot (self_round.py); prompt-lookup
        drafts ride along as given draft rows."""
        perturb = self.self_perturb
        rows = self_round(
            self.gen,
            {slot: r.pending for slot, r in self._running.items()},
            drafting,
            proposals,
            logits_for=frozenset(s for s, r in self._running.items() if r.sampled),
            observe=lambda kind, seconds: self.gate.observe_cost(kind, width, seconds),
            perturb=None
            if perturb is None
            else lambda s, drafts, t: perturb(self._running[s].context + drafts, t),
        )
        self.steps += 1
        self.stats["self_rounds"] += 1
        verdicts = self._accept(rows)
        for slot in drafting:
            self.gate.observe_self(slot, verdicts[slot][0])
        self._commit(verdicts)

    def _verify_step(self, proposals: dict[int, list[int]], width: int) -> None:
        """One verify_batch step: every running slot's pending token, plus drafts where proposed."""
        sampled = any(r.sampled for r in self._running.values())
        given = {slot: [r.pending] + proposals.get(slot, []) for slot, r in self._running.items()}
        t0 = time.perf_counter()
        targets, logits = self.gen.verify(given, want_logits=sampled)
        self.gate.observe_cost(VERIFY_BATCH, width, time.perf_counter() - t0)
        self.steps += 1
        self.stats["verify_steps"] += 1
        # A sampled request's drafts are point masses (prompt lookup's tokens): its acceptor keeps
        # each with probability p(x) and draws a rejection from p without x, as alone.
        rows = {
            slot: RoundRows(
                proposals.get(slot, []),
                targets[slot],
                logits[slot] if logits is not None and r.sampled else None,
            )
            for slot, r in self._running.items()
        }
        verdicts = self._accept(rows)
        self.gate.observe_accept(sum(verdicts[s][0] for s in proposals) / len(proposals))
        self._commit(verdicts)

    def _accept(self, rows: dict[int, RoundRows]) -> dict[int, tuple[int, list[int]]]:
        """Every speculative step's verdict per slot, by ``accept_round`` (the one accept path of
        both engines): slot -> (accepted drafts, tokens to emit after the pending one)."""
        verdicts = {}
        for slot, got in rows.items():
            r, used = self._running[slot], len(got.drafts) + 1
            verified = Verified(
                np.asarray(got.targets[:used]), got.logits[:used] if got.logits is not None else None
            )
            result, emit = accept_round(r.acceptor, r.context, Proposal(got.drafts), verified)
            if got.drafts:
                r.completion.proposed += len(got.drafts)
                r.completion.accepted += result.accepted
                self.stats["proposed"] += len(got.drafts)
                self.stats["accepted"] += result.accepted
            verdicts[slot] = (result.accepted, emit)
        return verdicts

    def _commit(self, verdicts: dict[int, tuple[int, list[int]]]) -> None:
        """Invariant: a slot commits 1 + accepted rows; its rows past those hold stale KV that its
        next step rewrites before any row reads it (positions >= its committed length are never read)."""
        for slot, (_, emit) in verdicts.items():
            base = self.gen.lengths[slot]
            self.gen.advance(slot, len(emit))
            for i, token in enumerate(emit):  # as plain greedy would emit them, one committed row at a time
                self._deliver(slot, token, base + 1 + i)
                if slot not in self._running:
                    break

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
        self.gate.forget(slot)
        if self.pipeline is not None:
            self.pipeline.drop(slot)
        r.completion.depth = self.gen.depth_stats(slot, len(r.completion.tokens))  # where it keeps them
        # its committed KV stays in its slot for the prefix cache (not after an error: maybe incomplete)
        keep = self.gen.lengths[slot] if self.prefix is not None and error is None else 0
        kept = self.gen.release(slot, keep)
        if self.prefix is not None:
            self.prefix.release(slot, r.context[:kept])
        r.completion._emit("error", error) if error is not None else r.completion._emit("done", reason)
