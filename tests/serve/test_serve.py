"""`loopcast serve` (serve/app.py): the OpenAI-compatible API over the batching engine.

Must-shows: under 16 concurrent requests every greedy completion equals `loopcast generate` for
the same prompt; streaming works with the `openai` client; malformed requests get 4xx JSON."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")
from click.testing import CliRunner  # noqa: E402
from loopcast.cli import main  # noqa: E402
from loopcast.serve.state import ServeOptions, open_serving  # noqa: E402

from tests.artifacts import artifact, require_exact_cpu_artifacts  # noqa: E402
from tests.ort_runtime.test_generator import DEMO_PROMPTS  # noqa: E402
from tests.serve.helpers import running_server  # noqa: E402

NEW = 24
CHAT_TEMPLATE = (
    "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


@pytest.fixture(scope="module")
def demo_batched(tmp_path_factory):
    """The demo artifact with batched graphs (8 slots) and a chat template."""
    require_exact_cpu_artifacts()
    path = tmp_path_factory.mktemp("serve") / "demo"
    shutil.copytree(artifact("demo", max_batch=8), path)
    (path / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    return path


@pytest.fixture(scope="module")
def server(demo_batched):
    state = open_serving(demo_batched, ServeOptions(model_name="demo"))
    with running_server(state) as url:
        yield url, state


def _generate_cli(path, prompt: str) -> dict:
    result = CliRunner().invoke(
        main, ["generate", str(path), "--prompt", prompt, "--max-new-tokens", str(NEW), "--json"]
    )
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_greedy_completions_equal_generate_under_concurrency_16(server, demo_batched):
    """In every mode the batched server runs (plain, prompt lookup, self-speculation and the
    pipeline in the batch; the prefix cache on, which the later rounds hit: their prompts are the
    first round's)."""
    url, state = server
    prompts = DEMO_PROMPTS[:16]
    expected = {prompt: _generate_cli(demo_batched, prompt) for prompt in prompts}

    def ask(prompt: str, mode: str) -> dict:
        r = httpx.post(
            f"{url}/v1/completions",
            timeout=300,
            json={
                "model": "demo",
                "prompt": prompt,
                "max_tokens": NEW,
                "temperature": 0,
                "return_token_ids": True,
                "speculative": mode,
            },
        )
        assert r.status_code == 200, r.text
        return r.json()

    for mode in state.engine.speculative_modes:
        with ThreadPoolExecutor(16) as pool:
            answers = list(pool.map(ask, prompts, [mode] * len(prompts)))
        for prompt, answer in zip(prompts, answers):
            choice = answer["choices"][0]
            assert choice["token_ids"] == expected[prompt]["tokens"], (mode, prompt)
            assert choice["text"] == expected[prompt]["text"], (mode, prompt)
            assert (
                choice["finish_reason"]
                == {"eos": "stop", "length": "length"}[expected[prompt]["finish_reason"]]
            )
            assert answer["usage"]["completion_tokens"] == len(expected[prompt]["tokens"])
            assert answer["loopcast"]["speculative"] == mode
        assert state.engine.peak_batch == 8  # 16 requests through 8 slots: they queued and joined
    assert state.engine.speculative_modes == ("none", "prompt-lookup", "self", "pipeline")
    assert state.engine.stats["prefix_hits"] > 0 and state.engine.stats["accepted"] > 0
    assert state.engine.stats["self_rounds"] > 0 and state.engine.stats["pipeline_cycles"] > 0


def test_openai_client_streams(server, demo_batched):
    openai = pytest.importorskip("openai")
    url, state = server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
    assert [m.id for m in client.models.list().data] == ["demo"]
    prompt = DEMO_PROMPTS[0]
    whole = client.completions.create(model="demo", prompt=prompt, max_tokens=NEW, temperature=0)
    chunks = list(
        client.completions.create(model="demo", prompt=prompt, max_tokens=NEW, temperature=0, stream=True)
    )
    assert len(chunks) > 3
    assert (
        "".join(c.choices[0].text for c in chunks)
        == whole.choices[0].text
        == state.model.generate(prompt, NEW, skip_special_tokens=True).text
    )
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "def add(a, b):"}]
    chat = client.chat.completions.create(model="demo", messages=messages, max_tokens=NEW, temperature=0)
    stream = client.chat.completions.create(
        model="demo", messages=messages, max_tokens=NEW, temperature=0, stream=True
    )
    pieces = [c.choices[0].delta.content or "" for c in stream]
    expected = state.model.generate(messages=messages, max_new_tokens=NEW, skip_special_tokens=True).text
    assert chat.choices[0].message.role == "assistant"
    assert "".join(pieces) == chat.choices[0].message.content == expected


def test_stop_strings_and_sampling(server):
    url, state = server
    prompt = DEMO_PROMPTS[4]
    full = state.model.generate(prompt, NEW, skip_special_tokens=True).text
    stop = full[len(full) // 2 : len(full) // 2 + 2]
    body = {"model": "demo", "prompt": prompt, "max_tokens": NEW, "temperature": 0, "stop": [stop]}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()
    assert r["choices"][0]["text"] == full[: full.index(stop)] and r["choices"][0]["finish_reason"] == "stop"
    body = {"model": "demo", "prompt": prompt, "max_tokens": 12, "temperature": 0.8, "seed": 5}
    a, b = (httpx.post(f"{url}/v1/completions", json=body, timeout=60).json() for _ in range(2))
    assert a["choices"][0]["text"] == b["choices"][0]["text"]  # a seed fixes the tokens


@pytest.mark.parametrize(
    "body, status, needle",
    [
        (b"{not json", 400, "not valid JSON"),
        (b"[1, 2]", 400, "JSON object"),
        (json.dumps({"prompt": "x"}).encode(), 400, "model"),
        (json.dumps({"model": "other", "prompt": "x"}).encode(), 404, "does not exist"),
        (json.dumps({"model": "demo", "prompt": [7] * 600}).encode(), 400, "maximum context length"),
        (json.dumps({"model": "demo", "prompt": "x", "max_tokens": 0}).encode(), 400, "max_tokens"),
        (json.dumps({"model": "demo", "prompt": "x", "temperature": -1}).encode(), 400, "temperature"),
        (json.dumps({"model": "demo", "prompt": "x", "n": 2}).encode(), 400, "n"),
        (json.dumps({"model": "demo", "prompt": ["a", "b"]}).encode(), 400, "one prompt"),
        (json.dumps({"model": "demo", "prompt": [10**9]}).encode(), 400, "vocabulary"),
        (json.dumps({"model": "demo", "prompt": "x", "stop": [""]}).encode(), 400, "stop"),
        (json.dumps({"model": "demo", "prompt": "x", "echo": True}).encode(), 400, "echo"),
    ],
)
def test_bad_requests_get_json_errors(server, body, status, needle):
    url, _ = server
    r = httpx.post(
        f"{url}/v1/completions", content=body, headers={"content-type": "application/json"}, timeout=30
    )
    assert r.status_code == status, r.text
    assert needle in r.json()["error"]["message"]
    chat = httpx.post(f"{url}/v1/chat/completions", json={"model": "demo", "messages": []}, timeout=30)
    assert chat.status_code == 400 and "messages" in chat.json()["error"]["message"]
    assert httpx.get(f"{url}/health", timeout=10).json()["status"] == "ok"  # still serving


def test_full_queue_is_503(demo_batched):
    state = open_serving(demo_batched, ServeOptions(model_name="demo", max_waiting=0))
    with running_server(state) as url:
        r = httpx.post(f"{url}/v1/completions", json={"model": "demo", "prompt": "x"}, timeout=30)
    assert r.status_code == 503 and r.json()["error"]["code"] == "server_busy"


def test_serve_without_the_extra_says_which_to_install(demo_batched):
    code = (
        "import sys; sys.modules['fastapi'] = None; from loopcast.cli import main; "
        f"main(['serve', {str(demo_batched)!r}])"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "error: loopcast serve needs fastapi: install the serve extra (pip install 'loopcast[serve]')"
    ]


def test_prompt_lookup_per_request(server, demo_batched):
    """A request may ask for prompt-lookup speculation: same greedy text, and the response says
    which speculation served it, for a sampled request too."""
    url, state = server
    prompt = "    self.assertEqual(a, b)\n    self.assertEqual(a, b)\n    self.assertEqual("
    body = {
        "model": "demo",
        "prompt": prompt,
        "max_tokens": NEW,
        "temperature": 0,
        "return_token_ids": True,
        "speculative": "prompt-lookup",
    }
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=120).json()
    assert r["choices"][0]["token_ids"] == _generate_cli(demo_batched, prompt)["tokens"]
    assert r["loopcast"]["speculative"] == "prompt-lookup"
    sampled = httpx.post(
        f"{url}/v1/completions", json={**body, "temperature": 0.7, "seed": 1}, timeout=120
    ).json()
    assert sampled["loopcast"]["speculative"] == "prompt-lookup"
    # the batched pipeline's accept rule is greedy: a sampled request decodes plainly and says why
    piped = httpx.post(
        f"{url}/v1/completions", json={**body, "speculative": "pipeline", "temperature": 0.7}, timeout=120
    ).json()
    assert piped["loopcast"]["speculative"] == "none (the batched pipeline runs greedy requests only)"


def test_client_disconnect_cancels(server):
    """A streaming client that goes away mid-stream frees its slot (the request is cancelled)."""
    url, state = server
    body = {
        "model": "demo",
        "prompt": "def f():",
        "max_tokens": 400,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
    }
    steps = state.engine.steps
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                break
    import time

    deadline = time.monotonic() + 30
    while state.engine.running and time.monotonic() < deadline:
        time.sleep(0.05)
    assert state.engine.running == 0 and state.engine.waiting == 0
    assert state.engine.steps - steps < 300  # cancelled, not run to its 400 tokens


def test_sequential_without_batched_graphs():
    """An artifact without --max-batch is served one request at a time, with the same tokens."""
    require_exact_cpu_artifacts()
    path = artifact("ouro-r3")
    state = open_serving(path, ServeOptions(model_name="tiny"))
    with running_server(state) as url:
        assert "sequential" in httpx.get(f"{url}/health", timeout=10).json()["mode"]
        r = httpx.post(
            f"{url}/v1/completions",
            json={
                "model": "tiny",
                "prompt": [1, 2, 3],
                "max_tokens": 6,
                "temperature": 0,
                "return_token_ids": True,
            },
            timeout=60,
        )
    assert r.json()["choices"][0]["token_ids"] == list(state.model.stream_ids([1, 2, 3], 6))
    with pytest.raises(Exception, match="--max-batch"):
        open_serving(path, ServeOptions(max_batch=4))


def test_error_bodies_name_the_model_not_the_servers_paths(tmp_path):
    """An artifact without a chat template (the demo's own): the 400 says so about the served
    model, never where the artifact lies on the server (nor any other absolute path)."""
    require_exact_cpu_artifacts()
    path = tmp_path / "demo"
    shutil.copytree(artifact("demo", max_batch=8), path)
    state = open_serving(path, ServeOptions(model_name="demo"))
    with running_server(state) as url:
        r = httpx.post(
            f"{url}/v1/chat/completions",
            json={"model": "demo", "messages": [{"role": "user", "content": "hi"}]},
            timeout=30,
        )
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert "chat template" in message and "model 'demo'" in message
    assert str(path) not in r.text and str(path.resolve()) not in r.text
    assert str(tmp_path) not in r.text and "/root" not in r.text


def test_public_messages_scrub_paths(demo_batched):
    state = open_serving(demo_batched, ServeOptions(model_name="demo"))
    try:
        where = str(demo_batched.resolve())
        assert state.public(f"{where}: broken") == "model 'demo': broken"
        assert state.public("read /etc/loopcast/x.json failed") == "read <path> failed"
        assert state.public("need 1 <= k <= 4, got 5 (a/b ok)") == "need 1 <= k <= 4, got 5 (a/b ok)"
    finally:
        state.close()


def test_requests_are_logged_with_tokens_and_time(server, caplog):
    import logging

    url, _ = server
    with caplog.at_level(logging.INFO, logger="uvicorn.error"):
        r = httpx.post(
            f"{url}/v1/completions", json={"model": "demo", "prompt": "x", "max_tokens": 3}, timeout=30
        )
        assert r.status_code == 200, r.text
    lines = [rec.getMessage() for rec in caplog.records if rec.name == "uvicorn.error"]
    assert any("/v1/completions: prompt" in line and "completion 3 tokens" in line for line in lines), lines


def test_extreme_sampling_values_answer_normally(server):
    url, _ = server
    for extra in ({"temperature": 1e-320, "seed": 1}, {"temperature": 2, "seed": 1}):
        r = httpx.post(
            f"{url}/v1/completions",
            json={"model": "demo", "prompt": "x", "max_tokens": 4, **extra},
            timeout=30,
        )
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 4
