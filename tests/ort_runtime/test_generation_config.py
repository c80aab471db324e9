"""One options object: GenerationConfig validates once, names the parameter at fault, and the
API's keyword form, its config form and a mix of both run the same generation."""

from __future__ import annotations

import pytest
from loopcast.ort_runtime import GenerationConfig, SamplingParams, SpeculationConfig, load

from loopcast.errors import RequestError
from loopcast.vocab import GateKind, SpeculativeMode
from tests.artifacts import artifact, require_exact_cpu_artifacts


def test_keywords_map_onto_the_config_and_its_speculation() -> None:
    config = GenerationConfig.from_options(
        max_new_tokens=7, speculative="self", gate="always", num_draft_tokens=2, stop="\n\n"
    )
    assert config.max_new_tokens == 7 and config.stop == ("\n\n",)
    spec = config.speculation
    assert (spec.mode, spec.gate, spec.num_draft_tokens) == (SpeculativeMode.SELF, GateKind.ALWAYS, 2)
    # keywords override a given config; None leaves a speculation field as it was
    again = GenerationConfig.from_options(config, max_new_tokens=3, gate=None)
    assert again.max_new_tokens == 3 and again.speculation.gate == GateKind.ALWAYS


@pytest.mark.parametrize(
    "options, fragment",
    [
        (dict(speculative="medusa"), "speculative must be one of none, prompt-lookup"),
        (dict(gate="none"), "gate must be one of auto, always"),
        (dict(num_draft_tokens=0), "num_draft_tokens must be >= 1"),
        (dict(max_new_tokens=-1), "max_new_tokens must be >= 0"),
        (dict(max_new_tokens=True), "max_new_tokens must be an integer"),
        (dict(alternate_gap=1.5), r"alternate_gap must be in \(0, 1\]"),
        (dict(min_ngram=3, max_ngram=2), "min_ngram <= max_ngram"),
        (dict(pipeline_exit=0), "pipeline_exit must be >= 1"),
        (dict(sampling={"temperature": 0.5}), "sampling must be a SamplingParams"),
        (dict(temprature=0.5), "unknown generation option 'temprature'"),
    ],
)
def test_bad_options_name_the_parameter(options, fragment) -> None:
    with pytest.raises(RequestError, match=fragment):
        GenerationConfig.from_options(**options)


def test_config_and_keywords_run_the_same_generation() -> None:
    require_exact_cpu_artifacts()
    model = load(artifact("ouro-r3"))
    prompt = [3, 5, 7, 3, 5, 7, 3, 5]
    keywords = model.generate(prompt, 24, stop_ids=(), speculative="prompt-lookup", gate="always")
    config = GenerationConfig(
        max_new_tokens=24, stop_ids=(), speculation=SpeculationConfig("prompt-lookup", gate="always")
    )
    as_config = model.generate(prompt, config=config)
    mixed = model.generate(prompt, config=config.replace(max_new_tokens=5), max_new_tokens=24)
    plain = model.generate(prompt, 24, stop_ids=())
    assert keywords.tokens == as_config.tokens == mixed.tokens == plain.tokens
    assert as_config.stats.speculative == "prompt-lookup" and as_config.stats.rounds > 0
    seeded = GenerationConfig(
        max_new_tokens=12, stop_ids=(), sampling=SamplingParams(temperature=0.8, seed=4)
    )
    assert model.generate(prompt, config=seeded).tokens == model.generate(prompt, config=seeded).tokens
