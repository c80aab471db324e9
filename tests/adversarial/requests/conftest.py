"""Fixtures of the request-side adversarial suite: one copy of the demo artifact whose chat
template turns pathological on a trigger message, the model loaded from it, and an in-process
server (FastAPI's TestClient) over it, for the test modules of this folder."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.adversarial.requests.request_cases import MODEL, client
from tests.artifacts import artifact, require_exact_cpu_artifacts

# An ordinary template, except for trigger messages: "loop forever" runs nested loops of 10^10
# steps, "huge" renders 30 MB.
ADVERSARIAL_TEMPLATE = (
    "{% if messages[0].content == 'loop forever' %}"
    "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    "{% elif messages[0].content == 'huge' %}"
    "{% for i in range(30000) %}{{ 'x' * 1000 }}{% endfor %}"
    "{% endif %}"
    "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


@pytest.fixture(scope="module")
def adversarial_artifact(tmp_path_factory) -> Path:
    require_exact_cpu_artifacts()
    path = tmp_path_factory.mktemp("adversarial") / "demo"
    shutil.copytree(artifact("demo"), path)
    (path / "chat_template.jinja").write_text(ADVERSARIAL_TEMPLATE)
    return path


@pytest.fixture(scope="module")
def model(adversarial_artifact):
    from loopcast.ort_runtime import load

    return load(adversarial_artifact)


@pytest.fixture(scope="module")
def serving(adversarial_artifact):
    pytest.importorskip("fastapi")
    pytest.importorskip("httpx")
    from loopcast.serve.state import ServeOptions, open_serving

    state = open_serving(adversarial_artifact, ServeOptions(model_name=MODEL))
    yield state
    state.close()


@pytest.fixture(scope="module")
def http(serving):
    with client(serving) as c:
        yield c
