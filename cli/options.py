"""Option groups and parsers that more than one command shares: prompts, sampling, speculation."""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import click

from loopcast.errors import RequestError
from loopcast.vocab import KVPolicy, SpeculativeMode, choices

# The modes a user picks by name; "custom" is a proposer object of the Python API.
CLI_MODES = [mode for mode in choices(SpeculativeMode) if mode != SpeculativeMode.CUSTOM]

DTYPE = click.Choice(["fp32", "fp16", "bf16"])


def stack(*decorators: Callable) -> Callable:
    """Several click options as one decorator, in the order they are listed (and shown in --help)."""

    def apply(func: Callable) -> Callable:
        for decorator in reversed(decorators):
            func = decorator(func)
        return func

    return apply


@dataclass(frozen=True)
class PromptSource:
    """What the model continues: text, token ids or chat messages (exactly one is set)."""

    text: str | None = None
    ids: list[int] | None = None
    messages: list[dict] | None = None
    chat_template_kwargs: dict | None = None  # with messages: extra chat-template variables


prompt_options = stack(
    click.option("--prompt", help="Prompt text (needs the tokenizer); `-` reads it from stdin."),
    click.option(
        "--prompt-file",
        type=click.Path(dir_okay=False, path_type=Path),
        help="Read the prompt text from this file (UTF-8).",
    ),
    click.option("--prompt-ids", help='Prompt as token ids separated by commas or spaces: 1,2,3 or "1 2 3".'),
    click.option(
        "--chat",
        "chat",
        multiple=True,
        help="A user message, rendered with the artifact's chat template (repeatable: several user turns).",
    ),
    click.option("--system", help="A system message before the --chat messages."),
    click.option(
        "--chat-template-kwargs",
        "chat_template_kwargs",
        help="With --chat: a JSON object of extra chat-template variables, e.g. "
        "'{\"enable_thinking\": false}'.",
    ),
)


def given(ctx: click.Context, name: str) -> bool:
    """Whether the user gave option ``name`` (on the command line or its environment variable)."""
    source = ctx.get_parameter_source(name)
    return source in (click.core.ParameterSource.COMMANDLINE, click.core.ParameterSource.ENVIRONMENT)


def prompt_source(
    prompt: str | None,
    prompt_file: Path | None,
    prompt_ids: str | None,
    chat: tuple[str, ...],
    system: str | None,
    chat_template_kwargs: str | None = None,
) -> PromptSource:
    """The one prompt that ``prompt_options``' flags give (exactly one source, or a RequestError)."""
    given = [
        name
        for name, value in (
            ("--prompt", prompt),
            ("--prompt-file", prompt_file),
            ("--prompt-ids", prompt_ids),
            ("--chat", chat or None),
        )
        if value is not None
    ]
    if len(given) != 1:
        raise RequestError(
            "give exactly one of --prompt and --prompt-ids (or --prompt-file, or --chat)"
            + (f"; got {', '.join(given)}" if given else "")
        )
    if system is not None and not chat:
        raise RequestError("--system goes with --chat")
    if chat_template_kwargs is not None and not chat:
        raise RequestError("--chat-template-kwargs goes with --chat")
    if chat:
        from loopcast.ort_runtime.text.chat import chat_messages, template_kwargs

        variables = None
        if chat_template_kwargs is not None:
            try:
                variables = template_kwargs(json.loads(chat_template_kwargs))
            except ValueError as exc:
                raise RequestError(f"--chat-template-kwargs is not valid JSON ({exc})") from None
        return PromptSource(messages=chat_messages(chat, system), chat_template_kwargs=variables)
    if prompt_ids is not None:
        return PromptSource(ids=parse_ids(prompt_ids))
    return PromptSource(text=read_prompt(prompt, prompt_file))


def _valid_text(text: str, where: str) -> str:
    """Command-line text holds undecodable bytes as lone surrogates (Python's surrogateescape)."""
    from loopcast.ort_runtime.text.utf8 import checked_text

    try:
        return checked_text(text, "prompt")
    except RequestError as exc:
        raise RequestError(f"{where} {str(exc).removeprefix('prompt ')}", parameter="prompt") from None


def parse_ids(text: str) -> list[int]:
    """Token ids separated by commas ("1,2,3", "1, 2, 3") or by whitespace ("1 2 3"). A piece
    that is not one integer (e.g. "1 2,3": is it 1,2,3 or 12,3?) is refused, never guessed."""
    pieces = [p.strip() for p in text.split(",")] if "," in text else text.split()
    if text.strip() and not all(re.fullmatch(r"-?[0-9]+", p) for p in pieces):
        raise RequestError(
            f"--prompt-ids must be comma-separated or space-separated integers (not both, "
            f"no empty entries), got {text!r}"
        )
    return [int(p) for p in pieces if p]


def read_prompt(prompt: str | None, prompt_file: Path | None) -> str | None:
    """--prompt TEXT, --prompt - (stdin) or --prompt-file PATH → the prompt text."""
    try:
        if prompt_file is not None:
            return _valid_text(prompt_file.read_text(encoding="utf-8"), f"--prompt-file {prompt_file}")
        if prompt == "-":
            data = sys.stdin.buffer.read() if hasattr(sys.stdin, "buffer") else sys.stdin.read()
            return _valid_text(
                data.decode("utf-8") if isinstance(data, bytes) else data, "--prompt - (stdin)"
            )
    except (OSError, UnicodeDecodeError) as exc:
        raise RequestError(
            f"--prompt-file {prompt_file}: cannot read it ({exc})"
            if prompt_file is not None
            else f"--prompt -: cannot read stdin as UTF-8 text ({exc})"
        ) from None
    return _valid_text(prompt, "--prompt") if prompt is not None else None


sampling_options = stack(
    click.option(
        "--temperature",
        type=float,
        default=None,
        help="Sample instead of greedy (any sampling option turns sampling on at temperature 1; "
        "0 is greedy).",
    ),
    click.option("--top-k", type=int, default=None, help="Sample from the k most likely tokens."),
    click.option("--top-p", type=float, default=None, help="Sample from the most likely tokens of mass p."),
    click.option(
        "--min-p", type=float, default=None, help="Drop tokens below min-p times the top probability."
    ),
    click.option(
        "--repetition-penalty",
        type=float,
        default=None,
        help="transformers' repetition penalty (> 1 discourages).",
    ),
    click.option("--seed", type=int, default=None, help="Seed of the sampling RNG (same seed, same tokens)."),
)


def sampling_params(temperature, top_k, top_p, min_p, repetition_penalty, seed):
    """SamplingParams when any ``sampling_options`` flag is given, else None (greedy)."""
    values = dict(
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        min_p=min_p,
        repetition_penalty=repetition_penalty,
        seed=seed,
    )
    given = {k: v for k, v in values.items() if v is not None}
    if not given:
        return None
    from loopcast.ort_runtime.decoding.sampling import SamplingParams

    return SamplingParams(**given)


depth_options = stack(
    click.option(
        "--loops",
        type=int,
        default=None,
        help="Static depth: k loop applications per token (Ouro's exit_at_step = k-1); default: "
        "all R, or the exit gate.",
    ),
    click.option(
        "--exit-threshold",
        type=float,
        default=None,
        help="Ouro's exit gate: each token leaves at the first loop whose cumulative exit "
        "probability reaches this (0, 1]. Default: the checkpoint's early_exit_threshold.",
    ),
    click.option("--min-loops", type=int, default=None, help="The exit gate's fewest loops per token."),
    click.option("--max-loops", type=int, default=None, help="The exit gate's most loops per token."),
    click.option(
        "--kv-policy",
        type=click.Choice(choices(KVPolicy)),
        default=None,
        help="What a gated exit leaves in the skipped loops' KV. full: they still run (exact to "
        "the model); last-exited: the exit loop's K/V is copied into them.",
    ),
)


recurrent_options = stack(
    click.option(
        "--kl-threshold",
        type=float,
        default=None,
        help="Recurrent depth (Huginn): each token leaves after the first core step whose next-token "
        "distribution moved less than this KL from the previous step's (the release's 1e-3); "
        "--loops is then the most steps. Default: every one of the --loops steps.",
    ),
    click.option(
        "--state-seed",
        type=int,
        default=None,
        help="Recurrent depth (Huginn): draw the initial state from this seed (truncated normal per "
        "position, deterministic); default: the zero state.",
    ),
)


def recurrent_params(kl_threshold, state_seed) -> dict:
    """The recurrent-depth flags as GenerationConfig keywords (unset flags left out)."""
    values = dict(kl_threshold=kl_threshold, state_seed=state_seed)
    return {k: v for k, v in values.items() if v is not None}


def depth_params(loops, exit_threshold, min_loops, max_loops, kv_policy) -> dict:
    """The depth flags as GenerationConfig keywords (unset flags left out: the config's defaults)."""
    values = dict(
        loops=loops,
        exit_threshold=exit_threshold,
        min_loops=min_loops,
        max_loops=max_loops,
        kv_policy=kv_policy,
    )
    return {k: v for k, v in values.items() if v is not None}
