"""Graph-slot bookkeeping (docs/architecture.md §5) without a GPU: the counters follow ORT's
warm-up / capture / replay rule per graph id, every generator gets its own id per kind, and a
slot whose capture fails falls back to an eager session with identical tokens.

The CUDA-graph behaviour itself is checked on the GPU (tests/ort_runtime/test_cuda.py); here
CPU sessions stand in, which accept and ignore the ``gpu_graph_id`` run option.
"""

from __future__ import annotations

import dataclasses

import pytest
from loopcast.ort_runtime import load
from loopcast.ort_runtime.api import LoopcastModel

from loopcast.manifest import DECODE, DRAFT, VERIFY, VERIFY_TAIL
from tests.artifacts import artifact

PROMPT = "def merge(left, right):\n    result = []\n"
HOT = frozenset({DECODE, VERIFY, DRAFT, VERIFY_TAIL})


class _FailingCapture:
    """A session whose run with a graph id fails (ORT warms up and captures inside the first
    run of a graph id, so that is where a capture failure surfaces)."""

    def __init__(self, session, always: bool = False) -> None:
        self._session, self.always = session, always

    def __getattr__(self, name):
        return getattr(self._session, name)

    def run_with_iobinding(self, binding, run_options=None):
        if run_options is not None or self.always:
            raise RuntimeError("CUDA failure 901: operation not permitted when stream is capturing")
        return self._session.run_with_iobinding(binding, run_options)


def _as_captured(
    model: LoopcastModel, failing: frozenset[str] = frozenset(), eager_fails: bool = False
) -> LoopcastModel:
    loaded = model.loaded
    sessions = {k: _FailingCapture(s) if k in failing else s for k, s in loaded.sessions.items()}

    def factory(kind, capture):  # the eager stand-in
        return _FailingCapture(loaded.sessions[kind], always=True) if eager_fails else loaded.sessions[kind]

    return LoopcastModel(
        dataclasses.replace(
            loaded,
            sessions=sessions,
            graph_kinds=HOT & set(sessions),
            _graph_ids={},
            _eager={},
            _session_factory=factory,
        )
    )


@pytest.fixture(scope="module")
def demo():
    return load(artifact("demo", draft_depth=1))


def test_counters_follow_warmup_capture_replay(demo) -> None:
    model = _as_captured(demo)
    gen = model.new_generator()
    out = model.generate(
        PROMPT, 40, stop_ids=(), speculative="self", generator=gen, gate="always", allow_inexact=True
    )
    slots = gen.graph_slots()
    assert set(slots) == set(HOT)
    for kind, slot in slots.items():
        runs = out.stats.steps.get(kind, 0)
        if runs:
            assert slot["warmups"] == 1 and slot["captures"] == 1 and slot["replays"] == runs - 1
        assert slot["fallbacks"] == 0 and slot["failure"] is None


def test_each_generator_gets_its_own_graph_id_per_kind(demo) -> None:
    model = _as_captured(demo)
    a, b = model.new_generator(), model.new_generator()
    ids_a = {k: v["graph_id"] for k, v in a.graph_slots().items()}
    ids_b = {k: v["graph_id"] for k, v in b.graph_slots().items()}
    assert all(ids_a[k] != ids_b[k] for k in ids_a)  # a captured graph holds its generator's buffers


@pytest.mark.parametrize("mode", ["none", "self", "prompt-lookup"])
def test_failed_capture_falls_back_to_eager_with_the_same_tokens(demo, mode: str) -> None:
    plain = demo.generate(PROMPT, 48, stop_ids=(), speculative=mode, gate="always", allow_inexact=True)
    model = _as_captured(demo, failing=frozenset({DECODE, VERIFY_TAIL, VERIFY}))
    gen = model.new_generator()
    out = model.generate(
        PROMPT, 48, stop_ids=(), speculative=mode, generator=gen, gate="always", allow_inexact=True
    )
    assert out.tokens == plain.tokens
    slots = gen.graph_slots()
    for kind in (DECODE, VERIFY_TAIL, VERIFY):
        runs = out.stats.steps.get(kind, 0)
        if runs:
            assert slots[kind]["failure"].startswith("CUDA failure 901")
            assert slots[kind]["fallbacks"] == runs and slots[kind]["replays"] == 0


def test_an_error_that_is_not_about_capture_is_raised_naming_the_kind(demo) -> None:
    """If the graph also fails without capture, the slot does not pretend to fall back."""
    from loopcast.errors import ArtifactError

    model = _as_captured(demo, failing=frozenset({DECODE}), eager_fails=True)
    gen = model.new_generator()
    gen.prefill(model.encode(PROMPT))
    with pytest.raises(ArtifactError, match="'decode' graph failed on its first run"):
        gen.decode(5)
    assert gen.graph_slots()[DECODE]["failure"] is None


def test_cost_measurements_skip_a_slots_first_run(demo) -> None:
    model = _as_captured(demo)
    gen = model.new_generator()
    model.generate(PROMPT, 12, stop_ids=(), generator=gen)
    assert gen.clock.runs(DECODE) == gen.clock.steady(DECODE) + 1
