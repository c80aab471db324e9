"""Intra-op threading of the runtime's sessions: a pool per session whose threads spin.

A generation alternates several sessions (prefill, decode, verify, draft, cycle, ...) on the
same cores. Threads that sleep after every parallel op pay a wake-up per op, which on the
2-core CPU VM cost a third of a small model's decode step; spinning ones (ONNX Runtime's
default) do not. The cost: spinning threads hold the cores after a run, against the next
session's run and the host's own threads. For one sequence (the CLI, the Python API) spinning
measured faster in every mode; under the batching engine, whose host thread works between
calls beside the clients' threads, it measured 1.8x slower (docs/perf.md, "CPU: spinning
intra-op threads"). So ``load(spin=...)`` chooses: spinning by default, not for the server and
the load generator; ``LOOPCAST_SPIN=0|1`` overrides both.

ORT's process-wide thread pools would remove the overlap too, but once the process has them
every other session in it must use them (ORT refuses any session with a pool of its own), so
a library cannot turn them on for its caller's process.
"""

from __future__ import annotations

import os

import onnxruntime as ort

ENV = "LOOPCAST_SPIN"  # "1" (default): intra-op threads spin between ops; "0": they sleep


def spinning(spin: bool | None = None) -> bool:
    """LOOPCAST_SPIN when set, else ``spin`` (None: spin)."""
    env = os.environ.get(ENV)
    if env in ("0", "1"):
        return env == "1"
    return True if spin is None else spin


def configure(so: ort.SessionOptions, threads: int | None, spin: bool | None = None) -> None:
    """``so``'s intra-op pool: ``threads`` threads (None: ORT's default, one per physical core),
    spinning per ``spinning(spin)``."""
    if threads:
        so.intra_op_num_threads = threads
    so.add_session_config_entry("session.intra_op.allow_spinning", "1" if spinning(spin) else "0")
