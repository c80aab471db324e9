"""Sampling parameters at the edges of float arithmetic: a distribution is always finite, a NaN
never becomes a token, and the same holds through the API, the CLI and the server."""

from __future__ import annotations

import numpy as np
import pytest
from click.testing import CliRunner
from loopcast.cli import main
from loopcast.ort_runtime import SamplingParams, load
from loopcast.ort_runtime.decoding.sampling import make_rng, probabilities, sample

from loopcast.errors import LoopcastError
from tests.artifacts import artifact

EXTREMES = [
    SamplingParams(temperature=1e-320, seed=0),
    SamplingParams(temperature=5e-324, seed=0),
    SamplingParams(temperature=1e300, seed=0),
    SamplingParams(repetition_penalty=1e-310, seed=0),
    SamplingParams(repetition_penalty=1e308, seed=0),
    SamplingParams(temperature=1e-320, repetition_penalty=1e-310, seed=0),
    SamplingParams(temperature=1e-320, top_p=1e-300, min_p=1.0, top_k=1, seed=0),
]


@pytest.mark.parametrize("params", EXTREMES, ids=repr)
def test_extreme_parameters_give_a_finite_distribution(params) -> None:
    logits = np.random.default_rng(1).normal(0, 30, 500).astype(np.float32)
    logits[7] = 3e38  # near float32's largest
    p = probabilities(logits, params, context_ids=[7, 8, 9])
    assert np.isfinite(p).all() and abs(p.sum() - 1.0) < 1e-9 and (p >= 0).all()
    token = sample(p, make_rng(params))
    assert p[token] > 0


def test_a_tiny_temperature_is_the_argmax() -> None:
    logits = np.random.default_rng(2).normal(0, 1, 300).astype(np.float32)
    p = probabilities(logits, SamplingParams(temperature=1e-320))
    assert int(np.argmax(p)) == int(np.argmax(logits)) and p.max() == 1.0


def test_a_nan_never_becomes_a_token() -> None:
    with pytest.raises(LoopcastError, match="not finite"):
        probabilities(np.array([0.0, np.nan, 1.0], np.float32), SamplingParams())
    with pytest.raises(LoopcastError, match="not a distribution"):
        sample(np.array([np.nan, np.nan]), make_rng(SamplingParams(seed=0)))


def test_extremes_through_the_api_and_the_cli() -> None:
    path = artifact("llama-tied-gqa")
    model = load(path)
    greedy = model.generate([1, 2, 3], 8, stop_ids=()).tokens
    tiny = model.generate([1, 2, 3], 8, stop_ids=(), sampling=SamplingParams(temperature=1e-320, seed=3))
    assert tiny.tokens == greedy  # a vanishing temperature samples the argmax, not the last id
    penalised = model.generate([1, 2, 3], 8, stop_ids=(), sampling=SamplingParams(repetition_penalty=1e-310))
    assert len(set(penalised.tokens)) > 1 or penalised.tokens != [model.config.vocab_size - 1] * 8
    for flags in (
        ["--temperature", "1e-320", "--seed", "1"],
        ["--repetition-penalty", "1e-310", "--seed", "1"],
    ):
        result = CliRunner().invoke(
            main, ["generate", str(path), "--prompt-ids", "1,2,3", "--max-new-tokens", "4", *flags]
        )
        assert result.exit_code == 0, result.output
