"""The trainer's sequence-level unlikelihood term (tools/demo_model/demo_unlikelihood.py): which tokens it
penalises, that its batched greedy continuation is the reference greedy decode row by row, and
that one step of it makes a repeated token less likely."""

from __future__ import annotations

import numpy as np
import torch
from loopcast.exporter.reference import LoopedLM, init_weights
from loopcast.exporter.reference_generate import greedy_generate

from loopcast.presets import PRESETS
from tools.demo_model.demo_unlikelihood import greedy_continue, repeated_ngram_mask, unlikelihood_loss


def test_mask_marks_every_token_of_a_repeated_ngram() -> None:
    rows = np.array(
        [
            [1, 2, 3, 4, 5, 6, 7, 8, 9, 10],  # nothing repeats
            [1, 2, 3, 1, 2, 3, 9, 9, 9, 8],  # (1, 2, 3) again at 3..5; 9 9 9 is 3 long only
            [5, 5, 5, 5, 5, 6, 6, 6, 6, 6],  # (5, 5, 5) at 1..3 overlaps its first copy
        ]
    )
    mask = repeated_ngram_mask(rows, 3)
    assert not mask[0].any()
    assert mask[1].tolist() == [False] * 3 + [True] * 3 + [False] * 4
    assert mask[2].tolist() == [False, True, True, True, True, False, True, True, True, True]
    # The first copy is never penalised: only what the row already produced counts.
    assert not repeated_ngram_mask(rows, 4)[1].any()


def _model(seed: int = 0) -> LoopedLM:
    model = LoopedLM(PRESETS["tiny-ouro"])
    init_weights(model, seed=seed, std=0.1)  # the test checkpoints' std (conftest.py)
    return model.eval()


def test_batched_greedy_continuation_is_the_reference_decode_per_row() -> None:
    model = _model()
    prefix = torch.tensor([[3, 17, 9, 40], [8, 8, 1, 2], [50, 4, 33, 7]])
    seq = greedy_continue(model, prefix, 12)
    assert seq.shape == (3, 16)
    assert torch.equal(seq[:, :4], prefix)
    for row in range(3):
        ref = greedy_generate(model, prefix[row].tolist(), 12, max_length=16)
        assert seq[row, 4:].tolist() == ref.tokens
    assert not model.training


def test_a_step_on_the_loss_lowers_the_penalised_tokens() -> None:
    model = _model(1).train()
    seq = torch.tensor([[5, 6, 7, 1, 2, 1, 2, 1, 2, 1, 2]])
    mask = torch.from_numpy(repeated_ngram_mask(seq[:, 3:].numpy(), 2))
    prior = torch.full((model.config.num_loops,), 1.0 / model.config.num_loops)

    def penalised_prob() -> float:
        with torch.no_grad():
            logits = model(seq[:, :-1]).final_logits[:, 2:].softmax(-1)
            probs = logits.gather(-1, seq[:, 3:, None]).squeeze(-1)
        return float(probs[mask].mean())

    before = penalised_prob()
    loss, per_depth = unlikelihood_loss(model, seq, 3, mask, prior)
    assert per_depth.shape == (model.config.num_loops,) and torch.all(per_depth > 0)
    assert torch.isclose(loss, (per_depth * prior).sum())
    loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p -= 0.05 * p.grad
    assert penalised_prob() < before
    # No masked token: no penalty.
    zero, _ = unlikelihood_loss(model, seq, 3, torch.zeros_like(mask), prior)
    assert float(zero.detach()) == 0.0
