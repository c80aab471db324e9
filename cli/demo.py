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
    if speculative == "auto":
        modes = [mode for mode in CLI_MODES if mode != SpeculativeMode.NONE]
    else:
        modes = [] if speculative == SpeculativeMode.NONE else [speculative]
    if SpeculativeMode.PIPELINE in modes and not model.loaded.manifest.graphs.get(GraphKind.CYCLE):
        modes.remove(SpeculativeMode.PIPELINE)  # a stock-op artifact has no cycle graph
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
