"""Python API arguments of the wrong type or range, generators of another model and proposers
that hand the engine the wrong things: each a RequestError naming the parameter, raised before
the engine runs on them (never silently converted, never a TypeError from deep inside)."""

from __future__ import annotations

import numpy as np
import pytest
from loopcast.ort_runtime import GenerationConfig, load
from loopcast.ort_runtime.decoding.proposers import Proposal

from loopcast.errors import RequestError
from tests.adversarial.requests.request_cases import case, params

A = "arguments"
IDS = [5, 6, 5, 6, 5, 6]


class Fixed:
    """A user proposer (the documented protocol: ``propose(context, k)``) returning ``out``."""

    def __init__(self, out, drafts_hidden: bool = False) -> None:
        self.out, self.drafts_hidden, self.calls = out, drafts_hidden, 0

    def propose(self, context, k):
        self.calls += 1
        return self.out


ROWS = [
    case(
        "api",
        A,
        "max-new-tokens-float",
        {"max_new_tokens": 1.5},
        "must be an integer",
        parameter="max_new_tokens",
    ),
    case(
        "api",
        A,
        "max-new-tokens-bool",
        {"max_new_tokens": True},
        "must be an integer",
        parameter="max_new_tokens",
    ),
    case(
        "api",
        A,
        "max-new-tokens-negative",
        {"max_new_tokens": -1},
        "must be >= 0",
        parameter="max_new_tokens",
    ),
    case(
        "api",
        A,
        "max-new-tokens-str",
        {"max_new_tokens": "8"},
        "must be an integer",
        parameter="max_new_tokens",
    ),
    case("api", A, "ids-float", {"prompt": [5.0, 6]}, "must be integers", parameter="prompt"),
    case("api", A, "ids-bool", {"prompt": [True, 6]}, "must be integers", parameter="prompt"),
    case("api", A, "ids-bytes", {"prompt": b"ab"}, "text or a sequence of token ids", parameter="prompt"),
    case("api", A, "ids-strings", {"prompt": ["5", "6"]}, "must be integers", parameter="prompt"),
    case("api", A, "ids-out-of-vocab", {"prompt": [5, 10**6]}, "outside the vocabulary", parameter="prompt"),
    case("api", A, "ids-negative", {"prompt": [-1]}, "outside the vocabulary", parameter="prompt"),
    case("api", A, "ids-float-array", {"prompt": np.array([5.0, 6.0])}, "integer array", parameter="prompt"),
    case("api", A, "ids-2d-array", {"prompt": np.array([[5, 6]])}, "1-D integer array", parameter="prompt"),
    case("api", A, "ids-int", {"prompt": 5}, "text or a sequence of token ids", parameter="prompt"),
    case("api", A, "tie-guard-str", {"tie_guard": "x"}, "must be a TieGuard", parameter="tie_guard"),
    case("api", A, "stop-ids-float", {"stop_ids": [1.5]}, "token ids", parameter="stop_ids"),
    case("api", A, "stop-ids-str", {"stop_ids": "ab"}, "sequence of token ids", parameter="stop_ids"),
    case("api", A, "stop-not-str", {"stop": [5]}, "must be strings", parameter="stop"),
    case(
        "api",
        A,
        "skip-special-str",
        {"skip_special_tokens": "no"},
        "True or False",
        parameter="skip_special_tokens",
    ),
    case(
        "api",
        A,
        "num-draft-tokens-float",
        {"speculative": "prompt-lookup", "num_draft_tokens": 1.5},
        "must be an integer",
        parameter="num_draft_tokens",
    ),
    case("api", A, "min-ngram-str", {"min_ngram": "1"}, "must be an integer", parameter="min_ngram"),
    case(
        "api",
        A,
        "pipeline-exit-float",
        {"pipeline_exit": 1.5},
        "must be an integer",
        parameter="pipeline_exit",
    ),
    case("api", A, "allow-inexact-str", {"allow_inexact": "yes"}, "True or False", parameter="allow_inexact"),
    case(
        "api", A, "alternate-gap-str", {"alternate_gap": "x"}, "must be a number", parameter="alternate_gap"
    ),
    case("api", A, "generator-str", {"generator": "x"}, "must be a Generator", parameter="generator"),
    case(
        "api",
        A,
        "generator-of-another-model",
        {"generator": "other"},
        "another loaded model",
        parameter="generator",
    ),
    case("api", A, "proposer-strings", {"proposer": Fixed(["5", "6"])}, "'5' (str)", parameter="proposer"),
    case("api", A, "proposer-words", {"proposer": Fixed(["a"])}, "'a' (str)", parameter="proposer"),
    case(
        "api",
        A,
        "proposer-float-array",
        {"proposer": Fixed(np.array([5.2, 6.7]))},
        "float64",
        parameter="proposer",
    ),
    case(
        "api",
        A,
        "proposer-2d-array",
        {"proposer": Fixed(np.zeros((2, 2), np.int64))},
        "returned",
        parameter="proposer",
    ),
    case("api", A, "proposer-int", {"proposer": Fixed(5)}, "returned int", parameter="proposer"),
    case("api", A, "proposer-bools", {"proposer": Fixed([True, False])}, "(bool)", parameter="proposer"),
    case(
        "api",
        A,
        "proposer-out-of-vocab",
        {"proposer": Fixed([10**6])},
        "outside the vocabulary",
        parameter="proposer",
    ),
    case("api", A, "proposer-no-propose", {"proposer": object()}, "no propose", parameter="proposer"),
    case(
        "api",
        A,
        "hidden-wrong-width",
        {"proposer": Fixed(Proposal([5, 6], np.zeros((3, 7), np.float32)), drafts_hidden=True)},
        "shape (3, 7)",
        parameter="proposer",
    ),
    case(
        "api",
        A,
        "hidden-too-few-rows",
        {"proposer": Fixed(Proposal([5, 6], np.zeros((1, 384), np.float32)), drafts_hidden=True)},
        "shape (1, 384)",
        parameter="proposer",
    ),
    case(
        "api",
        A,
        "hidden-int-dtype",
        {"proposer": Fixed(Proposal([5, 6], np.zeros((3, 384), np.int32)), drafts_hidden=True)},
        "of int32",
        parameter="proposer",
    ),
    case(
        "api",
        A,
        "hidden-list",
        {"proposer": Fixed(Proposal([5, 6], [[0.0] * 384] * 3), drafts_hidden=True)},
        "as list",
        parameter="proposer",
    ),
    case(
        "api",
        A,
        "hidden-nan",
        {"proposer": Fixed(Proposal([5, 6], np.full((3, 384), np.nan, np.float32)), drafts_hidden=True)},
        "not finite",
        parameter="proposer",
    ),
    case(
        "api",
        A,
        "hidden-missing",
        {"proposer": Fixed(Proposal([5, 6]), drafts_hidden=True)},
        "no hidden state",
        parameter="proposer",
    ),
]


@pytest.mark.parametrize("row", params(ROWS))
def test_api_argument(row, model, adversarial_artifact) -> None:
    kwargs = {"prompt": IDS, "max_new_tokens": 4, **row.given}
    if kwargs.get("generator") == "other":
        kwargs["generator"] = load(adversarial_artifact, kinds=("prefill", "decode")).new_generator()
    proposer = kwargs.get("proposer")
    if proposer is not None:  # gate "always": the engine asks for drafts at every step
        mode = "self" if getattr(proposer, "drafts_hidden", False) else "custom"
        kwargs.update(speculative=mode, gate="always")
    with pytest.raises(RequestError, match=row.expect.replace("(", r"\(").replace(")", r"\)")) as info:
        model.generate(**kwargs)
    assert info.value.parameter == row.extra["parameter"]
    if isinstance(proposer, Fixed):
        assert proposer.calls >= 1  # refused where the proposal entered the engine


def test_valid_arguments_of_the_same_kinds_are_served(model) -> None:
    """The refusals above are not a blanket: numpy ids, a proposer's int64 array, and None."""
    plain = model.generate(IDS, 4).tokens
    assert model.generate(np.array(IDS, np.int64), 4).tokens == plain
    assert model.generate(tuple(np.int32(t) for t in IDS), 4).tokens == plain
    for out in (np.array([5, 6], np.int64), None, [], [np.int64(5)]):
        got = model.generate(IDS, 4, proposer=Fixed(out), speculative="custom", gate="always")
        assert got.tokens == plain
    assert len(model.generate(IDS, config=GenerationConfig(4, stop_ids=(np.int64(1),))).tokens) <= 4


def test_threads_is_checked_at_load(adversarial_artifact) -> None:
    for threads in (-1, 0, 1.5, True):
        with pytest.raises(RequestError, match="threads must be a positive integer"):
            load(adversarial_artifact, threads=threads)
