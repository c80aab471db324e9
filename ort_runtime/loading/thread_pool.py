"""One intra-op thread pool for every CPU session of the process.

A generation alternates several sessions (prefill, decode, verify, draft, cycle, ...) on the
same cores. With a pool per session, threads that spin after a run starve the next session's
run, so per-session pools must sleep between ops, and on a 2-core CPU that wake-up costs a
third of a small model's decode step. One process-wide pool (ORT's global thread pools) lets
the threads spin: whichever session runs next takes them. Measured on the 2-core CPU VM
(docs/perf.md, "CPU: the shared thread pool"): the demo's plain decode 1.6x faster, a 135M int4
model's 1.48x, the speculative modes alike.

ORT sizes the global pools once per process, before the first session that uses them. A later
request for another size, ``LOOPCAST_THREAD_POOL=per-session``, or an ORT that refuses the
global pools gets the per-session pools without spinning (the behaviour before this module).
"""

from __future__ import annotations

import os
import threading

import onnxruntime as ort

ENV = "LOOPCAST_THREAD_POOL"  # "shared" (default) or "per-session"

_lock = threading.Lock()
_size: int | None = None  # the shared pool's intra-op threads, once made
_refused: str | None = None  # why the shared pool is not used in this process


def _probe() -> None:
    """A one-node session on the global pools: ORT refuses one when its environment was made
    without them (another library's session came first), which then stays so for the process."""
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [helper.make_node("Identity", ["x"], ["y"])],
        "probe",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    so = ort.SessionOptions()
    so.use_per_session_threads = False
    so.log_severity_level = 3
    ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def shared_pool(threads: int | None) -> bool:
    """Whether sessions asking for ``threads`` intra-op threads (None: ORT's default, one per
    physical core) should use the process's shared pool; makes it on the first call."""
    global _size, _refused
    if os.environ.get(ENV, "shared") == "per-session":
        return False
    want = threads or 0  # 0: ORT's default size
    with _lock:
        if _refused is not None:
            return False
        if _size is None:
            try:
                from onnxruntime.capi import _pybind_state

                _pybind_state.set_global_thread_pool_sizes(want, 1)
                _probe()
            except Exception as exc:  # an ORT without global pools, or an environment made before
                _refused = str(exc).splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
                return False
            _size = want
        return _size == want


def configure(so: ort.SessionOptions, threads: int | None) -> str:
    """Set ``so``'s threading: the shared, spinning pool where ``shared_pool`` allows it, else a
    pool of its own that does not spin. Returns which ("shared" or "per-session")."""
    if shared_pool(threads):
        so.use_per_session_threads = False
        return "shared"
    if threads:
        so.intra_op_num_threads = threads
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return "per-session"


def state() -> dict:
    """The process's pool, for inspect/bench reports."""
    return {"shared_threads": _size, "refused": _refused, "env": os.environ.get(ENV, "shared")}
