"""The capture/replay/fallback runner and the graph-id pool (ort_runtime/binding/graph_runner.py,
ort_runtime/loading/artifact.py ``GraphIdPool``), without a GPU.

Stand-in sessions play ORT's part: a run under a ``gpu_graph_id`` is where ORT captures, so a
capture failure is a first run with run options that raises. The graph itself is a tiny
function of the bound buffers (out = 2 * x + 1), so eager and "captured" outputs can be compared.
"""

from __future__ import annotations

import gc

import numpy as np
import pytest
from loopcast.ort_runtime.binding.graph_runner import CapturedRunner
from loopcast.ort_runtime.loading.graph_ids import GraphIdPool

from loopcast.errors import ArtifactError, RequestError


class _Value:
    """An OrtValue stand-in over a numpy array (what ``bind_ortvalue_*`` receives)."""

    def __init__(self, array: np.ndarray) -> None:
        self.array = array

    def data_ptr(self) -> int:
        return self.array.ctypes.data

    def shape(self) -> list[int]:
        return list(self.array.shape)


class _Binding:
    def __init__(self) -> None:
        self.inputs: dict[str, _Value] = {}
        self.outputs: dict[str, _Value] = {}

    def bind_ortvalue_input(self, name, value) -> None:
        self.inputs[name] = value

    def bind_ortvalue_output(self, name, value) -> None:
        self.outputs[name] = value


class _Session:
    """Computes out = 2 * x + 1 on its binding; ``fail_captured`` makes every run under a graph id
    raise (a capture failure), ``fail_eager`` every run without one."""

    def __init__(self, fail_captured: bool = False, fail_eager: bool = False) -> None:
        self.fail_captured, self.fail_eager = fail_captured, fail_eager
        self.graph_ids: list[str] = []

    def io_binding(self) -> _Binding:
        return _Binding()

    def run_with_iobinding(self, binding: _Binding, run_options=None) -> None:
        if run_options is not None:
            graph_id = run_options.get_run_config_entry("gpu_graph_id")
            if self.fail_captured:
                raise RuntimeError("CUDA failure 901: operation not permitted when stream is capturing")
            self.graph_ids.append(graph_id)
        elif self.fail_eager:
            raise RuntimeError("bad kernel")
        binding.outputs["out"].array[...] = 2 * binding.inputs["x"].array + 1


class _Buffers:
    def __init__(self) -> None:
        self.x, self.out = np.zeros(4, np.float32), np.zeros(4, np.float32)

    def bind(self, binding) -> None:
        binding.bind_ortvalue_input("x", _Value(self.x))
        binding.bind_ortvalue_output("out", _Value(self.out))


def _outputs(runner: CapturedRunner, bufs: _Buffers, steps: int) -> tuple[list[list[float]], list[bool]]:
    outs, steady = [], []
    for step in range(steps):
        bufs.x[...] = step
        steady.append(runner.run())
        outs.append(bufs.out.tolist())
    return outs, steady


def test_eager_runner_first_run_is_not_steady() -> None:
    bufs = _Buffers()
    runner = CapturedRunner("decode", _Session(), bufs.bind)
    outs, steady = _outputs(runner, bufs, 3)
    assert runner.slot is None and runner.runs == 3
    assert steady == [False, True, True]
    assert outs == [[2 * s + 1] * 4 for s in range(3)]


def test_captured_runner_counts_capture_then_replays() -> None:
    bufs, session, pool = _Buffers(), _Session(), GraphIdPool()
    runner = CapturedRunner("decode", session, bufs.bind, pool=pool, eager_session=_Session)
    outs, steady = _outputs(runner, bufs, 4)
    slot = runner.slot
    assert slot.graph_id == 1 and session.graph_ids == ["1"] * 4
    assert (slot.warmups, slot.captures, slot.replays, slot.fallbacks, slot.failure) == (1, 1, 3, 0, None)
    assert steady == [False, True, True, True]
    assert outs == [[2 * s + 1] * 4 for s in range(4)]


def test_failed_capture_falls_back_for_good_with_identical_outputs() -> None:
    eager_bufs = _Buffers()
    expected, _ = _outputs(CapturedRunner("verify", _Session(), eager_bufs.bind), eager_bufs, 5)
    eager = _Session()
    bufs = _Buffers()
    runner = CapturedRunner(
        "verify", _Session(fail_captured=True), bufs.bind, pool=GraphIdPool(), eager_session=lambda: eager
    )
    outs, steady = _outputs(runner, bufs, 5)
    assert outs == expected
    assert steady == [False, True, True, True, True]  # the failed first run is not a steady one
    slot = runner.slot
    assert slot.failure.startswith("CUDA failure 901") and slot.fallbacks == 5
    assert (slot.runs, slot.replays) == (0, 0) and runner.session is eager and runner.runs == 5


def test_failure_without_capture_is_raised_naming_the_kind() -> None:
    bufs = _Buffers()
    runner = CapturedRunner(
        "draft",
        _Session(fail_captured=True),
        bufs.bind,
        pool=GraphIdPool(),
        eager_session=lambda: _Session(fail_eager=True),
    )
    with pytest.raises(ArtifactError, match="'draft' graph failed on its first run .bad kernel."):
        runner.run()
    assert runner.slot.failure is None and runner.runs == 0


def test_a_failing_replay_is_surfaced() -> None:
    bufs, session = _Buffers(), _Session()
    runner = CapturedRunner("decode", session, bufs.bind, pool=GraphIdPool(), eager_session=_Session)
    runner.run()
    session.fail_captured = True
    with pytest.raises(RuntimeError, match="901"):
        runner.run()
    assert runner.slot.failure is None


def test_pool_ids_start_at_one_and_are_held_once() -> None:
    pool = GraphIdPool()
    assert [pool.acquire("a"), pool.acquire("a"), pool.acquire("b")] == [1, 2, 3]
    assert pool.held() == {1, 2, 3}
    pool.release(2, "a")
    with pytest.raises(ValueError, match="not held"):
        pool.release(2, "a")


def test_pool_recycles_an_id_only_with_its_buffers() -> None:
    pool = GraphIdPool()
    first = pool.acquire("buffers-A")
    pool.release(first, "buffers-A")
    assert pool.acquire("buffers-B") == 2  # other buffers: the old graph would replay on A's
    assert pool.acquire("buffers-A") == first  # the same buffers: its graph reads and writes them
    assert pool.issued() == 2


def test_pool_hands_an_id_that_never_ran_to_anyone() -> None:
    pool = GraphIdPool()
    idle = pool.acquire("buffers-A")
    pool.release(idle, None)
    assert pool.acquire("buffers-B") == idle


def test_closed_runner_gives_its_id_back_keyed_by_its_buffers() -> None:
    pool, bufs = GraphIdPool(), _Buffers()
    a = CapturedRunner("decode", _Session(), bufs.bind, pool=pool, eager_session=_Session)
    a.run()
    a.close()
    a.close()  # idempotent
    assert pool.held() == frozenset()
    with pytest.raises(RequestError, match="closed"):
        a.run()
    other = _Buffers()
    b = CapturedRunner("decode", _Session(), other.bind, pool=pool, eager_session=_Session)
    assert b.slot.graph_id != a.slot.graph_id  # different buffers: a fresh id
    c = CapturedRunner("decode", _Session(), bufs.bind, pool=pool, eager_session=_Session)
    assert c.slot.graph_id == a.slot.graph_id  # the same buffers take the captured id over


def test_a_dropped_runner_releases_its_id() -> None:
    pool, bufs = GraphIdPool(), _Buffers()
    runner = CapturedRunner("decode", _Session(), bufs.bind, pool=pool, eager_session=_Session)
    assert pool.held() == {1}
    del runner
    gc.collect()
    assert pool.held() == frozenset()
    fresh = _Buffers()
    again = CapturedRunner("decode", _Session(), fresh.bind, pool=pool, eager_session=_Session)
    assert again.slot.graph_id == 1  # it never ran: no graph under it, any binding may take it


def test_live_runners_never_share_an_id() -> None:
    pool, bufs = GraphIdPool(), _Buffers()
    runners = [
        CapturedRunner("decode", _Session(), bufs.bind, pool=pool, eager_session=_Session) for _ in range(3)
    ]
    assert len({r.slot.graph_id for r in runners}) == 3


def test_generators_give_their_ids_back(demo_captured) -> None:
    """A dropped generator's slots go back to the pools; the ids of live ones stay held."""
    from loopcast.manifest import DECODE

    loaded = demo_captured.loaded
    keep, drop = demo_captured.new_generator(), demo_captured.new_generator()
    keep.prefill(demo_captured.encode("def f(x):"))
    keep.decode(5)
    pool = loaded.graph_ids(DECODE)
    assert len(pool.held()) == 2
    del drop
    gc.collect()
    assert pool.held() == {keep.graph_slots()[DECODE]["graph_id"]}
    keep.close()  # closing gives them back without waiting for the collector
    assert pool.held() == frozenset()


def test_batch_generator_close_gives_its_ids_back() -> None:
    import dataclasses

    from loopcast.ort_runtime import load
    from loopcast.ort_runtime.binding.batch_generator import BatchGenerator

    from loopcast.manifest import DECODE_BATCH
    from tests.artifacts import artifact

    loaded = load(artifact("ouro-r3", max_batch=4)).loaded
    fake = dataclasses.replace(
        loaded, _session_factory=lambda kind, capture: loaded.sessions[kind], _captured={}, _graph_ids={}
    )
    bg = BatchGenerator(fake, cuda_graphs="always")
    for slot in (0, 1):
        bg.prefill(slot, [1, 2, 3])
    bg.decode({0: 4, 1: 5})
    bg.decode({0: 4})
    pool = fake.graph_ids(DECODE_BATCH)
    assert len(pool.held()) == 2 and bg.graph_runs == {(DECODE_BATCH, 2): 1, (DECODE_BATCH, 1): 1}
    bg.close()
    assert pool.held() == frozenset()
    with pytest.raises(RequestError, match="closed"):
        bg.decode({0: 4})


@pytest.fixture(scope="module")
def demo_captured():
    from loopcast.ort_runtime import load

    from tests.artifacts import artifact
    from tests.ort_runtime.test_graph_slots import _as_captured

    return _as_captured(load(artifact("demo", draft_depth=1)))
