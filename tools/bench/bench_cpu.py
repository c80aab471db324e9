"""CPU benchmark of the demo model: torch reference vs ONNX Runtime, and the speculation matrix.

    python -m tools.bench.bench_cpu                 # full run (~7 min on 2 cores), JSON → docs/perf-cpu.json
    python -m tools.bench.bench_cpu --quick         # smoke run (2 prompts, 32 tokens, 1 pass), JSON → /tmp

What it measures, all in one process on the shipped demo model (fp32, max length 1024):

1. **Baseline** — the torch reference's eager cached greedy loop
   (``exporter/reference_generate.greedy_generate``) against ORT plain greedy
   (``LoopcastModel.generate(speculative="none")``) on the *code* workload; tokens/s of each,
   the ratio ORT/torch, and whether the two produce the same tokens.
2. **Speculation matrix** on two workloads:
     * ``code`` — code continuation: 200 characters of a held-out document starting at its
       first ``def`` line;
     * ``edit`` — an edit-style prompt that the model continues by copying: 300 characters from
       the same place, a newline, then the snippet's first 40 characters again.
   Rows: plain; prompt lookup with K = 2, 4 and gate none / hit-density; self-speculation with
   draft depth d = 1 (K = 2, 4 on the verify-width-5 artifact, K = 6 on a width-7 one) and
   d = 2 (K = 2, 4), gate none / cost. Per row: tokens/s, the ratio to plain measured on the
   same workload in the same run, the acceptance rate (accepted / proposed drafts),
   tokens per speculative round ((accepted + rounds) / rounds) and ``same``: whether every
   prompt's tokens equal plain greedy's. Speculation is exact greedy, so any ``no`` is a bug.

How it measures:
  * The three artifacts (W5/d1 — the same options as ``loopcast.exporter.demo_artifact.demo_artifact_dir`` —,
    W7/d1 and W5/d2) are exported fresh into a temporary directory, so they match the code
    being benchmarked (export takes a few seconds).
  * Prompts: 8 held-out documents (``tools/demo_corpus.read_split_with_paths("heldout")``),
    evenly spaced among those with a ``def`` line, in sorted path order — deterministic.
  * Every run generates exactly ``--max-new-tokens`` (128) tokens: ``stop_ids=()``.
  * Each path / artifact is warmed up once (a short run per mode) before anything is timed.
  * A configuration's speed is sum(tokens) / sum(wall seconds) over all prompts of its
    workload, the wall clock taken around each ``generate`` / ``greedy_generate`` call.
  * The whole set of configurations is measured ``--repeats`` (2) times and each configuration
    keeps its faster pass: the machine is shared, so the faster pass is the one less disturbed
    by other load. Passes run one after the other; inside a pass the configurations take turns
    prompt by prompt, so a burst of outside load is spread over many configurations.
  * Threads: ORT uses its default intra-op pool (no spinning, see ort_runtime/loading/artifact.py);
    torch runs with ``--torch-threads`` (default 1). On the 2-core demo machine one torch
    thread is as fast as two when the machine is idle (~35-39 vs ~31-36 tokens/s) and is not
    wrecked by other load: with one other busy process, two OpenMP threads fell to ~11 tokens/s
    (and to ~4 under heavier load) while one thread stayed at ~39. Pass ``--torch-threads 2``
    to measure torch's default.
  * The cost gate reads the generator's step timers, which accumulate over the runs made on
    the same loaded model, so its decisions depend on what ran before (as in a long-lived
    process); the order of configurations is fixed.

Output: a progress line per configuration and pass, the markdown tables last (to paste into
docs/perf.md), and a JSON file with every number plus machine info. The exit status is 1 when
any tokens differ from plain greedy (the JSON and tables are still written).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import onnxruntime
import torch
from loopcast.exporter.checkpoint import load_checkpoint
from loopcast.exporter.export import ExportOptions, export_checkpoint
from loopcast.exporter.reference_generate import greedy_generate
from loopcast.ort_runtime import load

from loopcast import __version__

if __package__:
    from .demo_corpus import read_split_with_paths
    from .demo_prompts import CODE_CHARS, EDIT_CHARS, EDIT_REPEAT_CHARS, cut_at_line_end, cut_at_word_end
    from .demo_prompts import select_snippets as _select_snippets
else:  # run as a script: tools/ is on sys.path
    from demo_corpus import read_split_with_paths
    from demo_prompts import CODE_CHARS, EDIT_CHARS, EDIT_REPEAT_CHARS, cut_at_line_end, cut_at_word_end
    from demo_prompts import select_snippets as _select_snippets

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = "docs/perf-cpu.json"
QUICK_OUT = "/tmp/loopcast-perf-cpu-quick.json"
MAX_LENGTH = 1024

# Artifacts: name → (verify width, draft depth). "w5d1" has demo_artifact_dir()'s options.
ARTIFACTS = {"w5d1": (5, 1), "w7d1": (7, 1), "w5d2": (5, 2)}


# -- configurations ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Config:
    mode: str  # "none", "prompt-lookup", "self"
    k: int | None = None  # drafts per round
    gate: str = "none"
    artifact: str = "w5d1"

    @property
    def depth(self) -> int | None:
        return ARTIFACTS[self.artifact][1] if self.mode == "self" else None

    @property
    def label(self) -> str:
        if self.mode == "none":
            return "plain"
        name = "prompt lookup" if self.mode == "prompt-lookup" else f"self d={self.depth}"
        return f"{name} K={self.k} gate={self.gate}"


PLAIN = Config("none")


def matrix() -> list[Config]:
    """Every row of the speculation matrix, plain first (the order they are measured in)."""
    rows = [PLAIN]
    rows += [Config("prompt-lookup", k, gate) for k in (2, 4) for gate in ("none", "hit-density")]
    rows += [Config("self", k, gate, "w5d1") for k in (2, 4) for gate in ("none", "cost")]
    rows += [Config("self", 6, gate, "w7d1") for gate in ("none", "cost")]
    rows += [Config("self", k, gate, "w5d2") for k in (2, 4) for gate in ("none", "cost")]
    return rows


# -- prompts -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Workload:
    name: str
    prompts: list[str]
    sources: list[str]  # relpath:char offset of each prompt


def select_snippets(count: int) -> list[tuple[str, int, str]]:
    """``count`` held-out documents of this interpreter's stdlib (sorted path order), each as
    (relpath, offset of its first ``def`` line, document text): demo_prompts.select_snippets."""
    return _select_snippets(read_split_with_paths("heldout"), count)


def make_workloads(count: int) -> dict[str, Workload]:
    """``code``: ~200 characters from the first ``def`` line, whole lines. ``edit``: ~300
    characters from the same place (whole lines), a newline, then its first ~40 characters."""
    snippets = select_snippets(count)
    sources = [f"{relpath}:{start}" for relpath, start, _ in snippets]
    code = [cut_at_line_end(text[start:], CODE_CHARS) for _, start, text in snippets]
    edit = []
    for _, start, text in snippets:
        snippet = cut_at_line_end(text[start:], EDIT_CHARS) + "\n"
        edit.append(snippet + "\n" + cut_at_word_end(snippet, EDIT_REPEAT_CHARS))
    return {"code": Workload("code", code, sources), "edit": Workload("edit", edit, sources)}


# -- measuring ---------------------------------------------------------------------------------


@dataclass
class Pass:
    """One configuration over all prompts of a workload, once."""

    tokens: list[list[int]]
    seconds: float
    rounds: int = 0
    proposed: int = 0
    accepted: int = 0
    steps: dict[str, int] = field(default_factory=dict)
    differs_between_passes: bool = False  # set when another pass of it made other tokens

    @property
    def new_tokens(self) -> int:
        return sum(len(t) for t in self.tokens)

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.seconds


TORCH = "torch"  # the job key of the torch reference (ORT jobs are keyed by their Config)


def run_ort(model, config: Config, ids: list[int], max_new_tokens: int, into: Pass) -> None:
    """One ORT generation of one prompt, added to ``into``."""
    start = time.perf_counter()
    out = model.generate(
        ids, max_new_tokens, speculative=config.mode, gate=config.gate, num_draft_tokens=config.k, stop_ids=()
    )
    into.seconds += time.perf_counter() - start
    into.tokens.append(out.tokens)
    into.rounds += out.stats.rounds
    into.proposed += out.stats.proposed
    into.accepted += out.stats.accepted
    for kind, n in out.stats.steps.items():
        into.steps[kind] = into.steps.get(kind, 0) + n


def run_torch(reference, ids: list[int], max_new_tokens: int, into: Pass) -> None:
    """One torch reference generation (eager, cached) of one prompt, added to ``into``."""
    start = time.perf_counter()
    out = greedy_generate(reference, ids, max_new_tokens, max_length=MAX_LENGTH, stop_ids=())
    into.seconds += time.perf_counter() - start
    into.tokens.append(out.tokens)


def warm_up(models: dict, reference, prompt_ids: list[int], configs: list[Config]) -> None:
    """One short run of every (artifact, mode) pair used, and of the torch path."""
    greedy_generate(reference, prompt_ids, 16, max_length=MAX_LENGTH, stop_ids=())
    seen = set()
    for config in [PLAIN] + configs:
        for artifact in [config.artifact] if config.mode != "none" else list(models):
            key = (artifact, config.mode, config.k)
            if key not in seen:
                seen.add(key)
                models[artifact].generate(
                    prompt_ids, 16, speculative=config.mode, num_draft_tokens=config.k, stop_ids=()
                )


def first_mismatch(tokens: list[list[int]], plain: list[list[int]]) -> dict | None:
    """The first prompt (and position) where ``tokens`` differ from plain greedy's, or None."""
    for i, (got, want) in enumerate(zip(tokens, plain, strict=True)):
        if got != want:
            pos = next((j for j, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
            return {
                "prompt": i,
                "position": pos,
                "got": got[pos : pos + 8],
                "plain": want[pos : pos + 8],
                "lengths": [len(got), len(want)],
            }
    return None


# -- the benchmark -----------------------------------------------------------------------------


def export_artifacts(root: Path) -> dict[str, Path]:
    paths = {}
    for name, (width, depth) in ARTIFACTS.items():
        paths[name] = root / name
        export_checkpoint(
            "demo",
            paths[name],
            ExportOptions(dtype="fp32", max_length=MAX_LENGTH, verify_width=width, draft_depth=depth),
        )
    return paths


def measure(args, models: dict, reference, workloads: dict[str, Workload]) -> tuple[dict, dict]:
    """Interleaved passes → (fastest Pass per (workload, job), every pass's seconds).

    Within a pass, the jobs take turns prompt by prompt (prompt 1 for every job, then prompt 2,
    ...), so a burst of load from elsewhere on the machine hits many jobs a little rather than
    one job a lot."""
    encode = models["w5d1"].encode
    ids = {w: [encode(p) for p in wl.prompts] for w, wl in workloads.items()}
    jobs = [("code", TORCH)] + [(w, c) for w in workloads for c in matrix()]
    best: dict = {}
    seconds: dict = {}
    for rep in range(args.repeats):
        passes = {job: Pass([], 0.0) for job in jobs}
        for i in range(args.prompts):
            for workload, job in jobs:
                if job == TORCH:
                    run_torch(reference, ids[workload][i], args.max_new_tokens, passes[(workload, job)])
                else:
                    run_ort(
                        models[job.artifact],
                        job,
                        ids[workload][i],
                        args.max_new_tokens,
                        passes[(workload, job)],
                    )
            print(f"pass {rep + 1}/{args.repeats}: prompt {i + 1}/{args.prompts} done", flush=True)
        for key, result in passes.items():
            seconds.setdefault(key, []).append(result.seconds)
            previous = best.get(key)
            if previous is None or result.seconds < previous.seconds:
                best[key] = result
            if previous is not None:
                best[key].differs_between_passes = (
                    previous.differs_between_passes or result.tokens != previous.tokens
                )
            workload, job = key
            label = "torch reference (eager)" if job == TORCH else f"ORT {job.label}"
            print(
                f"pass {rep + 1}/{args.repeats}  {workload:4s}  {label:38s} "
                f"{result.tokens_per_second:7.1f} tok/s",
                flush=True,
            )
    return best, seconds


def summarize(best: dict, seconds: dict, workloads: dict[str, Workload]) -> tuple[dict, list[dict]]:
    torch_pass, ort_pass = best[("code", TORCH)], best[("code", PLAIN)]
    baseline = {
        "workload": "code",
        "torch_tokens_per_second": torch_pass.tokens_per_second,
        "ort_tokens_per_second": ort_pass.tokens_per_second,
        "ort_over_torch": ort_pass.tokens_per_second / torch_pass.tokens_per_second,
        "torch_seconds_per_pass": seconds[("code", TORCH)],
        "ort_seconds_per_pass": seconds[("code", PLAIN)],
        "tokens": torch_pass.new_tokens,
        "same": torch_pass.tokens == ort_pass.tokens,
        "mismatch": first_mismatch(torch_pass.tokens, ort_pass.tokens),
    }
    rows = []
    for workload in workloads:
        plain = best[(workload, PLAIN)]
        for config in matrix():
            result = best[(workload, config)]
            mismatch = first_mismatch(result.tokens, plain.tokens)
            rows.append(
                {
                    "workload": workload,
                    "label": config.label,
                    "mode": config.mode,
                    "k": config.k,
                    "gate": config.gate,
                    "draft_depth": config.depth,
                    "verify_width": ARTIFACTS[config.artifact][0] if config.mode != "none" else None,
                    "artifact": config.artifact if config.mode != "none" else None,
                    "tokens": result.new_tokens,
                    "seconds": result.seconds,
                    "seconds_per_pass": seconds[(workload, config)],
                    "tokens_per_second": result.tokens_per_second,
                    "ratio_to_plain": result.tokens_per_second / plain.tokens_per_second,
                    "rounds": result.rounds,
                    "proposed": result.proposed,
                    "accepted": result.accepted,
                    "acceptance": result.accepted / result.proposed if result.proposed else None,
                    "tokens_per_round": (result.accepted + result.rounds) / result.rounds
                    if result.rounds
                    else None,
                    "steps": result.steps,
                    "same": mismatch is None and not result.differs_between_passes,
                    "mismatch": mismatch,
                    "differs_between_passes": result.differs_between_passes,
                }
            )
    return baseline, rows


def machine_info() -> dict:
    model_name = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model_name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        commit = subprocess.run(
            ["git", "-C", str(REPO_ROOT), "describe", "--always", "--dirty"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = None
    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "platform": platform.platform(),
        "processor": model_name or platform.processor(),
        "cpu_count": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "python": platform.python_version(),
        "onnxruntime": onnxruntime.__version__,
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "loopcast": __version__,
        "git": commit,
        "load_average_start": os.getloadavg(),
    }


# -- output ------------------------------------------------------------------------------------


def _fmt(value, spec: str) -> str:
    return "–" if value is None else format(value, spec)


def markdown(baseline: dict, rows: list[dict], settings: dict) -> str:
    lines = [
        f"Demo model, fp32, CPU; {settings['prompts']} prompts × {settings['max_new_tokens']} new tokens "
        f"per configuration, best of {settings['repeats']} pass(es).",
        "",
        "| path (code workload) | tokens/s | same tokens |",
        "|---|---:|:-:|",
        f"| torch reference, eager greedy | {baseline['torch_tokens_per_second']:.1f} | – |",
        f"| ORT plain greedy | {baseline['ort_tokens_per_second']:.1f} | {'yes' if baseline['same'] else 'no'} |",
        f"| **ORT / torch** | **{baseline['ort_over_torch']:.2f}×** | |",
        "",
        "| workload | configuration | tokens/s | × plain | acceptance | tokens/round | same |",
        "|---|---|---:|---:|---:|---:|:-:|",
    ]
    for row in rows:
        lines.append(
            f"| {row['workload']} | {row['label']} | {row['tokens_per_second']:.1f} | "
            f"{row['ratio_to_plain']:.2f} | {_fmt(row['acceptance'], '.2f')} | "
            f"{_fmt(row['tokens_per_round'], '.2f')} | {'yes' if row['same'] else '**no**'} |"
        )
    return "\n".join(lines)


def report_mismatches(baseline: dict, rows: list[dict]) -> int:
    """Print every token mismatch; return how many there were."""
    bad = [("code", "torch vs ORT plain", baseline["mismatch"])] if not baseline["same"] else []
    bad += [
        (r["workload"], r["label"], r["mismatch"] or "tokens differ between passes")
        for r in rows
        if not r["same"]
    ]
    for workload, label, detail in bad:
        print(f"BUG: {workload} / {label}: tokens differ from plain greedy: {detail}", file=sys.stderr)
    return len(bad)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="smoke run: 2 prompts, 32 new tokens, 1 pass; JSON to " + QUICK_OUT,
    )
    parser.add_argument("--out", help=f"JSON output (default {DEFAULT_OUT}; {QUICK_OUT} with --quick)")
    parser.add_argument("--prompts", type=int, help="prompts per workload (default 8, 2 with --quick)")
    parser.add_argument("--max-new-tokens", type=int, help="tokens per run (default 128, 32 with --quick)")
    parser.add_argument(
        "--torch-threads",
        type=int,
        default=1,
        help="torch intra-op threads for the reference (default 1: see the docstring)",
    )
    parser.add_argument(
        "--repeats", type=int, help="passes; each configuration keeps its fastest (default 2, 1 with --quick)"
    )
    args = parser.parse_args(argv)
    quick = args.quick
    args.out = Path(args.out or (QUICK_OUT if quick else DEFAULT_OUT))
    args.prompts = args.prompts or (2 if quick else 8)
    args.max_new_tokens = args.max_new_tokens or (32 if quick else 128)
    args.repeats = args.repeats or (1 if quick else 2)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    torch.set_num_threads(args.torch_threads)
    info = machine_info()
    workloads = make_workloads(args.prompts)
    with tempfile.TemporaryDirectory(prefix="loopcast-bench-") as tmp:
        paths = export_artifacts(Path(tmp))
        models = {name: load(path) for name, path in paths.items()}
        reference = load_checkpoint("demo", dtype=torch.float32)
        warm_up(models, reference, models["w5d1"].encode(workloads["edit"].prompts[0]), matrix())
        print(f"setup {time.perf_counter() - started:.1f}s; measuring", flush=True)
        best, seconds = measure(args, models, reference, workloads)
    baseline, rows = summarize(best, seconds, workloads)
    info["load_average_end"] = os.getloadavg()
    settings = {
        "prompts": args.prompts,
        "max_new_tokens": args.max_new_tokens,
        "repeats": args.repeats,
        "max_length": MAX_LENGTH,
        "dtype": "fp32",
        "stop_ids": [],
        "torch_threads": args.torch_threads,
        "ort_threads": "onnxruntime default",
        "timing": "sum(tokens)/sum(wall seconds of each generate call) over a workload's "
        "prompts; fastest of `repeats` interleaved passes",
        "artifacts": {name: {"verify_width": w, "draft_depth": d} for name, (w, d) in ARTIFACTS.items()},
        "quick": args.quick,
    }
    table = markdown(baseline, rows, settings)
    elapsed = time.perf_counter() - started
    out = {
        "machine": info,
        "settings": settings,
        "run_seconds": elapsed,
        "workloads": {name: {"prompts": wl.prompts, "sources": wl.sources} for name, wl in workloads.items()},
        "baseline": baseline,
        "rows": rows,
        "markdown": table,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    bugs = report_mismatches(baseline, rows)
    print(f"\nwrote {args.out} in {elapsed:.0f}s\n")
    print(table)
    return 1 if bugs else 0


if __name__ == "__main__":
    sys.exit(main())
