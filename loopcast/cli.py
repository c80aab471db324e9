"""The ``loopcast`` command line. Heavy imports happen inside commands, not at import time."""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path

import click

from loopcast.errors import LoopcastError


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
        raise RequestError(f"--prompt-ids must be comma-separated or space-separated integers (not both, "
                           f"no empty entries), got {text!r}")
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
@click.option("--verify", is_flag=True, help="Artifact: also check the SHA-256 of every file the manifest records.")
@_friendly_errors
def inspect(path: str, verify: bool) -> None:
    """Explain a checkpoint directory (or `demo`) or an exported artifact."""
    if not Path(path).exists():
        from loopcast.swap import recover
        recover(Path(path), clean=False)  # an export killed mid-swap: put the artifact back
    if (Path(path) / "manifest.json").is_file():
        from loopcast.ort_runtime.artifact import describe_artifact
        click.echo(describe_artifact(Path(path), verify=verify))
        return
    if verify:
        from loopcast.errors import RequestError
        raise RequestError(f"{path}: --verify checks an exported artifact; this is not one (no manifest.json)")
    from loopcast.exporter.inspect_checkpoint import describe_checkpoint
    click.echo(describe_checkpoint(path))


@main.command("random-checkpoint")
@click.argument("out_dir", type=click.Path(path_type=Path))
@click.option("--preset", default="tiny-ouro", show_default=True,
              help="Shape preset: tiny-ouro, tiny-llama or ouro-1.4b.")
@click.option("--dtype", type=click.Choice(["fp32", "fp16", "bf16"]), default="fp32", show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--max-shard-mb", type=int, default=None, help="Shard the weights above this size.")
@_friendly_errors
def random_checkpoint(out_dir: Path, preset: str, dtype: str, seed: int, max_shard_mb: int | None) -> None:
    """Write a random-weight Hugging Face checkpoint of a preset shape."""
    from loopcast.config import PRESETS
    from loopcast.errors import ConfigError
    from loopcast.exporter.checkpoint import DTYPES
    from loopcast.exporter.random_checkpoint import write_random_checkpoint

    if preset not in PRESETS:
        raise ConfigError(f"unknown preset {preset!r}; choose from {', '.join(PRESETS)}")
    config = PRESETS[preset]
    if max_shard_mb is not None and max_shard_mb < 1:
        raise ConfigError(f"--max-shard-mb must be >= 1, got {max_shard_mb}")
    try:
        path = write_random_checkpoint(config, out_dir, seed=seed, dtype=DTYPES[dtype],
                                       max_shard_bytes=max_shard_mb * 2**20 if max_shard_mb else None)
    except OSError as exc:  # an unwritable or full destination is the user's input, not a bug
        from loopcast.errors import CheckpointError
        raise CheckpointError(f"{exc.filename or out_dir}: cannot write the checkpoint "
                              f"({exc.strerror or exc})") from None
    click.echo(f"wrote {path}")


@main.command()
@click.argument("checkpoint")
@click.option("-o", "--output", "out_dir", required=True, type=click.Path(path_type=Path),
              help="Artifact directory to create.")
@click.option("--dtype", type=click.Choice(["fp32", "fp16", "bf16"]), default="fp32", show_default=True)
@click.option("--max-length", type=int, default=None, help="KV capacity S_max (default: min(max positions, 4096)).")
@click.option("--verify-width", type=int, default=5, show_default=True, help="Rows W of verify/verify_tail.")
@click.option("--draft-depth", type=int, default=None, help="Loops of the draft graph (default 1 when R > 1).")
@click.option("--batch-invariant", is_flag=True,
              help="Use the loopcast custom ops (built and copied into the artifact) so that every "
                   "verify row equals the M=1 decode row bit for bit.")
@click.option("--target", type=click.Choice(["cpu", "cuda"]), default="cpu", show_default=True,
              help="Device the artifact is for. cuda implies --batch-invariant: on a GPU the loopcast ops are "
                   "faster than the stock ones, and only their graphs can be captured (docs/perf.md).")
@click.option("--overwrite", is_flag=True, help="Replace an existing artifact at the output path.")
@_friendly_errors
def export(checkpoint: str, out_dir: Path, dtype: str, max_length: int | None, verify_width: int,
           draft_depth: int | None, batch_invariant: bool, target: str, overwrite: bool) -> None:
    """Export a checkpoint directory (or `demo`) into an ONNX artifact directory."""
    from loopcast.exporter.export import ExportOptions, export_checkpoint

    # On the CPU the stock ops stay the default: MLAS beats the custom kernels there.
    options = ExportOptions(dtype, max_length, verify_width, draft_depth, batch_invariant or target == "cuda")
    manifest = export_checkpoint(checkpoint, out_dir, options, progress=True, overwrite=overwrite)
    kinds = ", ".join(f"{k}({v.rows or 'M'})" for k, v in manifest.graphs.items())
    click.echo(f"wrote {out_dir}: {kinds}; dtype {manifest.dtype}, max length {manifest.max_length}")


@main.command()
@click.argument("path")
@click.option("--backend", type=click.Choice(["ort", "torch"]), default="ort", show_default=True,
              help="ort runs an exported artifact; torch runs the reference on a checkpoint dir.")
@click.option("--prompt", help="Prompt text (needs the tokenizer).")
@click.option("--prompt-ids", help="Prompt as token ids separated by commas or spaces: 1,2,3 or \"1 2 3\".")
@click.option("--max-new-tokens", type=int, default=64, show_default=True)
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default="cpu", show_default=True)
@click.option("--speculative", type=click.Choice(["none", "prompt-lookup", "self"]), default="none",
              show_default=True)
@click.option("--num-draft-tokens", type=int, default=None, help="K drafts per round.")
@click.option("--draft-depth", type=int, default=None, help="Loops the self-draft runs (< R).")
@click.option("--gate", type=click.Choice(["none", "hit-density", "cost"]), default="none", show_default=True)
@click.option("--stream", is_flag=True, help="Print text as tokens are committed.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object (tokens, text, stats).")
@click.option("--trust-ops", is_flag=True,
              help="Load the artifact's native custom-op library even if you did not build it (runs its code; "
                   "docs/trust.md).")
@_friendly_errors
def generate(path: str, backend: str, prompt: str | None, prompt_ids: str | None, max_new_tokens: int,
             device: str, speculative: str, num_draft_tokens: int | None, draft_depth: int | None,
             gate: str, stream: bool, as_json: bool, trust_ops: bool) -> None:
    """Greedy generation from a prompt."""
    from loopcast.errors import RequestError

    if (prompt is None) == (prompt_ids is None):
        raise RequestError("give exactly one of --prompt and --prompt-ids")
    if max_new_tokens < 0:
        raise RequestError(f"--max-new-tokens must be >= 0, got {max_new_tokens}")
    ids = _parse_ids(prompt_ids) if prompt_ids is not None else None
    if backend == "torch":
        if speculative != "none" or device != "cpu":
            raise RequestError("--backend torch runs plain greedy on the CPU only")
        from loopcast.exporter.torch_backend import generate_with_reference
        result = generate_with_reference(path, prompt, ids, max_new_tokens)
    else:
        from loopcast.ort_runtime.cli_generate import generate_with_ort
        result = generate_with_ort(path, prompt, ids, max_new_tokens, device=device,
                                   speculative=speculative, num_draft_tokens=num_draft_tokens,
                                   draft_depth=draft_depth, gate=gate, trust_ops=trust_ops,
                                   on_text=(lambda t: click.echo(t, nl=False)) if stream and not as_json else None)
    if as_json:
        click.echo(json.dumps(result))
    elif not stream:
        click.echo(result["text"] if result.get("text") is not None else
                   ",".join(str(t) for t in result["tokens"]))
    else:
        click.echo()


@main.command()
@click.argument("checkpoint", default="demo")
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default="cuda", show_default=True)
@click.option("--dtype", "dtypes", multiple=True, type=click.Choice(["fp32", "fp16", "bf16"]),
              help="Repeatable (default: fp16 and bf16 on cuda, fp32 on cpu).")
@click.option("--variant", "variants", multiple=True, type=click.Choice(["stock", "batch-invariant"]),
              help="Graph variants to compare (default: both).")
@click.option("--past", type=int, default=1024, show_default=True, help="KV length the steps attend over.")
@click.option("--widths", default="2,5,8", show_default=True, help="Verify widths W (comma-separated).")
@click.option("--iters", type=int, default=50, show_default=True, help="Timed runs per step kind.")
@click.option("--new-tokens", type=int, default=128, show_default=True, help="Tokens per end-to-end prompt.")
@click.option("--alternate-tokens", type=int, default=1000, show_default=True,
              help="Length of the decode/draft/verify alternation run (CUDA).")
@click.option("--no-end-to-end", is_flag=True, help="Skip the end-to-end tokens/s rows.")
@click.option("--no-torch", is_flag=True, help="Skip the PyTorch baseline.")
@click.option("--no-profile", is_flag=True, help="Skip the per-kernel-family decode profile (CUDA).")
@click.option("--work-dir", type=click.Path(path_type=Path), default=Path("bench-work"), show_default=True,
              help="Where checkpoints and artifacts are exported.")
@click.option("--out", type=click.Path(path_type=Path), default=Path("bench-results/bench.json"),
              show_default=True, help="JSON report (a PNG beside it when matplotlib is installed).")
@_friendly_errors
def bench(checkpoint: str, device: str, dtypes: tuple[str, ...], variants: tuple[str, ...], past: int, widths: str,
          iters: int, new_tokens: int, alternate_tokens: int, no_end_to_end: bool, no_torch: bool,
          no_profile: bool, work_dir: Path, out: Path) -> None:
    """Time ORT steps and generation against PyTorch and the bandwidth floor (`preset:NAME` = random weights)."""
    from loopcast.bench import BenchOptions, format_table, run_bench, write_report
    from loopcast.config import PRESETS
    from loopcast.errors import RequestError

    if checkpoint.startswith("preset:") and checkpoint.split(":", 1)[1] not in PRESETS:
        raise RequestError(f"unknown preset {checkpoint!r}; choose from "
                           f"{', '.join('preset:' + name for name in PRESETS)}")
    try:
        width_list = tuple(int(w) for w in widths.split(",") if w)
    except ValueError:
        raise RequestError(f"--widths must be comma-separated integers, got {widths!r}") from None
    if past < 1 or iters < 1:
        raise RequestError("--past and --iters must be positive")
    from loopcast.exporter.export import MAX_VERIFY_WIDTH
    if not width_list or any(not 2 <= w <= MAX_VERIFY_WIDTH for w in width_list):
        raise RequestError(f"--widths must be verify widths in 2..{MAX_VERIFY_WIDTH}, got {widths!r}")
    opts = BenchOptions(checkpoint, work_dir, device, dtypes or (("fp16", "bf16") if device == "cuda" else ("fp32",)),
                        variants or ("stock", "batch-invariant"), past, width_list, iters, new_tokens,
                        not no_end_to_end, alternate_tokens, not no_torch, not no_profile)
    report = run_bench(opts, log=lambda line: click.echo(line, err=True),
                       on_progress=lambda partial: write_report(partial, out, plot=False))
    click.echo(format_table(report))
    for path in write_report(report, out):
        click.echo(f"wrote {path}")


@main.command("build-ops")
@click.option("-o", "--output", "out_dir", type=click.Path(path_type=Path), default=None,
              help="Directory for libloopcast_ops.so (default: custom_ops/build).")
@click.option("--ort-include", type=click.Path(path_type=Path), default=None,
              help="Directory holding onnxruntime_cxx_api.h.")
@_friendly_errors
def build_ops(out_dir: Path | None, ort_include: Path | None) -> None:
    """Compile the `loopcast` custom-op library (CPU kernels)."""
    from loopcast.custom_ops.build import build_library

    click.echo(f"built {build_library(out_dir, ort_include)}")


@main.command()
@click.option("--prompt", default=None, help="Prompt text (default: a built-in code prompt).")
@click.option("--max-new-tokens", type=int, default=128, show_default=True)
@click.option("--speculative", type=click.Choice(["auto", "none", "prompt-lookup", "self"]), default="auto",
              show_default=True, help="auto measures each mode against plain decode and keeps the fastest.")
@_friendly_errors
def demo(prompt: str | None, max_new_tokens: int, speculative: str) -> None:
    """Export the shipped demo model (once, into the cache) and generate on the CPU."""
    from loopcast.demo import DEMO_PROMPT, demo_artifact_dir
    from loopcast.errors import RequestError
    from loopcast.ort_runtime import load

    if max_new_tokens < 1:  # the demo compares tokens/s: nothing generated, nothing to compare
        raise RequestError(f"--max-new-tokens must be >= 1 for the demo, got {max_new_tokens}")
    artifact = demo_artifact_dir(progress=True)
    model = load(artifact)
    prompt = prompt or DEMO_PROMPT
    modes = {"auto": [("prompt-lookup", "hit-density"), ("self", "cost")], "none": [],
             "prompt-lookup": [("prompt-lookup", "hit-density")], "self": [("self", "cost")]}[speculative]
    # Warm-up: every graph kind's first run (allocations, thread start) stays out of the timings.
    model.generate(prompt, 8)
    for mode, gate in modes:
        model.generate(prompt, 8, speculative=mode, gate=gate)
    plain = model.generate(prompt, max_new_tokens)
    best, best_label = plain, "plain greedy"
    rows = [("plain greedy", plain)]
    for mode, gate in modes:
        result = model.generate(prompt, max_new_tokens, speculative=mode, gate=gate)
        if result.tokens != plain.tokens:
            raise AssertionError(f"{mode} diverged from plain greedy")  # a bug, not bad input
        label = f"{mode} (gate {gate})"
        rows.append((label, result))
        if result.stats.tokens_per_second > best.stats.tokens_per_second:
            best, best_label = result, label
    click.echo(f"artifact: {artifact}")
    click.echo(prompt + (best.text or ""))
    click.echo("-" * 60)
    base = plain.stats.tokens_per_second
    for label, result in rows:
        extra = (f", {result.stats.accepted}/{result.stats.proposed} drafts accepted"
                 if result.stats.rounds else "")
        click.echo(f"{label:<32} {result.stats.tokens_per_second:8.1f} tok/s  "
                   f"x{result.stats.tokens_per_second / base:.2f} vs plain{extra}")
    click.echo(f"best: {best_label}; {len(best.tokens)} tokens, identical to plain greedy")


if __name__ == "__main__":  # pragma: no cover
    main()
