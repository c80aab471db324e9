"""``loopcast demo``: the shipped demo model, plain against speculative decoding."""

from __future__ import annotations

import click
from loopcast.cli.options import CLI_MODES

from loopcast.vocab import GraphKind, SpeculativeMode


@click.command()
@click.option("--prompt", default=None, help="Prompt text (default: a built-in code prompt).")
@click.option("--max-new-tokens", type=int, default=128, show_default=True)
@click.option(
    "--speculative",
    type=click.Choice(["auto", *CLI_MODES]),
    default="auto",
    show_default=True,
    help="auto measures each mode against plain decode and keeps the fastest.",
)
@click.option(
    "--repeats",
    type=int,
    default=5,
    show_default=True,
    help="Interleaved runs per mode; the medians and the spread are printed.",
)
def demo(prompt: str | None, max_new_tokens: int, speculative: str, repeats: int) -> None:
    """Export the shipped demo model (once, into the cache) and generate on the CPU."""
    from loopcast.exporter.demo_artifact import demo_artifact_dir, library_available
    from loopcast.ort_runtime import load

    from loopcast.demo_checkpoint import DEMO_PROMPT
    from loopcast.errors import RequestError

    if max_new_tokens < 1:  # the demo compares tokens/s: nothing generated, nothing to compare
        raise RequestError(f"--max-new-tokens must be >= 1 for the demo, got {max_new_tokens}")
    if repeats < 1:
        raise RequestError(f"--repeats must be >= 1, got {repeats}")
    artifact = demo_artifact_dir(progress=True)
    model = load(artifact)
    prompt = prompt or DEMO_PROMPT
    if speculative == "auto":
        modes = [mode for mode in CLI_MODES if mode != SpeculativeMode.NONE]
    else:
        modes = [] if speculative == SpeculativeMode.NONE else [speculative]
    if modes and not model.loaded.exact_verify:
        why = (
            "the loopcast op library could be had now: run `loopcast demo` again to re-export"
            if library_available()
            else "the loopcast op library cannot be built here: the ONNX Runtime C headers are missing"
        )
        click.echo(
            "note: speculation skipped, only plain greedy runs: this demo artifact has stock graphs, "
            f"whose verify rows are not exact ({why}). Fix: tools/c_generate/fetch_deps.sh, then "
            "`loopcast demo` (it re-exports by itself)."
        )
        modes = []
    if SpeculativeMode.PIPELINE in modes and not model.loaded.manifest.graphs.get(GraphKind.CYCLE):
        modes.remove(SpeculativeMode.PIPELINE)  # a stock-op artifact has no cycle graph
    _compare(model, artifact, prompt, max_new_tokens, modes, repeats)


def _compare(model, artifact, prompt: str, max_new_tokens: int, modes: list, repeats: int) -> None:
    """Plain greedy against each mode, interleaved run by run: the medians, the spread, and for a
    mode whose gate stood down, that (it then decoded plainly: no ratio to speak of)."""
    import statistics

    # Warm-up: every graph kind's first run (allocations, thread start) stays out of the timings.
    model.generate(prompt, 8)
    for mode in modes:
        model.generate(prompt, 8, speculative=mode)
    plain = "plain greedy"
    labels = [plain] + [f"{mode} (gate auto)" for mode in modes]
    runs: dict[str, list] = {label: [] for label in labels}
    # Interleaved: on a shared CPU one run varies by 10-20%, and drift then spreads over all modes.
    for _ in range(repeats):
        runs[plain].append(model.generate(prompt, max_new_tokens))
        for mode in modes:
            result = model.generate(prompt, max_new_tokens, speculative=mode)
            if result.tokens != runs[plain][0].tokens:
                raise AssertionError(f"{mode} diverged from plain greedy")  # a bug, not bad input
            runs[f"{mode} (gate auto)"].append(result)
    rates = {label: [r.stats.tokens_per_second for r in rs] for label, rs in runs.items()}
    median = {label: statistics.median(rates[label]) for label in labels}
    click.echo(f"artifact: {artifact}")
    click.echo(prompt + (runs[plain][-1].text or ""))
    click.echo("-" * 60)
    base = median[plain]
    engaged = []
    for label in labels:
        low, high = min(rates[label]), max(rates[label])
        line = f"{label:<24} {median[label]:8.1f} tok/s (range {low:.0f}-{high:.0f})"
        if label == plain:
            click.echo(line)
            continue
        stats = runs[label][-1].stats
        report = stats.gate_report
        probes_only = report and report.get("rounds_on", 0) <= report.get("probes", 0)
        if not stats.rounds or probes_only:
            click.echo(f"{line}  gate stood down: plain decoding ({report.get('reason', 'no drafts')})")
            continue
        engaged.append(label)
        click.echo(
            f"{line}  x{median[label] / base:.2f} vs plain, {stats.accepted}/{stats.proposed} drafts accepted"
        )
    click.echo(_verdict(engaged, rates, median, plain, repeats, bool(labels[1:])))


def _verdict(engaged: list[str], rates: dict, median: dict, plain: str, repeats: int, any_mode: bool) -> str:
    spread = f"medians of {repeats} interleaved runs; `loopcast bench demo --device cpu` measures more"
    if not any_mode:
        return f"plain greedy only ({spread})"
    same = "every speculative run returned plain greedy's tokens"
    if not engaged:
        return f"plain greedy: every mode's gate stood down on this prompt ({same}; {spread})"
    faster = [label for label in engaged if median[label] > median[plain]]
    if not faster:
        return f"fastest: plain greedy; no speculative mode beat it on this prompt ({same}; {spread})"
    best = max(faster, key=lambda label: median[label])
    clear = min(rates[best]) > max(rates[plain])
    how = "beyond the spread of plain's runs" if clear else "within the spread of plain's runs"
    return f"fastest: {best}, x{median[best] / median[plain]:.2f} vs plain, {how} ({same}; {spread})"
