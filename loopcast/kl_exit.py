"""Huginn's zero-shot per-token exit: stop the core steps when the KL divergence between
successive steps' next-token distributions falls below a threshold (docs/checkpoints.md).

As the release's ``KLExitEvaluator``: after core step k the coda gives the last row's
distribution p_k; the exit value is ``KL(p_k-1 || p_k) = Σ p_k-1 (log p_k-1 - log p_k)``, with
p_0 uniform over the vocabulary; the rows of a call leave together, at the first step whose
value is below ``threshold`` (the release's default 1e-3). The torch reference and the runtime
both decide with ``step_kl`` (float64 from the fp32 logits), so they exit at the same step.

``kv_policy`` says what the exited rows leave in the slots of the steps they skipped
(docs/architecture.md §8): ``full`` runs those steps anyway, for the KV only (the token is
final at its exit step; later tokens read exactly the KV of a run without exits);
``last-exited`` copies each core layer's K/V of the exit step into the deeper steps' slots (the
release's ``latest-m4`` lookup: a later token's step j reads the latest step this token ran at
the same layer). The release's default lookup (attend only to the positions that ran step j)
is not offered: static KV buffers have no holes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

KV_POLICIES = ("full", "last-exited")


@dataclass(frozen=True)
class KLExit:
    threshold: float = 1e-3
    min_loops: int = 1  # the first step after which the exit is checked (the release's min_steps + 1)
    kv_policy: str = "full"

    def __post_init__(self) -> None:
        if not (isinstance(self.threshold, int | float) and self.threshold >= 0):
            raise ValueError(f"exit_threshold must be a number >= 0, got {self.threshold!r}")
        if isinstance(self.min_loops, bool) or not isinstance(self.min_loops, int) or self.min_loops < 1:
            raise ValueError(f"min_loops must be a positive integer, got {self.min_loops!r}")
        if self.kv_policy not in KV_POLICIES:
            raise ValueError(f"kv_policy must be one of {', '.join(KV_POLICIES)}, got {self.kv_policy!r}")


def uniform_log_probs(vocab: int) -> np.ndarray:
    return np.full(vocab, -np.log(vocab), dtype=np.float64)


def step_kl(previous: np.ndarray, logits_V: np.ndarray) -> tuple[float, np.ndarray]:
    """(KL(previous || softmax(logits)), log softmax(logits)) in float64."""
    x = np.asarray(logits_V, dtype=np.float64)
    shifted = x - x.max()
    log_probs = shifted - np.log(np.exp(shifted).sum())
    return float((np.exp(previous) * (previous - log_probs)).sum()), log_probs
