"""`loopcast serve --ray`: the same app as a Ray Serve application, 2 replicas on a local CPU
cluster, concurrent requests, every greedy answer equal to the Python API's. Bounded: the
server is a subprocess with deadlines on start-up (150 s) and on every request; it is skipped
only when Ray itself cannot start a local cluster."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("ray")
httpx = pytest.importorskip("httpx")

from loopcast.ort_runtime import load  # noqa: E402

from tests.artifacts import artifact, require_exact_cpu_artifacts  # noqa: E402
from tests.ort_runtime.test_generator import DEMO_PROMPTS  # noqa: E402
from tests.serve.helpers import free_port  # noqa: E402

START_DEADLINE_S = 150
RAY_START_FAILURES = ("Failed to start", "ray.init", "Could not start", "RaySystemError", "GCS")


@pytest.mark.ray
def test_ray_serve_two_replicas():
    require_exact_cpu_artifacts()
    path = artifact("demo", max_batch=8)
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "loopcast.cli",
        "serve",
        str(path),
        "--ray",
        "--replicas",
        "2",
        "--replica-cpus",
        "0.5",
        "--threads",
        "1",
        "--port",
        str(port),
        "--model-name",
        "demo",
    ]
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_DEADLINE_S
        pids = set()
        while len(pids) < 2:
            if proc.poll() is not None:
                out = proc.stdout.read()
                if any(s in out for s in RAY_START_FAILURES) and "serving" not in out:
                    pytest.skip(f"Ray could not start a local cluster here: {out[-400:]}")
                pytest.fail(f"loopcast serve --ray exited with {proc.returncode}:\n{out[-2000:]}")
            assert time.monotonic() < deadline, f"no 2 replicas answering within {START_DEADLINE_S} s"
            try:
                r = httpx.get(f"{url}/health", timeout=5)
                if r.status_code == 200:
                    pids.add(r.json()["pid"])
                    continue
            except httpx.TransportError:
                pass
            time.sleep(1.0)

        model = load(path)
        prompts = DEMO_PROMPTS[:8]

        def ask(prompt: str) -> list[int]:
            r = httpx.post(
                f"{url}/v1/completions",
                timeout=120,
                json={
                    "model": "demo",
                    "prompt": prompt,
                    "max_tokens": 16,
                    "temperature": 0,
                    "return_token_ids": True,
                },
            )
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["token_ids"]

        with ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(ask, prompts))
        assert answers == [list(model.stream_ids(p, 16)) for p in prompts]
        bad = httpx.post(f"{url}/v1/completions", json={"model": "nope", "prompt": "x"}, timeout=30)
        assert bad.status_code == 404
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGINT)  # the CLI shuts Serve and Ray down on Ctrl-C
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
