"""Per-request generation options in the batching engine (ort_runtime/batching/options.py): the
options it implements are honoured, any other set option is refused by its name."""

from __future__ import annotations

import pytest
from loopcast.ort_runtime import load
from loopcast.ort_runtime.batching.engine import BatchCostGate, BatchingEngine, BatchRequest
from loopcast.ort_runtime.batching.options import set_options
from loopcast.ort_runtime.binding.batch_generator import BatchGenerator
from loopcast.ort_runtime.decoding.generation_config import GenerationConfig

from loopcast.errors import RequestError
from tests.artifacts import artifact, require_exact_cpu_artifacts


@pytest.fixture(scope="module")
def model():
    require_exact_cpu_artifacts()
    return load(artifact("ouro-r3", max_batch=4))


def test_set_options_names_keywords():
    assert set_options(GenerationConfig()) == []
    config = GenerationConfig.from_options(
        max_new_tokens=5, speculative="prompt-lookup", num_draft_tokens=2, gate="always", stop=["x"]
    )
    assert set_options(config) == ["max_new_tokens", "speculative", "num_draft_tokens", "gate", "stop"]


class _AlwaysVerify(BatchCostGate):
    def engage(self, width: int, running: int, proposing: int) -> bool:
        return True


class _Recording:
    """A proposer that drafts a repeat of the last token and records how many drafts it was asked for."""

    asked: list[int] = []

    def propose(self, context, k):
        _Recording.asked.append(k)
        return [context[-1]] * k


def test_options_honoured_and_refused_by_name(model):
    engine = BatchingEngine(
        BatchGenerator(model.loaded, max_batch=2), gate=_AlwaysVerify(), proposer_factory=_Recording
    ).start()
    try:
        prompt = [4, 5, 4, 5, 4, 5]
        config = GenerationConfig.from_options(speculative="prompt-lookup", num_draft_tokens=2)
        done = engine.submit(BatchRequest(prompt, 12, speculative="prompt-lookup", config=config))
        assert done.result(30) == list(model.stream_ids(prompt, 12, stop_ids=()))
        assert _Recording.asked and max(_Recording.asked) == 2
        for options, name in (
            ({"gate": "always"}, "gate"),
            ({"speculative": "self", "alternate_gap": 0.5}, "alternate_gap"),
            ({"allow_inexact": True}, "allow_inexact"),
        ):
            request = BatchRequest(prompt, 4, config=GenerationConfig.from_options(**options))
            with pytest.raises(RequestError, match=name) as refused:
                engine.submit(request)
            assert refused.value.parameter == name
        with pytest.raises(RequestError, match="1..4") as refused:
            engine.submit(BatchRequest(prompt, 4, config=GenerationConfig.from_options(num_draft_tokens=5)))
        assert refused.value.parameter == "num_draft_tokens"
        # the pipeline runs in the batch (cycle_batch): plain greedy's tokens
        piped = engine.submit(BatchRequest(prompt, 12, speculative="pipeline"))
        assert piped.result(30) == list(model.stream_ids(prompt, 12, stop_ids=()))
        assert engine.stats["pipeline_cycles"] > 0
    finally:
        engine.shutdown()
