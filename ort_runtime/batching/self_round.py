"""Self-speculation inside the continuous batch: one round over every running request.

    call i = 0..K (draft_batch, one row per slot):  slot b's row i at position n_b + i,
                                                    loops 0..d-1 → its draft token, its depth-d state
    one verify_tail_batch call:                     slot b's states at n_b..n_b+W-1, loops d..R-1
                                                    → the verifier's token after each row

Every running request has a row in every call (a request that sits a call out would get the
batch's dummy row at its own n_b, over its row 0):

- a self-drafting request (``drafting``: the gate's choice, k_b drafts) feeds row i the draft
  token its row i-1 gave (row 0: its pending token), as ``SelfDraftProposer`` does alone;
- a request with token drafts (``proposals``: prompt lookup) feeds them, teacher-forced;
- any other request (k_b = 0) is a plain step: row 0 and its tail row are its decode row;
- past its chain (i > k_b) a request's row repeats its last token at position n_b + i.

Invariant (docs/architecture.md §5, per slot): a slot commits 1 + a ≤ k_b + 1 rows, so every row
at n_b + k_b + 1.. (a row past its chain, a tail padding row) and every rejected row lies past
its committed length; the next round rewrites those positions (draft row i, tail row i) before
any row reads them. Each row is the one-sequence draft / verify_tail row bit for bit
(tests/ort_runtime/test_batch_self_rows.py), so greedy tokens are plain greedy's.

A recurrent-depth generator (``caps.recurrent_self``) drafts whole tokens with fewer core steps
instead, as one sequence does alone (ort_runtime/decoding/recurrent_stream.py):

    call i = 0..K-1 (``draft_tokens``, a row per drafting slot):  its row at n_b + i at its draft
                                                             depth → draft token i
    one ``verify`` call:                                     every running slot's pending token
                                                             and drafts at n_b.. at its own r

Only the drafting slots have rows in the draft calls (the others, and a chain that ended, get
dummy rows at their n_b, which the verify rewrites); the drafts write KV at steps below the
draft depth, which the verify, running every step up to r on those positions, rewrites before
any of its rows reads it. Verify rows are the one-sequence rows bit for bit
(tests/ort_runtime/test_recurrent_batch.py), so tokens are plain decoding's.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from loopcast.ort_runtime.binding.batch_slots import BatchSlots

from loopcast.manifest import DRAFT_BATCH, VERIFY_TAIL_BATCH


@dataclass(frozen=True)
class RoundRows:
    """One slot's share of a batched round: its drafts and the verifier's token after the
    pending row and each draft (len(drafts) + 1), with those rows' logits when asked."""

    drafts: list[int]
    targets: list[int]
    logits: np.ndarray | None


def self_round(
    gen: BatchSlots,
    pending: dict[int, int],
    drafting: dict[int, int],
    proposals: dict[int, list[int]],
    *,
    logits_for: frozenset[int] = frozenset(),
    observe: Callable[[str, float], None] | None = None,
    perturb: Callable[[int, list[int], int], int] | None = None,
) -> dict[int, RoundRows]:
    """Run one round over the slots of ``pending`` (slot -> its pending token): ``drafting``
    slots draft k_b tokens with the shallow loops, ``proposals`` slots verify their given drafts;
    commits nothing (the caller accepts and advances each slot). ``logits_for``: slots whose
    tail logits are pulled (sampled requests). ``observe(kind, seconds)``: each call's time.
    ``perturb(slot, drafts so far, token) -> token`` replaces a self-drafted token before it is
    fed on (tests: forced rejections, or an oracle's drafts)."""
    if gen.caps.recurrent_self:
        return _recurrent_round(gen, pending, drafting, proposals, logits_for, observe, perturb)
    limit = {s: drafting.get(s, len(proposals.get(s, ()))) for s in pending}
    K = max(limit.values())
    feed = dict(pending)
    drafts: dict[int, list[int]] = {s: [] for s in pending}
    hidden: dict[int, list[np.ndarray]] = {s: [] for s in pending}
    for i in range(K + 1):
        t0 = time.perf_counter()
        out = gen.draft(feed, {s: i for s in pending})
        if observe is not None:
            observe(DRAFT_BATCH, time.perf_counter() - t0)
        assert out.hidden is not None  # draft rows always carry their depth-d state
        for s in pending:
            if i > limit[s]:
                continue  # a row past the chain: its position is never committed by this round
            hidden[s].append(out.hidden[s])
            if i < limit[s]:
                token = proposals[s][i] if s in proposals else out.next_ids[s]
                if perturb is not None and s not in proposals:
                    token = perturb(s, list(drafts[s]), int(token))
                drafts[s].append(int(token))
                feed[s] = int(token)
    t0 = time.perf_counter()
    targets, logits = gen.verify_tail(
        {s: np.stack(h) for s, h in hidden.items()}, want_logits=bool(logits_for)
    )
    if observe is not None:
        observe(VERIFY_TAIL_BATCH, time.perf_counter() - t0)
    return {
        s: RoundRows(drafts[s], targets[s], logits[s] if logits is not None and s in logits_for else None)
        for s in pending
    }


def _recurrent_round(gen, pending, drafting, proposals, logits_for, observe, perturb) -> dict[int, RoundRows]:
    """The round of a recurrent-depth generator (the module's second diagram)."""
    drafts: dict[int, list[int]] = {s: list(proposals.get(s, ())) for s in pending}
    feed = {s: pending[s] for s in drafting}
    for i in range(max(drafting.values(), default=0)):
        chain = {s: feed[s] for s, k in drafting.items() if i < k}
        t0 = time.perf_counter()
        out = gen.draft_tokens(chain, {s: i for s in chain})
        if observe is not None:
            observe(DRAFT_BATCH, time.perf_counter() - t0)
        for s, token in out.items():
            if perturb is not None:
                token = perturb(s, list(drafts[s]), int(token))
            drafts[s].append(int(token))
            feed[s] = int(token)
    t0 = time.perf_counter()
    targets, logits = gen.verify({s: [pending[s], *drafts[s]] for s in pending}, want_logits=bool(logits_for))
    if observe is not None:
        observe(VERIFY_TAIL_BATCH, time.perf_counter() - t0)  # the gate prices a round's verify as its tail
    return {
        s: RoundRows(drafts[s], targets[s], logits[s] if logits is not None and s in logits_for else None)
        for s in pending
    }
