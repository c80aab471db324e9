"""The depth policies' torch reference (exporter/reference_depth.py) against independent
computations: Ouro's release semantics (every loop run, the head read at the exit step)."""

from __future__ import annotations

import pytest
import torch
from loopcast.exporter.reference_depth import depth_generate
from loopcast.exporter.reference_generate import greedy_generate
from loopcast.ort_runtime.decoding.generation_config import GenerationConfig

from tests.artifacts import reference

PROMPT = [3, 5, 7, 11, 2, 9, 4]


def _ouro_exit_at_step(model, prompt: list[int], steps: int, exit_at_step: int) -> list[int]:
    """Ouro's ``exit_at_step``: the whole sequence recomputed through all R loops each step,
    the next token read from the head at step ``exit_at_step`` (0-based)."""
    seq, out = list(prompt), []
    with torch.no_grad():
        for _ in range(steps):
            logits = model(torch.tensor([seq]), all_depths=True).logits[exit_at_step]
            out.append(int(logits[0, -1].argmax()))
            seq.append(out[-1])
    return out


@pytest.mark.parametrize("name", ["ouro-r2-gqa", "ouro-r3", "ouro-r4-1layer"])
def test_static_depth_is_ouros_exit_at_step(name: str) -> None:
    model = reference(name)
    for k in range(1, model.config.num_loops + 1):
        config = GenerationConfig(10, loops=k, stop_ids=())
        got = depth_generate(model, PROMPT, config)
        assert got.tokens == _ouro_exit_at_step(model, PROMPT, 10, k - 1), k
        assert got.tokens == greedy_generate(model, PROMPT, 10, depth=k).tokens
        assert got.loops == [k] * 10
