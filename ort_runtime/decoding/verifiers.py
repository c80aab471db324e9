"""Verify strategies: how one round scores the pending token and a proposal's drafts.

Each strategy runs the graphs it names and returns, per row, the verifier's argmax after the
pending token and ``drafts[:i]`` (``len(drafts) + 1`` rows), plus the logits when asked for.
It writes KV at positions n..n+len(drafts) and never moves ``n``: the engine commits.

- ``PlainDecode``: the degenerate round, no drafts, one decode row.
- ``VerifyRows``: the ``verify`` graph (all depths, W rows) over pending + drafts, for
  proposers that only give tokens (prompt lookup, a user's own).
- ``DraftTail``: self-speculation. The proposer's draft rows already wrote depth<d KV and
  carry their depth-d states; ``verify_tail`` runs those states through depths d..R-1.
- ``TreeTail``: self-speculation with an alternate suffix (``AlternateDraftProposer``): the
  ``tree_tail`` graph runs the primary rows at n..n+k and the branch rows at their scratch
  positions n+k+1.. in one call, each branch row masking the primary rows after the fork.

A strategy also prices a round of k drafts from the measured step costs, which is what the
cost gate compares with plain decode (``ort_runtime/decoding/gates.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from loopcast.ort_runtime.decoding.proposers import Proposal
from loopcast.ort_runtime.decoding.protocols import VerifierBase, VerifierCaps

from loopcast.errors import RequestError
from loopcast.manifest import DECODE, DRAFT, TREE_DRAFT, TREE_TAIL, VERIFY, VERIFY_TAIL


@dataclass(frozen=True)
class Verified:
    target_ids: np.ndarray  # [len(drafts) + 1] int64
    logits: np.ndarray | None  # [len(drafts) + 1, V] float32, or None when not pulled
    branch_ids: np.ndarray | None = None  # [len(branch.tokens)]: the argmax after each branch row


class PlainDecode(VerifierBase):
    name = "decode"
    kinds = (DECODE,)

    def max_drafts(self, gen) -> int:
        return 0

    def step(self, gen, pending: int) -> int:
        """The degenerate round in full: decode the pending token, commit it, return the next.
        The engine's hot path when no drafts run (no proposal, nothing to accept)."""
        out = gen.run(DECODE, gen.n, tokens=[pending], want_logits=False)
        gen.commit([pending])
        return int(out.next_ids[0])

    def verify(self, gen, pending: int, proposal: Proposal, *, want_logits: bool = False) -> Verified:
        out = gen.run(DECODE, gen.n, tokens=[pending], want_logits=want_logits)
        return Verified(out.next_ids[:1], out.logits)

    def round_cost(self, costs, k: int) -> float:
        return costs.decode()


class VerifyRows(VerifierBase):
    name = "verify"
    kinds = (VERIFY,)

    def max_drafts(self, gen) -> int:
        return gen.rows(VERIFY) - 1

    def verify(self, gen, pending: int, proposal: Proposal, *, want_logits: bool = True) -> Verified:
        rows = [pending] + proposal.tokens
        out = gen.run(VERIFY, gen.n, tokens=rows, want_logits=want_logits)
        return Verified(
            out.next_ids[: len(rows)], out.logits[: len(rows)] if out.logits is not None else None
        )

    def round_cost(self, costs, k: int) -> float:
        priced = costs.rows_cost(VERIFY, k + 1)  # the CPU: a round runs its k + 1 rows only
        return priced or costs.mean(VERIFY) or costs.decode() * 1.2


class DraftTail(VerifierBase):
    name = "draft+verify_tail"
    kinds = (DRAFT, VERIFY_TAIL)

    def max_drafts(self, gen) -> int:
        return gen.rows(VERIFY_TAIL) - 1

    def verify(self, gen, pending: int, proposal: Proposal, *, want_logits: bool = True) -> Verified:
        if proposal.hidden is None or len(proposal.hidden) != len(proposal.tokens) + 1:
            raise RequestError("draft+verify_tail needs one depth-d hidden state per row (pending + drafts)")
        out = gen.run(VERIFY_TAIL, gen.n, hidden=proposal.hidden, want_logits=want_logits)
        rows = len(proposal.tokens) + 1
        return Verified(out.next_ids[:rows], out.logits[:rows] if out.logits is not None else None)

    def round_cost(self, costs, k: int) -> float:
        decode = costs.decode()
        draft = costs.mean(DRAFT) or decode * costs.draft_share
        tail = costs.mean(VERIFY_TAIL) or decode * (1 - costs.draft_share) * 1.2
        return (k + 1) * draft + tail


class TreeTail(VerifierBase):
    """Primary rows and one branch in one ``tree_tail`` call (docs/architecture.md §5,
    "Alternate suffix"). Rows past those used are inactive and write nothing, so a round needs
    only the positions its rows use (``writes_padding = False``)."""

    name = "tree_draft+tree_tail"
    kinds = (TREE_DRAFT, TREE_TAIL)
    caps = VerifierCaps(writes_padding=False)

    def __init__(self) -> None:
        self.branch_rows = 0.0  # running mean of branch rows per round (what the gate pays for)

    def max_drafts(self, gen) -> int:
        return gen.rows(TREE_TAIL) - 1

    def verify(self, gen, pending: int, proposal: Proposal, *, want_logits: bool = True) -> Verified:
        n, k, branch = gen.n, len(proposal.tokens), proposal.branch
        if proposal.hidden is None or len(proposal.hidden) != k + 1:
            raise RequestError("tree verify needs one depth-d hidden state per row (pending + drafts)")
        addresses, hidden = [(n + i, 0, 0) for i in range(k + 1)], [proposal.hidden]
        if branch is not None:
            addresses += [(n + k + 1 + j, n + branch.fork + 1, n + k + 1) for j in range(len(branch.tokens))]
            hidden.append(branch.hidden)
        self.branch_rows = 0.9 * self.branch_rows + 0.1 * (len(branch.tokens) if branch is not None else 0)
        out = gen.run_rows(TREE_TAIL, addresses, hidden=np.concatenate(hidden), want_logits=want_logits)
        logits = out.logits[: k + 1] if out.logits is not None else None
        return Verified(out.next_ids[: k + 1], logits, out.next_ids[k + 1 :] if branch is not None else None)

    def round_cost(self, costs, k: int) -> float:
        """k+1 primary draft rows, the branch rows this generation has been drafting on average,
        and one tree_tail call (its rows are the verify width whatever the branch)."""
        decode = costs.decode()
        draft = costs.mean(TREE_DRAFT) or decode * costs.draft_share
        tail = costs.mean(TREE_TAIL) or decode * (1 - costs.draft_share) * 1.2
        return (k + 1 + self.branch_rows) * draft + tail
