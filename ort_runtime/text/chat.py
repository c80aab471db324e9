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

A template is untrusted code from the artifact: the sandbox is what makes rendering it safe, and
its work (steps, time, output size) is bounded by ``RenderLimits`` (ort_runtime/text/template_sandbox.py).
jinja2 is imported only when a template is rendered.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from loopcast.ort_runtime.text.template_sandbox import RenderLimits, compile_template, render_bounded
from loopcast.ort_runtime.text.utf8 import check_texts, checked_text

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

    limits: RenderLimits = field(default_factory=RenderLimits)

    def render(self, messages: Sequence[Mapping], *, add_generation_prompt: bool = True, **variables) -> str:
        """The prompt text for ``messages``; ``variables`` reach the template (e.g. tools=None).
        The rendering's work is bounded by ``limits`` (ort_runtime/text/template_sandbox.py)."""
        chat = _checked_messages(messages)
        template = compile_template(self.source, self.origin, self.limits)
        import jinja2

        try:
            return render_bounded(
                template,
                self.limits,
                messages=chat,
                add_generation_prompt=add_generation_prompt,
                **{**self.special_tokens, **variables},
            )
        except RecursionError:
            raise RequestError(
                f"{self.origin}: the chat template recursed too deeply", parameter="messages"
            ) from None
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


# Variables a caller's chat_template_kwargs may not set: the render's own arguments.
RESERVED_TEMPLATE_VARIABLES = ("messages", "add_generation_prompt")


def template_kwargs(kwargs: object) -> dict:
    """``chat_template_kwargs`` checked: extra variables for the template (``enable_thinking``,
    ``tools``, ...), as transformers' ``apply_chat_template(**kwargs)`` and vLLM's request field
    take them. A JSON object with identifier keys; the render's own arguments are refused."""
    if kwargs is None:
        return {}
    if not isinstance(kwargs, Mapping):
        raise RequestError(
            f"chat_template_kwargs must be an object of template variables, got {type(kwargs).__name__}",
            parameter="chat_template_kwargs",
        )
    for key in kwargs:
        if not isinstance(key, str) or not key.isidentifier():
            raise RequestError(
                f"chat_template_kwargs keys must be identifiers, got {key!r:.40}",
                parameter="chat_template_kwargs",
            )
        if key in RESERVED_TEMPLATE_VARIABLES:
            raise RequestError(
                f"chat_template_kwargs cannot set {key!r} (give it as its own argument)",
                parameter="chat_template_kwargs",
            )
    return dict(kwargs)


def chat_messages(user: Sequence[str], system: str | None = None) -> list[dict]:
    """The CLI's messages: an optional system message, then each ``--chat`` as a user turn."""
    if not user:
        raise RequestError("--chat needs at least one user message")
    if system is not None:
        checked_text(system, "system")
    for text in user:
        checked_text(text, "chat")
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
        check_texts(m, "messages")
        # transformers drops None-valued keys: templates test for a missing key, not for None
        chat.append({k: v for k, v in m.items() if v is not None})
    return chat
