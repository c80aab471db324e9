"""The ``loopcast`` command line. Heavy imports happen inside commands, not at import time."""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path

import click

from loopcast.errors import LoopcastError
from loopcast.vocab import GraphKind, OpSet


def _friendly_errors(func):
    """LoopcastError → one line on stderr and exit 2; anything else is a bug and keeps its traceback."""

    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        try:
            return func(*args, **kwargs)
        except LoopcastError as exc:
            click.echo(f"error: {exc}", err=True)
            sys.exit(2)

    return wrapper


def _parse_ids(text: str) -> list[int]:
    """Token ids separated by commas ("1,2,3", "1, 2, 3") or by whitespace ("1 2 3"). A piece
    that is not one integer (e.g. "1 2,3": is it 1,2,3 or 12,3?) is refused, never guessed."""
    import re

    from loopcast.errors import RequestError

    pieces = [p.strip() for p in text.split(",")] if "," in text else text.split()
    if text.strip() and not all(re.fullmatch(r"-?[0-9]+", p) for p in pieces):
        raise RequestError(
            f"--prompt-ids must be comma-separated or space-separated integers (not both, "
            f"no empty entries), got {text!r}"
        )
    return [int(p) for p in pieces if p]


class _OneLineErrors(click.Group):
    """Click's own usage errors (unknown option, bad value, missing argument) become the same one
    ``error:`` line and exit status 2 as the LoopcastError family, instead of a usage block."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        try:
            code = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except getattr(click.exceptions, "NoArgsIsHelpError", ()) as exc:  # bare `loopcast`: the help
            click.echo(exc.ctx.get_help())
            sys.exit(0)
        except click.ClickException as exc:
            ctx = getattr(exc, "ctx", None)
            where = f" (see `{ctx.command_path} --help`)" if ctx is not None else ""
            click.echo(f"error: {exc.format_message()}{where}", err=True)
            sys.exit(2)
        except click.exceptions.Abort:
            click.echo("error: aborted", err=True)
            sys.exit(1)
        if not standalone_mode:
            return code
        sys.exit(code if isinstance(code, int) else 0)


@click.group(cls=_OneLineErrors)
@click.version_option(package_name="loopcast")
def main() -> None:
    """Export looped transformers to ONNX and run them with ONNX Runtime."""


@main.command()
@click.argument("path")
@click.option(
    "--verify", is_flag=True, help="Artifact: also check the SHA-256 of every file the manifest records."
)
@_friendly_errors
def inspect(path: str, verify: bool) -> None:
    """Explain a checkpoint directory (or `demo`) or an exported artifact."""
    if not Path(path).exists():
        from loopcast.swap import recover

        recover(Path(path), clean=False)  # an export killed mid-swap: put the artifact back
    if (Path(path) / "manifest.json").is_file():
        from loopcast.ort_runtime.loading.artifact import describe_artifact

        click.echo(describe_artifact(Path(path), verify=verify))
        return
    if verify:
        from loopcast.errors import RequestError

        raise RequestError(
            f"{path}: --verify checks an exported artifact; this is not one (no manifest.json)"
        )
    from loopcast.exporter.inspect_checkpoint import describe_checkpoint

    click.echo(describe_checkpoint(path))


@main.command("random-checkpoint")
@click.argument("out_dir", type=click.Path(path_type=Path))
@click.option(
    "--preset",
    default="tiny-ouro",
    show_default=True,
    help="Shape preset: tiny-ouro, tiny-llama, tiny-qwen2, smollm-135m, ouro-1.4b or llama-1.4b.",
)
@click.option("--dtype", type=click.Choice(["fp32", "fp16", "bf16"]), default="fp32", show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--max-shard-mb", type=int, default=None, help="Shard the weights above this size.")
@_friendly_errors
def random_checkpoint(out_dir: Path, preset: str, dtype: str, seed: int, max_shard_mb: int | None) -> None:
    """Write a random-weight Hugging Face checkpoint of a preset shape."""
    from loopcast.config import PRESETS
    from loopcast.errors import ConfigError
    from loopcast.torch_extra import require_torch

    require_torch("random-checkpoint")
    from loopcast.exporter.checkpoint import DTYPES
    from loopcast.exporter.random_checkpoint import write_random_checkpoint

    if preset not in PRESETS:
        raise ConfigError(f"unknown preset {preset!r}; choose from {', '.join(PRESETS)}")
    config = PRESETS[preset]
    if max_shard_mb is not None and max_shard_mb < 1:
        raise ConfigError(f"--max-shard-mb must be >= 1, got {max_shard_mb}")
    try:
        path = write_random_checkpoint(
            config,
            out_dir,
            seed=seed,
            dtype=DTYPES[dtype],
            max_shard_bytes=max_shard_mb * 2**20 if max_shard_mb else None,
        )
    except OSError as exc:  # an unwritable or full destination is the user's input, not a bug
        from loopcast.errors import CheckpointError

        raise CheckpointError(
            f"{exc.filename or out_dir}: cannot write the checkpoint ({exc.strerror or exc})"
        ) from None
    click.echo(f"wrote {path}")


@main.command()
@click.argument("checkpoint")
@click.option(
    "-o",
    "--output",
    "out_dir",
    required=True,
    type=click.Path(path_type=Path),
    help="Artifact directory to create.",
)
@click.option("--dtype", type=click.Choice(["fp32", "fp16", "bf16"]), default="fp32", show_default=True)
@click.option(
    "--max-length", type=int, default=None, help="KV capacity S_max (default: min(max positions, 4096))."
)
@click.option("--verify-width", type=int, default=5, show_default=True, help="Rows W of verify/verify_tail.")
@click.option(
    "--draft-depth", type=int, default=None, help="Loops of the draft graph (default 1 when R > 1)."
)
@click.option(
    "--ops",
    type=click.Choice(["auto", *OpSet]),
    default="auto",
    show_default=True,
    help="Op set of the graphs. auto: for fp32, loopcast-attention (the loopcast attention op with "
    "stock MatMul: verify rows equal decode rows bit for bit on the CPU at stock speed) when "
    "the custom-op library can be built, else stock; loopcast: every hot op from the library.",
)
@click.option("--batch-invariant", is_flag=True, help="Same as --ops loopcast.")
@click.option(
    "--target",
    type=click.Choice(["cpu", "cuda"]),
    default="cpu",
    show_default=True,
    help="Device the artifact is for. cuda implies --ops loopcast: on a GPU the loopcast ops are "
    "faster than the stock ones, exact, and only their graphs can be captured (docs/perf.md).",
)
@click.option(
    "--genai",
    is_flag=True,
    help="Also write genai_decoder.onnx and genai_config.json, so that ONNX Runtime GenAI "
    "(og.Model(ART)) runs the artifact; stock ops, sharing weights.safetensors.",
)
@click.option(
    "--max-batch",
    type=int,
    default=None,
    help="Also write the batched decode graph for up to this many sequences (loopcast serve; "
    "docs/serving.md).",
)
@click.option(
    "--tree-verify",
    is_flag=True,
    help="Also write the tree kinds (tree_draft, tree_tail) that generate --alternate-gap needs "
    "(looped models, loopcast attention op).",
)
@click.option("--overwrite", is_flag=True, help="Replace an existing artifact at the output path.")
@_friendly_errors
def export(
    checkpoint: str,
    out_dir: Path,
    dtype: str,
    max_length: int | None,
    verify_width: int,
    draft_depth: int | None,
    ops: str,
    batch_invariant: bool,
    target: str,
    genai: bool,
    max_batch: int | None,
    tree_verify: bool,
    overwrite: bool,
) -> None:
    """Export a checkpoint directory (or `demo`) into an ONNX artifact directory."""
    from loopcast.exporter.export import ExportOptions, export_checkpoint

    from loopcast.manifest import BATCH_KINDS

    options = ExportOptions(
        dtype,
        max_length,
        verify_width,
        draft_depth,
        batch_invariant or target == "cuda",
        ops,
        genai,
        max_batch,
        tree_verify,
    )
    manifest = export_checkpoint(checkpoint, out_dir, options, progress=True, overwrite=overwrite)
    kinds = ", ".join(
        f"{k}({v.rows or 'M'})" if k not in BATCH_KINDS else f"{k}({v.rows} x B<={manifest.max_batch})"
        for k, v in manifest.graphs.items()
    )
    exact = ", ".join(d for d, ok in manifest.exact_verify.items() if ok) or "no device"
    genai_note = "; ONNX Runtime GenAI model (genai_config.json)" if manifest.genai_files else ""
    click.echo(
        f"wrote {out_dir}: {kinds}; dtype {manifest.dtype}, max length {manifest.max_length}, "
        f"ops {manifest.op_set}, exact speculation on {exact}{genai_note}"
    )


_GENERATE_EPILOG = """\b
Examples:
  loopcast generate ART --prompt "def main():" --max-new-tokens 64 --stream
  loopcast generate ART --chat "Write a haiku about loops" --system "You are terse." \\
      --temperature 0.7 --top-p 0.9 --seed 0 --stop $'\\n\\n'
  cat long_prompt.txt | loopcast generate ART --prompt - --json
"""


@main.command(epilog=_GENERATE_EPILOG)
@click.argument("path")
@click.option(
    "--backend",
    type=click.Choice(["ort", "torch"]),
    default="ort",
    show_default=True,
    help="ort runs an exported artifact; torch runs the reference on a checkpoint dir.",
)
@click.option("--prompt", help="Prompt text (needs the tokenizer); `-` reads it from stdin.")
@click.option(
    "--prompt-file",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Read the prompt text from this file (UTF-8).",
)
@click.option("--prompt-ids", help='Prompt as token ids separated by commas or spaces: 1,2,3 or "1 2 3".')
@click.option(
    "--chat",
    "chat",
    multiple=True,
    help="A user message, rendered with the artifact's chat template (repeatable: several user turns).",
)
@click.option("--system", help="A system message before the --chat messages.")
@click.option("--max-new-tokens", type=int, default=64, show_default=True)
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default="cpu", show_default=True)
@click.option(
    "--speculative",
    type=click.Choice(["none", "prompt-lookup", "self", "pipeline"]),
    default="none",
    show_default=True,
    help="pipeline: lanes at every loop depth share one pass over the core layers "
    "(looped models; docs/architecture.md §5).",
)
@click.option("--num-draft-tokens", type=int, default=None, help="K drafts per round.")
@click.option("--draft-depth", type=int, default=None, help="Loops the self-draft runs (< R).")
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
    type=click.Choice(["auto", "none", "hit-density", "cost"]),
    default="auto",
    show_default=True,
    help="When to speculate. auto: the cost gate calibrated on this device (stands down where "
    "speculation does not pay; hit-density when sampling with a seed); none: every step.",
)
@click.option(
    "--allow-inexact",
    is_flag=True,
    help="Speculate even on an artifact whose verify rows are not bit-identical to its decode rows "
    "on this device (tokens may then differ from plain greedy).",
)
@click.option(
    "--temperature",
    type=float,
    default=None,
    help="Sample instead of greedy (any sampling option turns sampling on at temperature 1; 0 is greedy).",
)
@click.option("--top-k", type=int, default=None, help="Sample from the k most likely tokens.")
@click.option("--top-p", type=float, default=None, help="Sample from the most likely tokens of mass p.")
@click.option("--min-p", type=float, default=None, help="Drop tokens below min-p times the top probability.")
@click.option(
    "--repetition-penalty",
    type=float,
    default=None,
    help="transformers' repetition penalty (> 1 discourages).",
)
@click.option("--seed", type=int, default=None, help="Seed of the sampling RNG (same seed, same tokens).")
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
    "--trust-ops",
    is_flag=True,
    help="Load the artifact's native custom-op library even if you did not build it (runs its code; "
    "docs/trust.md).",
)
@_friendly_errors
def generate(
    path: str,
    backend: str,
    prompt: str | None,
    prompt_file: Path | None,
    prompt_ids: str | None,
    chat: tuple[str, ...],
    system: str | None,
    max_new_tokens: int,
    device: str,
    speculative: str,
    num_draft_tokens: int | None,
    draft_depth: int | None,
    pipeline_exit: int,
    alternate_gap: float | None,
    gate: str,
    allow_inexact: bool,
    temperature: float | None,
    top_k: int | None,
    top_p: float | None,
    min_p: float | None,
    repetition_penalty: float | None,
    seed: int | None,
    stop: tuple[str, ...],
    skip_special_tokens: bool,
    stream: bool,
    as_json: bool,
    trust_ops: bool,
) -> None:
    """Generate from a prompt: greedy, or sampled with --temperature/--top-p/... ."""
    from loopcast.errors import RequestError

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
    if max_new_tokens < 0:
        raise RequestError(f"--max-new-tokens must be >= 0, got {max_new_tokens}")
    prompt = _read_prompt(prompt, prompt_file)
    ids = _parse_ids(prompt_ids) if prompt_ids is not None else None
    sampling = _sampling_options(temperature, top_k, top_p, min_p, repetition_penalty, seed)
    if backend == "torch":
        if speculative != "none" or device != "cpu" or alternate_gap is not None:
            raise RequestError("--backend torch runs plain greedy on the CPU only")
        if chat or stop or sampling is not None:
            raise RequestError("--backend torch runs plain greedy only (no --chat, --stop or sampling)")
        from loopcast.torch_extra import require_torch

        require_torch("--backend torch")
        from loopcast.exporter.torch_backend import generate_with_reference

        result = generate_with_reference(path, prompt, ids, max_new_tokens)
    else:
        from loopcast.cli.generate_ort import generate_with_ort
        from loopcast.ort_runtime.text.chat import chat_messages

        result = generate_with_ort(
            path,
            prompt,
            ids,
            max_new_tokens,
            device=device,
            speculative=speculative,
            num_draft_tokens=num_draft_tokens,
            draft_depth=draft_depth,
            gate=gate,
            allow_inexact=allow_inexact,
            trust_ops=trust_ops,
            pipeline_exit=pipeline_exit,
            alternate_gap=alternate_gap,
            on_text=(lambda t: click.echo(t, nl=False)) if stream and not as_json else None,
            messages=chat_messages(chat, system) if chat else None,
            stop=stop,
            sampling=sampling,
            skip_special_tokens=skip_special_tokens,
        )
    if as_json:
        click.echo(json.dumps(result))
    elif not stream:
        click.echo(
            result["text"] if result.get("text") is not None else ",".join(str(t) for t in result["tokens"])
        )
    else:
        click.echo()


def _read_prompt(prompt: str | None, prompt_file: Path | None) -> str | None:
    """--prompt TEXT, --prompt - (stdin) or --prompt-file PATH → the prompt text."""
    from loopcast.errors import RequestError

    try:
        if prompt_file is not None:
            return prompt_file.read_text(encoding="utf-8")
        if prompt == "-":
            return sys.stdin.read()
    except (OSError, UnicodeDecodeError) as exc:
        raise RequestError(
            f"--prompt-file {prompt_file}: cannot read it ({exc})"
            if prompt_file is not None
            else f"--prompt -: cannot read stdin ({exc})"
        ) from None
    return prompt


def _sampling_options(temperature, top_k, top_p, min_p, repetition_penalty, seed):
    """SamplingParams when any sampling option is given, else None (greedy)."""
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


@main.command()
@click.argument("checkpoint", default="demo")
@click.option(
    "--device",
    type=click.Choice(["cpu", "cuda"]),
    default=None,
    help="Default: cuda when onnxruntime has the CUDA provider and the driver sees a GPU, else cpu.",
)
@click.option(
    "--dtype",
    "dtypes",
    multiple=True,
    type=click.Choice(["fp32", "fp16", "bf16"]),
    help="Repeatable (default: fp16 and bf16 on cuda, fp32 on cpu).",
)
@click.option(
    "--variant",
    "variants",
    multiple=True,
    type=click.Choice(["stock", "batch-invariant", "default"]),
    help="Graph variants to compare: stock ops, every loopcast op, or the exporter's default op set "
    "(default: stock and batch-invariant).",
)
@click.option("--past", type=int, default=1024, show_default=True, help="KV length the steps attend over.")
@click.option("--widths", default="2,5,8", show_default=True, help="Verify widths W (comma-separated).")
@click.option("--iters", type=int, default=50, show_default=True, help="Timed runs per step kind.")
@click.option("--new-tokens", type=int, default=128, show_default=True, help="Tokens per end-to-end prompt.")
@click.option(
    "--alternate-tokens",
    type=int,
    default=1000,
    show_default=True,
    help="Length of the decode/draft/verify alternation run (CUDA).",
)
@click.option("--no-end-to-end", is_flag=True, help="Skip the end-to-end tokens/s rows.")
@click.option(
    "--oracle-reject",
    "oracle_reject",
    default="0,0.08",
    show_default=True,
    help="Pipeline rows with oracle drafts (plain greedy's continuation replayed through the drafts "
    "hook) that spoil these fractions of positions (comma-separated; empty: none).",
)
@click.option(
    "--passes",
    type=int,
    default=1,
    show_default=True,
    help="End-to-end passes over the prompts, the modes taking turns prompt by prompt; the ratios "
    "reported are the median over passes of each mode against plain in the same pass.",
)
@click.option("--no-torch", is_flag=True, help="Skip the PyTorch baseline.")
@click.option("--no-profile", is_flag=True, help="Skip the per-kernel-family decode profile (CUDA).")
@click.option(
    "--work-dir",
    type=click.Path(path_type=Path),
    default=None,
    help="Where checkpoints and artifacts are exported (default: $LOOPCAST_CACHE/bench/work, "
    "LOOPCAST_CACHE defaulting to ~/.cache/loopcast).",
)
@click.option(
    "--out",
    type=click.Path(path_type=Path),
    default=None,
    help="JSON report, a PNG beside it when matplotlib is installed (default: a new timestamped "
    "file under $LOOPCAST_CACHE/bench).",
)
@_friendly_errors
def bench(
    checkpoint: str,
    device: str | None,
    dtypes: tuple[str, ...],
    variants: tuple[str, ...],
    past: int,
    widths: str,
    iters: int,
    new_tokens: int,
    alternate_tokens: int,
    no_end_to_end: bool,
    oracle_reject: str,
    passes: int,
    no_torch: bool,
    no_profile: bool,
    work_dir: Path | None,
    out: Path | None,
) -> None:
    """Time ORT steps and generation against PyTorch and the bandwidth floor (`preset:NAME` = random weights)."""
    from loopcast.bench.harness import BenchOptions, run_bench
    from loopcast.bench.report import default_report_path, format_table, write_report

    from loopcast.config import PRESETS
    from loopcast.devices import cache_root, check_device, default_device
    from loopcast.errors import RequestError

    if checkpoint.startswith("preset:") and checkpoint.split(":", 1)[1] not in PRESETS:
        raise RequestError(
            f"unknown preset {checkpoint!r}; choose from {', '.join('preset:' + name for name in PRESETS)}"
        )
    # Checked before anything is exported: a CPU-only install refuses --device cuda at once.
    device = check_device(device) if device is not None else default_device()
    work_dir = work_dir if work_dir is not None else cache_root() / "bench" / "work"
    out = out if out is not None else default_report_path(checkpoint, device)
    if out.suffix != ".json":
        raise RequestError(f"--out must name a .json file, got {out}")

    try:
        width_list = tuple(int(w) for w in widths.split(",") if w)
    except ValueError:
        raise RequestError(f"--widths must be comma-separated integers, got {widths!r}") from None
    if past < 1 or iters < 1 or passes < 1:
        raise RequestError("--past, --iters and --passes must be positive")
    from loopcast.exporter.export import MAX_VERIFY_WIDTH

    if not width_list or any(not 2 <= w <= MAX_VERIFY_WIDTH for w in width_list):
        raise RequestError(f"--widths must be verify widths in 2..{MAX_VERIFY_WIDTH}, got {widths!r}")
    try:
        rejects = tuple(float(f) for f in oracle_reject.split(",") if f)
    except ValueError:
        raise RequestError(
            f"--oracle-reject must be comma-separated fractions, got {oracle_reject!r}"
        ) from None
    if any(not 0 <= f <= 1 for f in rejects):
        raise RequestError(f"--oracle-reject fractions must be in 0..1, got {oracle_reject!r}")
    opts = BenchOptions(
        checkpoint,
        work_dir,
        device,
        dtypes or (("fp16", "bf16") if device == "cuda" else ("fp32",)),
        variants or ("stock", "batch-invariant"),
        past,
        width_list,
        iters,
        new_tokens,
        not no_end_to_end,
        alternate_tokens,
        not no_torch,
        not no_profile,
        rejects,
        passes,
    )
    click.echo(f"bench on {device}: artifacts in {work_dir}, report {out}", err=True)
    report = run_bench(
        opts,
        log=lambda line: click.echo(line, err=True),
        on_progress=lambda partial: write_report(partial, out, plot=False),
    )
    click.echo(format_table(report))
    for path in write_report(report, out):
        click.echo(f"wrote {path}")


_SERVE_EPILOG = """\b
Examples:
  loopcast export demo -o art --max-batch 8 && loopcast serve art --port 8000
  curl localhost:8000/v1/completions -d '{"model": "art", "prompt": "def main():", "max_tokens": 32}'
  loopcast serve art --ray --replicas 2 --replica-cpus 1
"""


@main.command(epilog=_SERVE_EPILOG)
@click.argument("artifact")
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", type=int, default=8000, show_default=True)
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default="cpu", show_default=True)
@click.option(
    "--max-batch",
    type=int,
    default=None,
    help="Sequences per decode step (default: the artifact's --max-batch; without batched graphs "
    "one request at a time).",
)
@click.option(
    "--max-waiting",
    type=int,
    default=256,
    show_default=True,
    help="Requests queued for a free slot; more get HTTP 503.",
)
@click.option(
    "--sequential", is_flag=True, help="One request at a time even with batched graphs (a baseline)."
)
@click.option(
    "--speculative",
    type=click.Choice(["none", "prompt-lookup"]),
    default="none",
    show_default=True,
    help="Default speculation per request (a request's `speculative` field overrides it); greedy "
    "requests only, with a cost gate per step (docs/serving.md).",
)
@click.option(
    "--cuda-graphs",
    is_flag=True,
    help="Capture the batched graphs per batch width on CUDA (opt-in; eager otherwise).",
)
@click.option("--model-name", default=None, help="Name in the API (default: the artifact directory's name).")
@click.option("--threads", type=int, default=None, help="ONNX Runtime intra-op threads.")
@click.option("--trust-ops", is_flag=True, help="Load the artifact's op library even if not built here.")
@click.option("--ray", "use_ray", is_flag=True, help="Run as a Ray Serve application (docs/serving.md).")
@click.option(
    "--replicas",
    type=int,
    default=1,
    show_default=True,
    help="Ray: replicas (0: autoscale between --min-replicas and --max-replicas).",
)
@click.option("--min-replicas", type=int, default=1, show_default=True)
@click.option("--max-replicas", type=int, default=4, show_default=True)
@click.option(
    "--target-ongoing-requests",
    type=float,
    default=8.0,
    show_default=True,
    help="Ray autoscaling: ongoing requests per replica it aims for.",
)
@click.option("--replica-cpus", type=float, default=1.0, show_default=True, help="Ray: CPUs per replica.")
@click.option("--replica-gpus", type=float, default=0.0, show_default=True, help="Ray: GPUs per replica.")
@click.option("--ray-address", default=None, help="Ray: an existing cluster (default: start a local one).")
@_friendly_errors
def serve(
    artifact: str,
    host: str,
    port: int,
    device: str,
    max_batch: int | None,
    max_waiting: int,
    sequential: bool,
    speculative: str,
    cuda_graphs: bool,
    model_name: str | None,
    threads: int | None,
    trust_ops: bool,
    use_ray: bool,
    replicas: int,
    min_replicas: int,
    max_replicas: int,
    target_ongoing_requests: float,
    replica_cpus: float,
    replica_gpus: float,
    ray_address: str | None,
) -> None:
    """Serve an artifact over an OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions)."""
    from loopcast.serve.launch import RayOptions, require_extra, serve_ray, serve_uvicorn
    from loopcast.serve.state import ServeOptions

    from loopcast.errors import RequestError

    require_extra("fastapi", "uvicorn", *(["ray"] if use_ray else []))
    if max_waiting < 0 or replicas < 0 or not 1 <= min_replicas <= max_replicas:
        raise RequestError(
            "--max-waiting and --replicas must be >= 0 and 1 <= --min-replicas <= --max-replicas"
        )
    options = ServeOptions(
        device, max_batch, max_waiting, sequential, threads, trust_ops, model_name, speculative, cuda_graphs
    )
    echo = lambda line: click.echo(line, err=True)  # noqa: E731
    if use_ray:
        serve_ray(
            artifact,
            options,
            RayOptions(
                replicas or None,
                min_replicas,
                max_replicas,
                target_ongoing_requests,
                max_ongoing_requests=max(64, max_waiting),
                replica_cpus=replica_cpus,
                replica_gpus=replica_gpus,
                address=ray_address,
            ),
            host,
            port,
            echo,
        )
    else:
        serve_uvicorn(artifact, options, host, port, echo)


@main.command("build-ops")
@click.option(
    "-o",
    "--output",
    "out_dir",
    type=click.Path(path_type=Path),
    default=None,
    help="Directory for libloopcast_ops.so (default: custom_ops/build).",
)
@click.option(
    "--ort-include",
    type=click.Path(path_type=Path),
    default=None,
    help="Directory holding onnxruntime_cxx_api.h.",
)
@_friendly_errors
def build_ops(out_dir: Path | None, ort_include: Path | None) -> None:
    """Compile the `loopcast` custom-op library (CPU kernels)."""
    from loopcast.custom_ops.build import build_library

    click.echo(f"built {build_library(out_dir, ort_include)}")


@main.command()
@click.option("--prompt", default=None, help="Prompt text (default: a built-in code prompt).")
@click.option("--max-new-tokens", type=int, default=128, show_default=True)
@click.option(
    "--speculative",
    type=click.Choice(["auto", "none", "prompt-lookup", "self", "pipeline"]),
    default="auto",
    show_default=True,
    help="auto measures each mode against plain decode and keeps the fastest.",
)
@_friendly_errors
def demo(prompt: str | None, max_new_tokens: int, speculative: str) -> None:
    """Export the shipped demo model (once, into the cache) and generate on the CPU."""
    from loopcast.exporter.demo_artifact import demo_artifact_dir
    from loopcast.ort_runtime import load

    from loopcast.demo_checkpoint import DEMO_PROMPT
    from loopcast.errors import RequestError

    if max_new_tokens < 1:  # the demo compares tokens/s: nothing generated, nothing to compare
        raise RequestError(f"--max-new-tokens must be >= 1 for the demo, got {max_new_tokens}")
    artifact = demo_artifact_dir(progress=True)
    model = load(artifact)
    prompt = prompt or DEMO_PROMPT
    modes = {
        "auto": ["prompt-lookup", "self", "pipeline"],
        "none": [],
        "prompt-lookup": ["prompt-lookup"],
        "self": ["self"],
        "pipeline": ["pipeline"],
    }[speculative]
    if "pipeline" in modes and not model.loaded.manifest.graphs.get(GraphKind.CYCLE):
        modes.remove("pipeline")  # a stock-op artifact has no cycle graph
    if modes and not model.loaded.exact_verify:
        click.echo(
            "note: this demo artifact was exported with stock ops (the custom-op library could not be "
            "built here), so speculation would not be exact and is skipped; see docs/architecture.md"
        )
        modes = []
    # Warm-up: every graph kind's first run (allocations, thread start) stays out of the timings.
    model.generate(prompt, 8)
    for mode in modes:
        model.generate(prompt, 8, speculative=mode)
    # Three rounds, the modes interleaved, the median of each: one run of a few hundred
    # milliseconds on a shared CPU varies by 10-20%, and interleaving spreads drift over all modes.
    labels = ["plain greedy"] + [f"{mode} (gate auto)" for mode in modes]
    runs: dict[str, list] = {label: [] for label in labels}
    for _ in range(3):
        runs["plain greedy"].append(model.generate(prompt, max_new_tokens))
        for mode in modes:
            result = model.generate(prompt, max_new_tokens, speculative=mode)
            if result.tokens != runs["plain greedy"][0].tokens:
                raise AssertionError(f"{mode} diverged from plain greedy")  # a bug, not bad input
            runs[f"{mode} (gate auto)"].append(result)
    rates = {label: sorted(r.stats.tokens_per_second for r in rs) for label, rs in runs.items()}
    best_label = max(labels, key=lambda label: rates[label][1])
    best = runs[best_label][-1]
    click.echo(f"artifact: {artifact}")
    click.echo(prompt + (best.text or ""))
    click.echo("-" * 60)
    base = rates["plain greedy"][1]
    for label in labels:
        last = runs[label][-1].stats
        low, mid, high = rates[label]
        extra = f", {last.accepted}/{last.proposed} drafts accepted" if last.rounds else ""
        click.echo(
            f"{label:<24} {mid:8.1f} tok/s (range {low:.0f}-{high:.0f})  x{mid / base:.2f} vs plain{extra}"
        )
        if last.gate_report:
            click.echo(f"{'':<24} gate: {last.gate_report['reason']}")
    click.echo(
        f"best: {best_label}; {len(best.tokens)} tokens, identical to plain greedy (medians of 3 "
        "interleaved runs; `loopcast bench demo --device cpu` measures more)"
    )


if __name__ == "__main__":  # pragma: no cover
    main()
