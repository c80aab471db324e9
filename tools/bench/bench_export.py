"""Export time against a plain copy of the checkpoint's weights, measured side by side.

    python -m tools.bench.bench_export CHECKPOINT [--repeats 5] [--work /tmp/bench-export] \
        [-- EXPORT OPTIONS...]
    python -m tools.bench.bench_export --preset smollm-135m            (writes a random checkpoint first)
    python -m tools.bench.bench_export --preset smollm-135m --genai-python /work/venv/bin/python
        (+ ORT-GenAI's builder)

Each repeat runs, in alternating order so that drift in a shared machine hits both alike:
``cp`` of every ``*.safetensors`` file of the checkpoint into a fresh directory, and
``loopcast export CHECKPOINT -o OUT --overwrite`` in a child process (interpreter start and
imports included: what a user waits for). Both write into the page cache (neither syncs).
With ``--genai-python PY`` ORT-GenAI's model builder (``PY -m onnxruntime_genai.models.builder``,
a Python that has onnxruntime-genai) runs in the same rounds on the same checkpoint; it needs a
tokenizer, so the demo model's tokenizer files are copied into a random checkpoint.
Prints every run, the medians, the ranges and the ratios of medians; ``--json`` writes them.
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path


def timed(cmd: list[str], cwd: Path | None = None) -> float:
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=cwd)
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint", nargs="?", type=Path)
    p.add_argument("--preset", help="write a random checkpoint of this preset (loopcast random-checkpoint)")
    p.add_argument("--dtype", default="fp32", help="dtype of the random checkpoint (with --preset)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--work", type=Path, default=Path("/tmp/bench-export"))
    p.add_argument("--json", type=Path, help="write the runs and medians here")
    p.add_argument("--genai-python", help="a Python with onnxruntime-genai: also time its model builder")
    p.add_argument(
        "--baseline-python",
        help="a Python whose loopcast is another version (e.g. main's): also time its export, as `baseline`",
    )
    p.add_argument("--genai-ep", default="cpu", help="the builder's execution provider (-e)")
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)
    args = p.parse_args(argv[:cut])
    args.export_args = argv[cut + 1 :]  # extra `loopcast export` options, after --
    cli = [sys.executable, "-m", "loopcast.cli"]
    args.work.mkdir(parents=True, exist_ok=True)
    checkpoint = args.checkpoint
    if checkpoint is None:
        if not args.preset:
            p.error("give a CHECKPOINT directory or --preset")
        checkpoint = args.work / f"checkpoint-{args.preset}-{args.dtype}"
        if not (checkpoint / "config.json").is_file():
            subprocess.run(
                cli + ["random-checkpoint", str(checkpoint), "--preset", args.preset, "--dtype", args.dtype],
                check=True,
            )
    if args.genai_python and not (checkpoint / "tokenizer.json").is_file():
        from loopcast.demo_checkpoint import demo_checkpoint_dir

        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(demo_checkpoint_dir() / name, checkpoint / name)
    files = sorted(checkpoint.glob("*.safetensors"))
    size = sum(f.stat().st_size for f in files)
    copy_dir, out = args.work / "copy", args.work / "artifact"
    export = cli + ["export", str(checkpoint), "-o", str(out), "--overwrite", *args.export_args]
    # One untimed export first: builds the op library if this source version has none yet,
    # and brings the checkpoint into the page cache for both contenders.
    subprocess.run(export, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    precision = {"fp32": "fp32", "fp16": "fp16", "bf16": "bf16"}[
        args.export_args[args.export_args.index("--dtype") + 1] if "--dtype" in args.export_args else "fp32"
    ]
    genai = [
        args.genai_python,
        "-m",
        "onnxruntime_genai.models.builder",
        "-i",
        str(checkpoint),
        "-o",
        str(args.work / "genai"),
        "-p",
        precision,
        "-e",
        args.genai_ep,
        "-c",
        str(args.work / "genai-cache"),
    ]
    baseline = [
        args.baseline_python,
        "-m",
        "loopcast.cli",
        "export",
        str(checkpoint),
        "-o",
        str(args.work / "baseline"),
        "--overwrite",
        *args.export_args,
    ]
    runs: dict[str, list[float]] = {"copy": [], "export": []}
    if args.baseline_python:
        runs["baseline"] = []
        # Run outside this checkout, or `python -m loopcast.cli` would import this tree's loopcast.
        subprocess.run(
            baseline, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=args.work
        )
    if args.genai_python:
        runs["genai"] = []
    for i in range(args.repeats):
        order = list(runs) if i % 2 == 0 else list(runs)[::-1]
        for what in order:
            if what == "copy":
                shutil.rmtree(copy_dir, ignore_errors=True)
                copy_dir.mkdir()
                runs["copy"].append(timed(["cp", *map(str, files), str(copy_dir)]))
            elif what == "export":
                runs["export"].append(timed(export))
            elif what == "baseline":
                runs["baseline"].append(timed(baseline, cwd=args.work))
            else:
                shutil.rmtree(args.work / "genai", ignore_errors=True)
                runs["genai"].append(timed(genai, cwd=args.work))
        print(f"run {i + 1}: " + ", ".join(f"{k} {v[-1]:.2f} s" for k, v in runs.items()), flush=True)
    shutil.rmtree(copy_dir, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in runs.items()}
    result = {
        "checkpoint": str(checkpoint),
        "weights_bytes": size,
        "export_args": args.export_args,
        "machine": f"{platform.node()} {platform.machine()}, {__import__('os').cpu_count()} CPUs",
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "runs": runs,
        "median": med,
        "ratio": med["export"] / med["copy"],
    }
    if "genai" in med:
        result["genai_ratio"] = med["genai"] / med["export"]
    print(f"{size / 2**20:.0f} MiB of weights, {args.repeats} interleaved repeats")
    for k, v in runs.items():
        print(f"  {k:<6} median {med[k]:.2f} s  range {min(v):.2f}-{max(v):.2f} s")
    print(f"  export / copy = {result['ratio']:.1f}x (medians)")
    if "genai" in med:
        print(f"  ORT-GenAI builder / export = {result['genai_ratio']:.1f}x (medians)")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
