"""The request body's generation options (serve/request_fields.py), ``chat_template_kwargs``,
``/v1/models``' capabilities and the prefix cache seen through the API (``cached_tokens``)."""

from __future__ import annotations

import json
import shutil

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")
from click.testing import CliRunner  # noqa: E402
from loopcast.cli import main  # noqa: E402
from loopcast.ort_runtime.batching.engine import BatchRequest  # noqa: E402
from loopcast.serve.state import ServeOptions, open_serving  # noqa: E402

from loopcast.errors import RequestError  # noqa: E402
from tests.artifacts import artifact, require_exact_cpu_artifacts  # noqa: E402
from tests.serve.helpers import running_server  # noqa: E402

NEW = 12
# A template with a variable of its own, as the Thinking variants' enable_thinking.
THINKING_TEMPLATE = (
    "{% if enable_thinking is defined and not enable_thinking %}/no_think\n{% endif %}"
    "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    require_exact_cpu_artifacts()
    path = tmp_path_factory.mktemp("serve-requests") / "demo"
    shutil.copytree(artifact("demo", max_batch=8), path)
    (path / "chat_template.jinja").write_text(THINKING_TEMPLATE)
    return path


@pytest.fixture(scope="module")
def server(demo):
    state = open_serving(demo, ServeOptions(model_name="demo"))
    with running_server(state) as url:
        yield url, state


def chat(url: str, messages: list[dict], **extra) -> httpx.Response:
    body = {
        "model": "demo",
        "messages": messages,
        "max_tokens": NEW,
        "temperature": 0,
        "return_token_ids": True,
    }
    return httpx.post(f"{url}/v1/chat/completions", json={**body, **extra}, timeout=120)


def test_multi_turn_chat_reuses_the_first_turns_kv(server):
    """The second turn's prompt starts with the first turn's prompt and answer: their KV is
    reused (cached_tokens > 0), and the tokens are those of a cold single-sequence generation."""
    url, state = server
    system = {"role": "system", "content": "You write short Python functions. " * 4}
    turn1 = [system, {"role": "user", "content": "def add(a, b):"}]
    first = chat(url, turn1).json()
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    answer = first["choices"][0]["message"]["content"]
    turn2 = turn1 + [{"role": "assistant", "content": answer}, {"role": "user", "content": "def sub(a, b):"}]
    second = chat(url, turn2).json()
    cold = state.model.generate(messages=turn2, max_new_tokens=NEW)
    assert second["choices"][0]["token_ids"] == cold.tokens
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert len(state.chat_ids(turn1)) <= cached < second["usage"]["prompt_tokens"]


def test_chat_template_kwargs(server, demo):
    url, state = server
    messages = [{"role": "user", "content": "def mul(a, b):"}]
    off = chat(url, messages, chat_template_kwargs={"enable_thinking": False}).json()
    on = chat(url, messages).json()
    api = state.model.generate(
        messages=messages, max_new_tokens=NEW, chat_template_kwargs={"enable_thinking": False}
    )
    assert off["choices"][0]["token_ids"] == api.tokens
    assert off["usage"]["prompt_tokens"] == on["usage"]["prompt_tokens"] + len(
        state.model.encode("/no_think\n")
    )
    cli = CliRunner().invoke(
        main,
        [
            "generate",
            str(demo),
            "--chat",
            "def mul(a, b):",
            "--chat-template-kwargs",
            '{"enable_thinking": false}',
            "--max-new-tokens",
            str(NEW),
            "--json",
        ],
    )
    assert cli.exit_code == 0, cli.output
    assert json.loads(cli.stdout)["tokens"] == api.tokens
    bad = CliRunner().invoke(main, ["generate", str(demo), "--chat", "x", "--chat-template-kwargs", "{nope"])
    assert bad.exit_code == 2 and "--chat-template-kwargs is not valid JSON" in bad.output
    for kwargs, needle in (({"messages": []}, "cannot set 'messages'"), ([1], "chat_template_kwargs")):
        r = chat(url, messages, chat_template_kwargs=kwargs)
        assert r.status_code == 400 and needle in r.json()["error"]["message"]
        assert r.json()["error"]["param"] == "chat_template_kwargs"
    with pytest.raises(RequestError, match="goes with messages"):
        state.model.generate("x", 2, chat_template_kwargs={"enable_thinking": True})


@pytest.mark.parametrize(
    "extra, param, needle",
    [
        ({"speculative": "bogus"}, "speculative", "must be one of"),
        ({"speculative": "prompt-lookup", "num_draft_tokens": 9}, "num_draft_tokens", "1..4"),
        ({"num_draft_tokens": 0}, "num_draft_tokens", "greater than or equal to 1"),
        ({"min_ngram": 3, "max_ngram": 2}, "min_ngram", "min_ngram"),
        # adaptive depth: validated, then refused by the batching engine (every loop, batched)
        ({"loops": 2}, "loops", "batching engine"),
        ({"exit_threshold": 0.3, "kv_policy": "last-exited"}, "exit_threshold", "batching engine"),
        ({"exit_threshold": 1.5}, "exit_threshold", "(0, 1]"),
        ({"loops": 0}, "loops", "positive integer"),
        ({"exit_threshold": 0.3, "kv_policy": "partial"}, "kv_policy", "must be one of"),
        ({"min_loops": 2}, "min_loops", "need exit_threshold"),
    ],
)
def test_generation_fields_are_validated(server, extra, param, needle):
    url, _ = server
    body = {"model": "demo", "prompt": "x", "max_tokens": 2, **extra}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and needle in error["message"] and error["type"] == "invalid_request_error"


def test_num_draft_tokens_and_ngrams_per_request(server):
    url, state = server
    prompt = "    self.assertEqual(a, b)\n    self.assertEqual(a, b)\n    self.assertEqual("
    body = {"model": "demo", "prompt": prompt, "max_tokens": 16, "temperature": 0, "return_token_ids": True}
    plain = state.model.generate(prompt, 16).tokens
    for extra in ({"num_draft_tokens": 1}, {"min_ngram": 2, "max_ngram": 4}):
        r = httpx.post(
            f"{url}/v1/completions", json={**body, "speculative": "prompt-lookup", **extra}, timeout=60
        )
        answer = r.json()
        assert answer["choices"][0]["token_ids"] == plain
        assert answer["loopcast"]["speculative"] == "prompt-lookup"


def test_models_reports_what_the_artifact_supports(server):
    url, state = server
    card = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]
    caps = card["loopcast"]
    assert card["max_model_len"] == caps["max_model_len"] == state.max_length
    assert caps["max_batch"] == 8
    assert caps["speculative_modes"] == ["none", "prompt-lookup", "self", "pipeline"]
    batched = {"decode_batch", "verify_batch", "draft_batch", "verify_tail_batch", "cycle_batch"}
    assert {"prefill"} | batched <= set(caps["graph_kinds"])
    assert caps["draft_depth"] == state.model.loaded.manifest.draft_depth >= 1
    assert caps["self_speculation"] == "on"
    assert caps["prefix_caching"] == "on" and caps["exact_verify"] is True


def test_sequential_engine_serves_the_artifacts_own_modes():
    """Without batched graphs one request runs at a time, so every mode the artifact's graphs
    allow is served per request (and answers plain greedy's tokens)."""
    require_exact_cpu_artifacts()
    state = open_serving(artifact("ouro-r3"), ServeOptions(model_name="tiny"))
    with running_server(state) as url:
        caps = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["loopcast"]
        assert caps["speculative_modes"][:3] == ["none", "prompt-lookup", "self"]
        body = {"model": "tiny", "prompt": [1, 2, 3, 1, 2], "max_tokens": 10, "temperature": 0}
        plain = list(state.model.stream_ids([1, 2, 3, 1, 2], 10))
        for mode in caps["speculative_modes"]:
            r = httpx.post(
                f"{url}/v1/completions",
                json={**body, "speculative": mode, "return_token_ids": True},
                timeout=60,
            ).json()
            assert r["choices"][0]["token_ids"] == plain, mode
            assert r["loopcast"]["speculative"] == mode
        # an option the one-sequence engine refuses for its mode is the client's error
        r = httpx.post(
            f"{url}/v1/completions", json={**body, "speculative": "self", "num_draft_tokens": 9}, timeout=60
        )
        assert r.status_code == 400 and "num_draft_tokens" in r.json()["error"]["message"], r.text
        # adaptive depth per request (vllm-rlt's field names): the tokens of the API's generate
        for extra in ({"loops": 2}, {"exit_threshold": 0.4, "kv_policy": "last-exited", "max_loops": 2}):
            r = httpx.post(
                f"{url}/v1/completions", json={**body, **extra, "return_token_ids": True}, timeout=60
            )
            want = state.model.generate([1, 2, 3, 1, 2], 10, **extra).tokens
            assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] == want, (extra, r.text)
        r = httpx.post(f"{url}/v1/completions", json={**body, "loops": 4}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "loops", r.text
    # with cycle_batch the batching engine serves the pipeline too, as the default mode if asked
    batched = open_serving(artifact("ouro-r3", max_batch=4), ServeOptions(speculative="pipeline"))
    try:
        assert batched.engine.speculative_modes[-1] == "pipeline"
        piped = batched.engine.submit(BatchRequest([1, 2, 3, 1, 2], 10, speculative="pipeline"))
        assert piped.result(60) == plain
    finally:
        batched.close()
