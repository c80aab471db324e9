"""Chat templates give the ids of transformers' ``apply_chat_template`` on the same tokenizer files."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner
from loopcast.cli import main
from loopcast.exporter.export import ExportOptions, export_checkpoint
from loopcast.ort_runtime import load
from loopcast.ort_runtime.text.chat import load_chat_template

from loopcast.errors import ArtifactError, RequestError
from tests.artifacts import artifact

transformers = pytest.importorskip("transformers")

DEMO = Path(__file__).resolve().parents[2] / "loopcast" / "demo_model"

CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>' + '\\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# Qwen2.5-style: a default system prompt when the conversation has none.
DEFAULT_SYSTEM = """{%- if messages[0]['role'] == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
{%- else %}
    {{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role != 'system' %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""
# Exercises the environment: special-token variables, namespace, loop controls, tojson,
# raise_exception, trim_blocks/lstrip_blocks.
FEATURES = """{{ bos_token }}{% set ns = namespace(turns=0) %}
{% for m in messages %}
    {% if m.role not in ['system', 'user', 'assistant'] %}{{ raise_exception('unknown role ' + m.role) }}{% endif %}
    {% set ns.turns = ns.turns + 1 %}
{{ m.role }}: {{ m.content | tojson }}{{ eos_token }}
    {% if loop.index >= 3 %}{% break %}{% endif %}
{% endfor %}
{% if add_generation_prompt %}assistant ({{ ns.turns }} turns):{% endif %}"""  # noqa: E501

MESSAGES = [
    [{"role": "user", "content": "def add(a, b):"}],
    [
        {"role": "system", "content": "You write Python."},
        {"role": "user", "content": 'Sort a list <quickly> & "well"'},
    ],
    [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "ünïcode ✓"},
        {"role": "assistant", "content": "dropped by the break"},
    ],
]


def _tokenizer_dir(tmp_path: Path, *, config_template=None, jinja=None) -> Path:
    out = tmp_path / "tok"
    out.mkdir(parents=True)
    shutil.copy(DEMO / "tokenizer.json", out)
    config = json.loads((DEMO / "tokenizer_config.json").read_text())
    if config_template is not None:
        config["chat_template"] = config_template
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    if jinja is not None:
        (out / "chat_template.jinja").write_text(jinja)
    return out


def _ours(path: Path, messages, add_generation_prompt=True) -> list[int]:
    from tokenizers import Tokenizer

    text = load_chat_template(path).render(messages, add_generation_prompt=add_generation_prompt)
    return Tokenizer.from_file(str(path / "tokenizer.json")).encode(text, add_special_tokens=False).ids


def _theirs(path: Path, messages, add_generation_prompt=True) -> list[int]:
    tok = transformers.AutoTokenizer.from_pretrained(str(path))
    out = tok.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt, tokenize=True, return_dict=True
    )
    return list(out["input_ids"])


@pytest.mark.parametrize("template", ["chatml", "default-system", "features"])
@pytest.mark.parametrize("where", ["tokenizer_config", "jinja-file", "named-list"])
def test_ids_equal_transformers(tmp_path: Path, template: str, where: str) -> None:
    source = {"chatml": CHATML, "default-system": DEFAULT_SYSTEM, "features": FEATURES}[template]
    if where == "tokenizer_config":
        path = _tokenizer_dir(tmp_path, config_template=source)
    elif where == "jinja-file":  # the file wins over a template in tokenizer_config.json
        path = _tokenizer_dir(tmp_path, config_template="WRONG {{ messages }}", jinja=source)
    else:
        path = _tokenizer_dir(
            tmp_path,
            config_template=[{"name": "other", "template": "WRONG"}, {"name": "default", "template": source}],
        )
    for messages in MESSAGES:
        for gen_prompt in (True, False):
            ours = _ours(path, messages, gen_prompt)
            assert ours == _theirs(path, messages, gen_prompt), (template, messages)
    assert len(_ours(path, MESSAGES[0])) > 3


def test_default_system_prompt_is_inserted(tmp_path: Path) -> None:
    path = _tokenizer_dir(tmp_path, config_template=DEFAULT_SYSTEM)
    text = load_chat_template(path).render(MESSAGES[0])
    assert text.startswith("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n")
    assert text.endswith("<|im_start|>assistant\n")


def test_template_errors_are_request_errors(tmp_path: Path) -> None:
    path = _tokenizer_dir(tmp_path, config_template=FEATURES)
    with pytest.raises(RequestError, match="unknown role tool"):
        load_chat_template(path).render([{"role": "tool", "content": "x"}])
    with pytest.raises(RequestError, match="messages must be"):
        load_chat_template(path).render("hello")


def test_sandbox_blocks_python_internals(tmp_path: Path) -> None:
    path = _tokenizer_dir(tmp_path, config_template="{{ messages.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(Exception) as info:
        load_chat_template(path).render(MESSAGES[0])
    assert "unsafe" in str(info.value).lower() or "security" in type(info.value).__name__.lower()


def test_bad_templates_name_the_file(tmp_path: Path) -> None:
    path = _tokenizer_dir(tmp_path, config_template="{% for %}")
    with pytest.raises(ArtifactError, match="tokenizer_config.json: chat template does not parse"):
        load_chat_template(path).render(MESSAGES[0])
    path = _tokenizer_dir(tmp_path / "b", config_template=[{"name": "tool_use", "template": CHATML}])
    with pytest.raises(ArtifactError, match="no 'default'"):
        load_chat_template(path)


@pytest.fixture(scope="module")
def chat_artifact(tmp_path_factory) -> Path:
    """The demo model exported from a checkpoint that carries a chat template and a
    generation_config.json with two EOS ids (the export must copy both)."""
    root = tmp_path_factory.mktemp("chat")
    ckpt = root / "ckpt"
    shutil.copytree(DEMO, ckpt)
    (ckpt / "chat_template.jinja").write_text(DEFAULT_SYSTEM)
    (ckpt / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, 2]}))
    out = root / "art"
    export_checkpoint(ckpt, out, ExportOptions(max_length=256))
    return out


def test_artifact_chat_through_api_and_cli(chat_artifact: Path) -> None:
    model = load(chat_artifact)
    assert (chat_artifact / "chat_template.jinja").is_file()
    assert model.eos_token_ids == (0, 2)  # the manifest's, plus generation_config.json's second
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "def add(a, b):"}]
    ids = model.apply_chat_template(messages)
    assert ids == _theirs(chat_artifact, messages)
    by_messages = model.generate(messages=messages, max_new_tokens=8)
    assert by_messages.tokens == model.generate(ids, 8).tokens
    result = CliRunner().invoke(
        main,
        [
            "generate",
            str(chat_artifact),
            "--chat",
            "def add(a, b):",
            "--system",
            "Be brief.",
            "--max-new-tokens",
            "8",
            "--json",
        ],
    )
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["tokens"] == by_messages.tokens


def test_no_template_is_a_clear_error() -> None:
    model = load(artifact("demo"))
    with pytest.raises(RequestError, match="no chat template"):
        model.generate(messages=[{"role": "user", "content": "hi"}], max_new_tokens=4)
    result = CliRunner().invoke(main, ["generate", str(artifact("demo")), "--chat", "hi"])
    assert result.exit_code == 2
    assert result.output.startswith("error: ") and "no chat template" in result.output
    assert "Traceback" not in result.output
    with pytest.raises(RequestError, match="exactly one of a prompt and messages"):
        model.generate("x", 4, messages=[{"role": "user", "content": "hi"}])
