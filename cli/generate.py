"""``loopcast generate``: the flags become one GenerationConfig, which goes down to the engine."""

from __future__ import annotations

import json

import click
from loopcast.cli.options import (
    CLI_MODES,
    depth_options,
    depth_params,
    given,
    prompt_options,
    prompt_source,
    recurrent_options,
    recurrent_params,
    sampling_options,
    sampling_params,
)
from loopcast.ort_runtime.text.utf8 import checked_text

from loopcast.errors import RequestError
from loopcast.vocab import GateKind, SpeculativeMode, choices

_EPILOG = """\b
Examples:
  loopcast generate ART --prompt "def main():" --max-new-tokens 64 --stream
  loopcast generate ART --chat "Write a haiku about loops" --system "You are terse." \\
      --temperature 0.7 --top-p 0.9 --seed 0 --stop $'\\n\\n'
  loopcast generate ART --chat "Hi" --chat-template-kwargs '{"enable_thinking": false}'
  cat long_prompt.txt | loopcast generate ART --prompt - --json
"""


@click.command(epilog=_EPILOG)
@click.argument("path")
@click.option(
    "--backend",
    type=click.Choice(["ort", "torch"]),
    default="ort",
    show_default=True,
    help="ort runs an exported artifact; torch runs the reference on a checkpoint dir.",
)
@prompt_options
@click.option("--max-new-tokens", type=int, default=64, show_default=True)
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default="cpu", show_default=True)
@click.option(
    "--threads", type=int, default=None, help="ONNX Runtime intra-op threads (default: one per core)."
)
@click.option(
    "--speculative",
    type=click.Choice(CLI_MODES),
    default=SpeculativeMode.NONE.value,
    show_default=True,
    help="pipeline: lanes at every loop depth share one pass over the core layers "
    "(looped models; docs/architecture.md §5).",
)
@click.option("--num-draft-tokens", type=int, default=None, help="K drafts per round.")
@click.option(
    "--draft-depth",
    type=int,
    default=None,
    help="Loops the self-draft runs (< R); on a recurrent-depth (Huginn) artifact, the drafts' core "
    "steps (< --loops, chosen per run; default a quarter of --loops).",
)
@click.option(
    "--pipeline-exit",
    type=int,
    default=1,
    show_default=True,
    help="pipeline: the loop whose head drafts the next lane's token (1..R-1).",
)
@click.option(
    "--alternate-gap",
    type=float,
    default=None,
    help="self: where a draft's top-1/top-2 probability gap is below this, also verify one alternate "
    "suffix from the runner-up token (artifacts exported with --tree-verify; greedy only).",
)
@click.option(
    "--gate",
    type=click.Choice(choices(GateKind)),
    default=GateKind.AUTO.value,
    show_default=True,
    help="When to speculate. auto: the cost gate calibrated on this device (stands down where "
    "speculation does not pay; hit-density when sampling with a seed); always: every step.",
)
@click.option(
    "--allow-inexact",
    is_flag=True,
    help="Speculate even on an artifact whose verify rows are not bit-identical to its decode rows "
    "on this device (tokens may then differ from plain greedy).",
)
@sampling_options
@depth_options
@recurrent_options
@click.option(
    "--stop",
    "stop",
    multiple=True,
    help="Stop when the text contains this string (repeatable); the text is cut before it.",
)
@click.option(
    "--skip-special-tokens/--keep-special-tokens",
    default=True,
    show_default=True,
    help="Leave special tokens out of the printed text (token ids are never changed).",
)
@click.option("--stream", is_flag=True, help="Print text as tokens are committed.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object (tokens, text, stats).")
@click.option(
    "--kv-sharing",
    default=None,
    metavar="compress-s<c>|compress-r<c>",
    help="Recurrent depth (Huginn): the release's KV lookup sharing c core slots across every "
    "step and layer (block k·L+l -> slot mod c, or div c); plain decoding only. Default: a slot "
    "per step and layer.",
)
@click.option(
    "--trust-ops",
    is_flag=True,
    help="Load the artifact's native custom-op library even if you did not build it (runs its code; "
    "docs/trust.md).",
)
def generate(
    path: str,
    backend: str,
    prompt,
    prompt_file,
    prompt_ids,
    chat,
    system,
    chat_template_kwargs,
    max_new_tokens: int,
    device: str,
    threads: int | None,
    speculative: str,
    num_draft_tokens: int | None,
    draft_depth: int | None,
    pipeline_exit: int,
    alternate_gap: float | None,
    gate: str,
    allow_inexact: bool,
    temperature,
    top_k,
    top_p,
    min_p,
    repetition_penalty,
    seed,
    loops: int | None,
    exit_threshold: float | None,
    min_loops: int | None,
    max_loops: int | None,
    kv_policy: str | None,
    kl_threshold: float | None,
    state_seed: int | None,
    stop: tuple[str, ...],
    skip_special_tokens: bool,
    stream: bool,
    as_json: bool,
    kv_sharing: str | None,
    trust_ops: bool,
) -> None:
    """Generate from a prompt: greedy, or sampled with --temperature/--top-p/... ."""
    if stream and as_json:
        raise RequestError(
            "--stream and --json do not combine: --json prints one object when the generation ends"
        )
    source = prompt_source(prompt, prompt_file, prompt_ids, chat, system, chat_template_kwargs)
    if any(not s for s in stop):  # GenerationConfig drops empty stops; on the command line one is a typo
        raise RequestError(f"--stop strings must be non-empty, got {list(stop)!r}")
    for s in stop:
        checked_text(s, "stop")
    from loopcast.ort_runtime.decoding.generation_config import GenerationConfig

    # The keyword form is the flags' own names: an error names the keyword, cli/flags.py the flag.
    config = GenerationConfig.from_options(
        max_new_tokens=max_new_tokens,
        sampling=sampling_params(temperature, top_k, top_p, min_p, repetition_penalty, seed),
        stop=stop,
        skip_special_tokens=skip_special_tokens,
        speculative=speculative,
        num_draft_tokens=num_draft_tokens,
        gate=gate,
        allow_inexact=allow_inexact,
        pipeline_exit=pipeline_exit,
        alternate_gap=alternate_gap,
        **depth_params(loops, exit_threshold, min_loops, max_loops, kv_policy),
        **recurrent_params(kl_threshold, state_seed),
    )
    refuse_contradictions(click.get_current_context())  # after the values' own checks
    if backend == "torch":
        result = _generate_with_torch(path, source, config, device, kv_sharing)
    else:
        from loopcast.cli.generate_ort import generate_with_ort

        result = generate_with_ort(
            path,
            source,
            config,
            device=device,
            threads=threads,
            trust_ops=trust_ops,
            draft_depth=draft_depth,
            kv_sharing=kv_sharing,
            on_text=(lambda t: click.echo(t, nl=False)) if stream and not as_json else None,
        )
    if as_json:
        click.echo(json.dumps(result))
    elif not stream:
        click.echo(
            result["text"] if result.get("text") is not None else ",".join(str(t) for t in result["tokens"])
        )
    else:
        click.echo()


# Flags that only mean something with a speculative mode: given without it, they are refused
# rather than silently ignored.
_SPECULATION_FLAGS = {
    "num_draft_tokens": ("--num-draft-tokens", None),
    "gate": ("--gate", None),
    "allow_inexact": ("--allow-inexact", None),
    "draft_depth": ("--draft-depth", None),
    "pipeline_exit": ("--pipeline-exit", SpeculativeMode.PIPELINE),
    "alternate_gap": ("--alternate-gap", SpeculativeMode.SELF),
}
_SAMPLING_SHAPERS = ("top_k", "top_p", "min_p", "repetition_penalty")
_ORT_ONLY = ("threads", "trust_ops", "draft_depth")


def refuse_contradictions(ctx: click.Context) -> None:
    """One line for a combination of flags where one would silently lose (``--num-draft-tokens``
    without speculation, ``--top-p`` at ``--temperature 0``, ``--threads`` on the torch backend)."""
    params = ctx.params
    mode = SpeculativeMode(params["speculative"])
    for name, (flag, needs) in _SPECULATION_FLAGS.items():
        if not given(ctx, name):
            continue
        if mode == SpeculativeMode.NONE:
            raise RequestError(f"{flag} goes with --speculative (this run does not speculate)")
        if needs is not None and mode != needs:
            raise RequestError(f"{flag} goes with --speculative {needs.value}, not {mode.value}")
    if params.get("temperature") == 0:
        shaped = [f"--{n.replace('_', '-')}" for n in _SAMPLING_SHAPERS if params.get(n) is not None]
        if shaped:
            raise RequestError(f"{shaped[0]} shapes sampling, but --temperature 0 is greedy; drop one")
    if params["backend"] == "torch":
        ort = [f"--{n.replace('_', '-')}" for n in _ORT_ONLY if given(ctx, n)]
        if ort:
            raise RequestError(f"{ort[0]} is an ONNX Runtime option; --backend torch does not take it")


def _generate_with_torch(path: str, source, config, device: str, kv_sharing: str | None = None) -> dict:
    """The PyTorch reference: plain greedy on the CPU, from text or token ids."""
    spec = config.speculation
    if spec.mode != SpeculativeMode.NONE or device != "cpu" or spec.alternate_gap is not None:
        raise RequestError("--backend torch runs plain greedy on the CPU only")
    if source.messages is not None or config.stop or config.sampling is not None:
        raise RequestError("--backend torch runs plain greedy only (no --chat, --stop or sampling)")
    from loopcast.torch_extra import require_torch

    require_torch("--backend torch")
    from loopcast.exporter.torch_backend import generate_with_reference

    return generate_with_reference(path, source.text, source.ids, config, kv_sharing=kv_sharing)
