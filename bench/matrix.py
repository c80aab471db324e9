"""The demo model's CPU speculation matrix: the torch reference against ORT plain greedy, and
every speculative configuration (mode × K × gate × artifact) against plain greedy, on workloads
of prompts the caller gives (``python -m tools.bench.bench_cpu`` builds them from the held-out
demo corpus; docs/perf.md).

How it measures: the three artifacts (W5/d1, demo_artifact_dir()'s options, W7/d1 and W5/d2)
are exported fresh into ``work_dir``; every run generates exactly ``max_new_tokens`` tokens
(``stop_ids=()``); each path and artifact is warmed up once before anything is timed; a
configuration's speed is sum(tokens) / sum(wall seconds) over its workload's prompts; the whole
set is measured ``repeats`` times, the configurations taking turns prompt by prompt, and each
keeps its fastest pass (the one least disturbed by other load on a shared machine). The cost
gate reads the generator's step timers, which accumulate over the runs made on one loaded
model, so the order of configurations is fixed.

``loopcast bench`` (bench/harness.py) measures steps and end-to-end rates of any checkpoint on
one artifact per variant; this module is the wider matrix on the demo model, with the same
exactness rule: speculation is exact greedy, so any token that differs from plain's is a bug.
"""

from __future__ import annotations

import datetime
import os
import platform
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from loopcast import __version__

MAX_LENGTH = 1024

# Artifacts: name → (verify width, draft depth). "w5d1" has demo_artifact_dir()'s options.
ARTIFACTS = {"w5d1": (5, 1), "w7d1": (7, 1), "w5d2": (5, 2)}


# -- configurations ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Config:
    mode: str  # "none", "prompt-lookup", "self"
    k: int | None = None  # drafts per round
    gate: str = "always"
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
    rows += [Config("prompt-lookup", k, gate) for k in (2, 4) for gate in ("always", "hit-density")]
    rows += [Config("self", k, gate, "w5d1") for k in (2, 4) for gate in ("always", "cost")]
    rows += [Config("self", 6, gate, "w7d1") for gate in ("always", "cost")]
    rows += [Config("self", k, gate, "w5d2") for k in (2, 4) for gate in ("always", "cost")]
    return rows


@dataclass(frozen=True)
class Workload:
    name: str
    prompts: list[str]
    sources: list[str]  # relpath:char offset of each prompt


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
    from loopcast.exporter.reference_generate import greedy_generate

    start = time.perf_counter()
    out = greedy_generate(reference, ids, max_new_tokens, max_length=MAX_LENGTH, stop_ids=())
    into.seconds += time.perf_counter() - start
    into.tokens.append(out.tokens)


def warm_up(models: dict, reference, prompt_ids: list[int], configs: list[Config]) -> None:
    """One short run of every (artifact, mode) pair used, and of the torch path."""
    from loopcast.exporter.reference_generate import greedy_generate

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
    from loopcast.exporter.export import ExportOptions, export_checkpoint

    paths = {}
    for name, (width, depth) in ARTIFACTS.items():
        paths[name] = root / name
        export_checkpoint(
            "demo",
            paths[name],
            ExportOptions(dtype="fp32", max_length=MAX_LENGTH, verify_width=width, draft_depth=depth),
        )
    return paths


@dataclass(frozen=True)
class MatrixOptions:
    prompts: int = 8  # per workload
    max_new_tokens: int = 128
    repeats: int = 2  # passes; each configuration keeps its fastest
    torch_threads: int = 1  # the reference's intra-op threads (ORT keeps its default pool)


def measure(
    opts: MatrixOptions, models: dict, reference, workloads: dict[str, Workload], log=print
) -> tuple[dict, dict]:
    """Interleaved passes → (fastest Pass per (workload, job), every pass's seconds).

    Within a pass, the jobs take turns prompt by prompt (prompt 1 for every job, then prompt 2,
    ...), so a burst of load from elsewhere on the machine hits many jobs a little rather than
    one job a lot."""
    encode = models["w5d1"].encode
    ids = {w: [encode(p) for p in wl.prompts] for w, wl in workloads.items()}
    jobs = [("code", TORCH)] + [(w, c) for w in workloads for c in matrix()]
    best: dict = {}
    seconds: dict = {}
    for rep in range(opts.repeats):
        passes = {job: Pass([], 0.0) for job in jobs}
        for i in range(opts.prompts):
            for workload, job in jobs:
                if job == TORCH:
                    run_torch(reference, ids[workload][i], opts.max_new_tokens, passes[(workload, job)])
                else:
                    run_ort(
                        models[job.artifact],
                        job,
                        ids[workload][i],
                        opts.max_new_tokens,
                        passes[(workload, job)],
                    )
            log(f"pass {rep + 1}/{opts.repeats}: prompt {i + 1}/{opts.prompts} done")
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
            rate = f"{result.tokens_per_second:7.1f} tok/s"
            log(f"pass {rep + 1}/{opts.repeats}  {workload:4s}  {label:38s} {rate}")
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


def machine_info(repo: Path | None = None) -> dict:
    """The machine, the versions and (``repo``) the git commit measured."""
    import onnxruntime
    import torch

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
            ["git", "-C", str(repo or Path.cwd()), "describe", "--always", "--dirty"],
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
        f"| ORT plain greedy | {baseline['ort_tokens_per_second']:.1f} | "
        f"{'yes' if baseline['same'] else 'no'} |",
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


def run_matrix(
    opts: MatrixOptions,
    workloads: dict[str, Workload],
    work_dir: Path,
    *,
    repo: Path | None = None,
    log=print,
) -> dict:
    """Export the artifacts into ``work_dir``, measure every configuration on ``workloads`` (the
    ``code`` one also for the torch baseline) and return the report: machine, settings, the
    workloads, the baseline, one row per (workload, configuration) and the markdown tables."""
    import torch
    from loopcast.exporter.checkpoint import load_checkpoint
    from loopcast.ort_runtime import load

    started = time.perf_counter()
    torch.set_num_threads(opts.torch_threads)
    info = machine_info(repo)
    paths = export_artifacts(work_dir)
    models = {name: load(path) for name, path in paths.items()}
    reference = load_checkpoint("demo", dtype=torch.float32)
    warm_up(models, reference, models["w5d1"].encode(workloads["edit"].prompts[0]), matrix())
    log(f"setup {time.perf_counter() - started:.1f}s; measuring")
    best, seconds = measure(opts, models, reference, workloads, log)
    baseline, rows = summarize(best, seconds, workloads)
    info["load_average_end"] = os.getloadavg()
    settings = {
        "prompts": opts.prompts,
        "max_new_tokens": opts.max_new_tokens,
        "repeats": opts.repeats,
        "max_length": MAX_LENGTH,
        "dtype": "fp32",
        "stop_ids": [],
        "torch_threads": opts.torch_threads,
        "ort_threads": "onnxruntime default",
        "timing": "sum(tokens)/sum(wall seconds of each generate call) over a workload's "
        "prompts; fastest of `repeats` interleaved passes",
        "artifacts": {name: {"verify_width": w, "draft_depth": d} for name, (w, d) in ARTIFACTS.items()},
    }
    return {
        "machine": info,
        "settings": settings,
        "run_seconds": time.perf_counter() - started,
        "workloads": {name: {"prompts": wl.prompts, "sources": wl.sources} for name, wl in workloads.items()},
        "baseline": baseline,
        "rows": rows,
        "markdown": markdown(baseline, rows, settings),
    }
