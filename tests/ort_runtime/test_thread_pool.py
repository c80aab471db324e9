"""Intra-op threading (ort_runtime/loading/thread_pool.py): the runtime's sessions spin by
default, sleep with load(spin=False) or LOOPCAST_SPIN=0 (which overrides either way), with the
same tokens in every speculative mode; the server's sessions sleep."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import onnxruntime as ort
from loopcast.ort_runtime.loading import thread_pool

from tests.artifacts import artifact, require_exact_cpu_artifacts

REPO = Path(__file__).resolve().parents[2]

_CHILD = """
import json, sys
from loopcast.ort_runtime import load
model = load(sys.argv[1])
prompt = [5, 17, 3, 17, 5, 9, 17, 3, 17, 5, 9, 2]
out = {m: list(model.stream_ids(prompt, 12, speculative=m, gate="always"))
       for m in ("none", "prompt-lookup", "self", "pipeline")}
spin = {k: s.get_session_options().get_session_config_entry("session.intra_op.allow_spinning")
        for k, s in model.loaded.sessions.items()}
print(json.dumps({"tokens": out, "spin": sorted(set(spin.values()))}))
"""


def _run(path: Path, spin: str) -> dict:
    env = {**os.environ, thread_pool.ENV: spin}
    command = [sys.executable, "-c", _CHILD, str(path)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_spinning_and_sleeping_threads_give_the_same_tokens_in_every_mode():
    require_exact_cpu_artifacts()
    path = artifact("ouro-r3")
    spinning, sleeping = _run(path, "1"), _run(path, "0")
    assert spinning["spin"] == ["1"] and sleeping["spin"] == ["0"]
    assert spinning["tokens"] == sleeping["tokens"]
    plain = spinning["tokens"]["none"]
    assert len(plain) == 12 and all(tokens == plain for tokens in spinning["tokens"].values())


def test_configure_sets_the_threads_and_the_spin(monkeypatch):
    so = ort.SessionOptions()
    thread_pool.configure(so, 3)
    assert so.intra_op_num_threads == 3 and so.use_per_session_threads
    assert so.get_session_config_entry("session.intra_op.allow_spinning") == "1"
    for env, spin, want in (("", False, "0"), ("0", True, "0"), ("1", False, "1"), ("", None, "1")):
        if env:
            monkeypatch.setenv(thread_pool.ENV, env)
        else:
            monkeypatch.delenv(thread_pool.ENV, raising=False)
        so = ort.SessionOptions()
        thread_pool.configure(so, None, spin)
        assert so.intra_op_num_threads == 0
        assert so.get_session_config_entry("session.intra_op.allow_spinning") == want, (env, spin)


def test_the_server_loads_with_sleeping_threads(tmp_path, monkeypatch):
    require_exact_cpu_artifacts()
    from loopcast.serve.state import ServeOptions, open_serving

    monkeypatch.delenv(thread_pool.ENV, raising=False)
    state = open_serving(artifact("ouro-r3"), ServeOptions(sequential=True))
    try:
        spin = {
            s.get_session_options().get_session_config_entry("session.intra_op.allow_spinning")
            for s in state.model.loaded.sessions.values()
        }
        assert spin == {"0"}
    finally:
        state.engine.shutdown()
