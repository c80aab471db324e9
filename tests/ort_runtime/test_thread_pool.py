"""The process-wide intra-op pool (ort_runtime/loading/thread_pool.py): loaded sessions share
it, its tokens are the per-session pools' tokens in every speculative mode, and a size it was
not made with, or LOOPCAST_THREAD_POOL=per-session, gets a pool of its own that does not spin."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import onnxruntime as ort
import pytest
from loopcast.ort_runtime.loading import thread_pool

from tests.artifacts import artifact, require_exact_cpu_artifacts

REPO = Path(__file__).resolve().parents[2]

_CHILD = """
import json, sys
from loopcast.ort_runtime import load
from loopcast.ort_runtime.loading import thread_pool
model = load(sys.argv[1])
prompt = [5, 17, 3, 17, 5, 9, 17, 3, 17, 5, 9, 2]
out = {m: list(model.stream_ids(prompt, 12, speculative=m, gate="always"))
       for m in ("none", "prompt-lookup", "self", "pipeline")}
print(json.dumps({"tokens": out, "pool": thread_pool.state()}))
"""


def _run(path: Path, pool: str) -> dict:
    env = {**os.environ, thread_pool.ENV: pool}
    command = [sys.executable, "-c", _CHILD, str(path)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_shared_pool_gives_the_per_session_tokens_in_every_mode():
    require_exact_cpu_artifacts()
    path = artifact("ouro-r3")
    shared, own = _run(path, "shared"), _run(path, "per-session")
    assert shared["pool"]["shared_threads"] is not None and shared["pool"]["refused"] is None
    assert own["pool"]["shared_threads"] is None and own["pool"]["env"] == "per-session"
    assert shared["tokens"] == own["tokens"]
    plain = shared["tokens"]["none"]
    assert len(plain) == 12 and all(tokens == plain for tokens in shared["tokens"].values())


def test_a_size_the_pool_was_not_made_with_gets_a_quiet_pool_of_its_own(monkeypatch):
    monkeypatch.setattr(thread_pool, "_size", 2)
    monkeypatch.setattr(thread_pool, "_refused", None)
    so = ort.SessionOptions()
    assert thread_pool.configure(so, 3) == "per-session"
    assert so.intra_op_num_threads == 3 and so.use_per_session_threads
    assert so.get_session_config_entry("session.intra_op.allow_spinning") == "0"
    so = ort.SessionOptions()
    assert thread_pool.configure(so, 2) == "shared" and not so.use_per_session_threads


@pytest.mark.parametrize("why", ["env", "refused"])
def test_without_the_shared_pool_sessions_do_not_spin(monkeypatch, why):
    if why == "env":
        monkeypatch.setenv(thread_pool.ENV, "per-session")
    else:
        monkeypatch.setattr(thread_pool, "_refused", "global thread pools unavailable")
    so = ort.SessionOptions()
    assert thread_pool.configure(so, None) == "per-session"
    assert so.use_per_session_threads
    assert so.get_session_config_entry("session.intra_op.allow_spinning") == "0"
