"""Chat templates: render ``messages`` into a prompt the way transformers' ``apply_chat_template`` does.

The template comes from the artifact's tokenizer files, with transformers' precedence: a
``chat_template.jinja`` file, else ``tokenizer_config.json``'s ``chat_template`` (a string, or a
list of ``{"name", "template"}`` of which ``default`` is used). It is rendered with jinja2 in the
same sandbox transformers uses — ``ImmutableSandboxedEnvironment(trim_blocks=True,
lstrip_blocks=True)`` with the loop-controls extension, a ``{% generation %}`` block (rendered as
its body), the ``raise_exception`` / ``strftime_now`` globals, a ``namespace`` that refuses
underscore names, and a ``tojson`` filter that does not HTML-escape — and with the named special
tokens (``bos_token``, ``eos_token``, …) as variables. The rendered text is tokenized without
adding special tokens (the template places them), as transformers does.

A template is untrusted code from the artifact: the sandbox is what makes rendering it safe.
jinja2 is imported only when a template is rendered.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from loopcast.confined_files import TEMPLATE_MAX_BYTES, read_confined_json, read_confined_text
from loopcast.errors import ArtifactError, RequestError

TEMPLATE_FILE = "chat_template.jinja"
SPECIAL_TOKEN_NAMES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)
ROLES_HINT = "a list of {'role': ..., 'content': ...} dicts"


@dataclass(frozen=True)
class ChatTemplate:
    source: str  # the jinja template text
    origin: str  # the file it came from (for messages)
    special_tokens: Mapping[str, str] = field(default_factory=dict)

    def render(self, messages: Sequence[Mapping], *, add_generation_prompt: bool = True, **variables) -> str:
        """The prompt text for ``messages``; ``variables`` reach the template (e.g. tools=None)."""
        chat = _checked_messages(messages)
        template = _compile(self.source, self.origin)
        import jinja2

        try:
            return template.render(
                messages=chat,
                add_generation_prompt=add_generation_prompt,
                **{**self.special_tokens, **variables},
            )
        except jinja2.TemplateError as exc:
            raise RequestError(f"{self.origin}: the chat template refused these messages ({exc})") from None


def load_chat_template(artifact_dir: str | Path) -> ChatTemplate | None:
    """The artifact's chat template, or None when it has none."""
    path = Path(artifact_dir)
    config = _read_json(path, "tokenizer_config.json")
    special = _read_json(path, "special_tokens_map.json")
    tokens = {}
    for name in SPECIAL_TOKEN_NAMES:  # tokenizer_config.json wins over the legacy map
        value = config.get(name, special.get(name))
        if isinstance(value, Mapping):  # a serialized AddedToken
            value = value.get("content")
        if isinstance(value, str):
            tokens[name] = value
    source = read_confined_text(
        path, TEMPLATE_FILE, "chat template", max_bytes=TEMPLATE_MAX_BYTES, required=False
    )
    if source is not None:
        return ChatTemplate(source, str(path / TEMPLATE_FILE), tokens)
    raw = config.get("chat_template")
    origin = str(path / "tokenizer_config.json")
    if raw is None:
        return None
    if isinstance(raw, list):
        named = {t.get("name"): t.get("template") for t in raw if isinstance(t, Mapping)}
        if "default" not in named:
            raise ArtifactError(f"{origin}: chat_template lists {sorted(map(str, named))} but no 'default'")
        raw = named["default"]
    if not isinstance(raw, str):
        raise ArtifactError(f"{origin}: chat_template must be a string or a list of named templates")
    return ChatTemplate(raw, origin, tokens)


def chat_messages(user: Sequence[str], system: str | None = None) -> list[dict]:
    """The CLI's messages: an optional system message, then each ``--chat`` as a user turn."""
    if not user:
        raise RequestError("--chat needs at least one user message")
    return ([{"role": "system", "content": system}] if system is not None else []) + [
        {"role": "user", "content": text} for text in user
    ]


def _read_json(artifact_dir: Path, name: str) -> dict:
    """A tokenizer JSON file of the artifact (confined and bounded: loopcast/confined_files.py)."""
    data = read_confined_json(artifact_dir, name, "tokenizer configuration", required=False)
    return data if isinstance(data, dict) else {}


def _checked_messages(messages) -> list[dict]:
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or not messages:
        raise RequestError(f"messages must be {ROLES_HINT}, got {messages!r:.80}")
    chat = []
    for m in messages:
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str) or "content" not in m:
            raise RequestError(
                f"each message must be a dict with a string 'role' and a 'content', got {m!r:.80}"
            )
        # transformers drops None-valued keys: templates test for a missing key, not for None
        chat.append({k: v for k, v in m.items() if v is not None})
    return chat


def _compile(source: str, origin: str):
    import jinja2
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationBlock(Extension):
        # transformers marks assistant spans with {% generation %}; here it renders its body.
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    class Namespace(jinja2.utils.Namespace):
        # no underscore attributes: keeps templates away from Python internals
        def __init__(*args, **kwargs):
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                Namespace._check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            Namespace._check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"chat templates cannot set {name!r} on a namespace")

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[GenerationBlock, loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    env.globals["namespace"] = Namespace
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise ArtifactError(
            f"{origin}: chat template does not parse (line {exc.lineno}: {exc.message})"
        ) from None
