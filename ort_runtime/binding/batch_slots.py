"""What the batching engine needs of a batch of sequence slots, as one protocol.

Two generators implement it: ``BatchGenerator`` (ort_runtime/binding/batch_generator.py: the
looped family's decode_batch, verify_batch, draft_batch and verify_tail_batch) and
``RecurrentBatchGenerator`` (recurrent_batch_generator.py: Huginn's prelude_batch, r
core_step_batch calls and coda_batch). The engine (ort_runtime/batching/engine.py) reads what a
generator can do from the generator's widths (``verify_width``, ``tail_width``, ``prefill_rows``:
None where it has no such kind) and from its ``caps``, never by probing attributes: ``verify``
and ``advance`` serve where ``verify_width`` is set; the looped self-speculation kinds
(``draft``, ``verify_tail``) where ``tail_width`` is; ``draft_tokens`` where
``caps.recurrent_self`` is.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import numpy as np
    from loopcast.ort_runtime.binding.batch_kv import BatchStepOutput
    from loopcast.ort_runtime.binding.step_clock import StepClock
    from loopcast.ort_runtime.loading.artifact import LoadedModel


@dataclass(frozen=True)
class SlotCaps:
    """``request_options``: the GenerationConfig fields a request may set that this generator
    applies per slot (the engine hands their values to ``check_options`` and ``begin``: a
    recurrent-depth request's ``loops`` and ``state_seed``); ``prefix_reuse``: None where a
    slot's committed KV may start another request with the same prefix (the engine's prefix
    cache), else why it may not; ``recurrent_self``: below."""

    request_options: frozenset[str] = frozenset()
    prefix_reuse: str | None = None
    # self-speculation drafts whole tokens with fewer core steps (``draft_tokens``, a row a slot) and
    # verifies them with ``verify`` (the recurrent round of ort_runtime/batching/self_round.py),
    # rather than the looped family's draft_batch / verify_tail_batch
    recurrent_self: bool = False


class BatchSlots(Protocol):
    model: LoadedModel
    max_batch: int
    max_length: int
    verify_width: int | None
    tail_width: int | None
    prefill_rows: int | None
    lengths: list[int]  # n_b: the tokens whose KV slot b holds
    clock: StepClock
    caps: SlotCaps

    def check_options(self, options: Mapping[str, object]) -> None: ...
    def prefills_whole(self, slot: int) -> bool: ...  # the slot's prompt in one call, never chunked
    def begin(self, slot: int, start: int = 0, options: Mapping[str, object] | None = None) -> None: ...
    def prefill(
        self, slot: int, ids: list[int], *, start: int = 0, want_logits: bool = False
    ) -> tuple[int, np.ndarray | None]: ...
    def decode(self, tokens: dict[int, int], *, want_logits: bool = False) -> BatchStepOutput: ...
    def verify(
        self, rows: dict[int, list[int]], *, want_logits: bool = False
    ) -> tuple[dict[int, list[int]], dict[int, np.ndarray] | None]: ...
    def advance(self, slot: int, count: int) -> None: ...
    def depth_stats(self, slot: int, emitted: int) -> dict: ...  # the request's exits, where kept
    def release(self, slot: int, keep: int = 0) -> int: ...
    def warm_up(self, kinds: tuple[str, ...] | None = None) -> int: ...
