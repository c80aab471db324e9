"""tools/quality/quant_quality.py scores each position given the window's tokens before it: its
verify-row logits and cross-entropy equal the torch reference's over the same window."""

from __future__ import annotations

import numpy as np
import torch

from tests.artifacts import artifact, reference
from tools.quality.quant_quality import cross_entropy, window_logits


def test_window_scores_equal_the_reference() -> None:
    name = "llama-tied-gqa"
    model = reference(name)
    window = np.random.default_rng(0).integers(3, model.config.vocab_size, 71).astype(np.int64)
    (logits,) = window_logits(artifact(name), [window[:-1]])  # 70 rows, W at a time
    with torch.no_grad():
        want = model(torch.from_numpy(window[None, :-1]), start=0).final_logits[0].double().numpy()
    np.testing.assert_allclose(logits, want, rtol=1e-4, atol=1e-4)
    targets = window[1:]
    top = want.max(axis=1, keepdims=True)
    ce = (np.log(np.exp(want - top).sum(axis=1)) + top[:, 0] - want[np.arange(70), targets]).sum()
    assert abs(cross_entropy(logits, targets) - ce) < 1e-3
