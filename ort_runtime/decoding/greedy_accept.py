"""The accept rule of a speculative round: ``greedy_accept`` (pure) and the TieGuard.

The verifier scores the pending token and the drafts in one step; ``greedy_accept`` returns
the accepted prefix and the verifier's own next token (the correction, or the bonus token when
every draft was accepted). The engine (``ort_runtime/decoding/speculate.py``) commits exactly that.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class AcceptResult:
    accepted: int  # drafts accepted (a prefix of the proposal)
    next_token: int  # the verifier's token after the accepted prefix
    near_tie_rejections: int  # 1 if the first rejected draft was within ε of the row max
    tolerant_accepts: int = 0  # drafts accepted only because of the tolerant mode
    branch_accepted: int = 0  # > 0: the alternate suffix won; drafts[:fork] + branch[:this] committed
    fork_miss: bool = False  # the round reached the fork and neither branch's token was right


@dataclass(frozen=True)
class TieGuard:
    """Counts rejected drafts whose logit is within ``epsilon`` of their row's max (near ties).

    Strict by default: a near tie is only counted, the committed token stays the verifier's
    argmax. ``tolerant=True`` (never the default) accepts such drafts instead — that output is
    *not* plain greedy's, and ``stats.exact_greedy`` says so.
    """

    epsilon: float = 1e-3
    tolerant: bool = False

    def __post_init__(self) -> None:
        if not self.epsilon >= 0:
            raise ValueError(f"TieGuard epsilon must be >= 0, got {self.epsilon}")


def greedy_accept(
    drafts: Sequence[int],
    target_ids: Sequence[int],
    target_logits: np.ndarray | None = None,
    *,
    epsilon: float = 0.0,
    tolerant: bool = False,
) -> AcceptResult:
    """Accept the longest prefix of ``drafts`` that greedy decoding would have produced.

    ``target_ids[i]`` is the verifier's argmax after the pending token and ``drafts[:i]``, so
    ``len(target_ids) == len(drafts) + 1``. Strict (default): draft i is accepted iff it equals
    ``target_ids[i]``; the committed tokens are then exactly greedy's. With ``target_logits``
    a rejected draft whose logit is within ``epsilon`` of its row's max counts as a near tie;
    ``tolerant=True`` accepts such drafts — that output is *not* identical to greedy.
    A round without drafts (plain decode) accepts nothing and returns ``target_ids[0]``.
    """
    if len(target_ids) != len(drafts) + 1:
        raise ValueError(
            f"need {len(drafts) + 1} verifier rows for {len(drafts)} drafts, got {len(target_ids)}"
        )
    accepted = tolerated = ties = 0
    for i, draft in enumerate(drafts):
        if draft == target_ids[i]:
            accepted += 1
            continue
        near = target_logits is not None and target_logits[i].max() - target_logits[i][draft] <= epsilon
        if near and tolerant:
            accepted += 1
            tolerated += 1
            continue
        ties = int(near)
        break
    # The verifier's rows condition on the drafts themselves, so its token after the accepted
    # prefix is consistent with what is committed, tolerated drafts included.
    return AcceptResult(accepted, int(target_ids[accepted]), ties, tolerated)


def greedy_accept_tree(
    drafts: Sequence[int],
    target_ids: Sequence[int],
    branch,
    branch_ids: Sequence[int] | None,
    target_logits: np.ndarray | None = None,
    *,
    epsilon: float = 0.0,
    tolerant: bool = False,
) -> AcceptResult:
    """``greedy_accept`` over the primary chain, then the alternate suffix where it takes over.

    The primary prefix is accepted as usual. If its first rejection is at the fork and the
    verifier's token there is the branch's first token, the branch continues: branch token j+1
    is accepted iff it equals ``branch_ids[j]`` (the verifier's argmax after branch row j), and
    the next token is the argmax after the last accepted branch row. Every committed token is
    then still the verifier's own argmax after its prefix: plain greedy's.
    """
    result = greedy_accept(drafts, target_ids, target_logits, epsilon=epsilon, tolerant=tolerant)
    if branch is None or result.accepted != branch.fork:
        return result
    if branch.tokens[0] != result.next_token:
        return AcceptResult(
            result.accepted,
            result.next_token,
            result.near_tie_rejections,
            result.tolerant_accepts,
            fork_miss=True,
        )
    taken = 1
    while taken < len(branch.tokens) and branch.tokens[taken] == branch_ids[taken - 1]:
        taken += 1
    return AcceptResult(
        branch.fork + taken,
        int(branch_ids[taken - 1]),
        result.near_tie_rejections,
        result.tolerant_accepts,
        branch_accepted=taken,
    )
