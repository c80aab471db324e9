"""Export time against a plain copy of the checkpoint's weights, measured side by side.

    python tools/bench_export.py CHECKPOINT [--repeats 5] [--work /tmp/bench-export] [-- EXPORT OPTIONS...]
    python tools/bench_export.py --preset smollm-135m            (writes a random checkpoint first)

Each repeat runs, in alternating order so that drift in a shared machine hits both alike:
``cp`` of every ``*.safetensors`` file of the checkpoint into a fresh directory, and
``loopcast export CHECKPOINT -o OUT --overwrite`` in a child process (interpreter start and
imports included: what a user waits for). Both write into the page cache (neither syncs).
Prints every run, the medians, the ranges and the ratio of medians; ``--json`` writes them.
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


def timed(cmd: list[str]) -> float:
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint", nargs="?", type=Path)
    p.add_argument("--preset", help="write a random checkpoint of this preset (loopcast random-checkpoint)")
    p.add_argument("--dtype", default="fp32", help="dtype of the random checkpoint (with --preset)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--work", type=Path, default=Path("/tmp/bench-export"))
    p.add_argument("--json", type=Path, help="write the runs and medians here")
    p.add_argument("export_args", nargs="*", help="extra `loopcast export` options (after --)")
    args = p.parse_args()
    cli = [sys.executable, "-m", "loopcast.cli"]
    args.work.mkdir(parents=True, exist_ok=True)
    checkpoint = args.checkpoint
    if checkpoint is None:
        if not args.preset:
            p.error("give a CHECKPOINT directory or --preset")
        checkpoint = args.work / f"checkpoint-{args.preset}-{args.dtype}"
        if not (checkpoint / "config.json").is_file():
            subprocess.run(cli + ["random-checkpoint", str(checkpoint), "--preset", args.preset,
                                  "--dtype", args.dtype], check=True)
    files = sorted(checkpoint.glob("*.safetensors"))
    size = sum(f.stat().st_size for f in files)
    copy_dir, out = args.work / "copy", args.work / "artifact"
    export = cli + ["export", str(checkpoint), "-o", str(out), "--overwrite", *args.export_args]
    # One untimed export first: builds the op library if this source version has none yet,
    # and brings the checkpoint into the page cache for both contenders.
    subprocess.run(export, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    runs: dict[str, list[float]] = {"copy": [], "export": []}
    for i in range(args.repeats):
        order = ("copy", "export") if i % 2 == 0 else ("export", "copy")
        for what in order:
            if what == "copy":
                shutil.rmtree(copy_dir, ignore_errors=True)
                copy_dir.mkdir()
                runs["copy"].append(timed(["cp", *map(str, files), str(copy_dir)]))
            else:
                runs["export"].append(timed(export))
        print(f"run {i + 1}: cp {runs['copy'][-1]:.2f} s, export {runs['export'][-1]:.2f} s", flush=True)
    shutil.rmtree(copy_dir, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in runs.items()}
    result = {
        "checkpoint": str(checkpoint), "weights_bytes": size, "export_args": args.export_args,
        "machine": f"{platform.node()} {platform.machine()}, {__import__('os').cpu_count()} CPUs",
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "runs": runs, "median": med,
        "ratio": med["export"] / med["copy"],
    }
    print(f"{size / 2**20:.0f} MiB of weights, {args.repeats} interleaved repeats")
    for k, v in runs.items():
        print(f"  {k:<6} median {med[k]:.2f} s  range {min(v):.2f}-{max(v):.2f} s")
    print(f"  export / copy = {result['ratio']:.1f}x (medians)")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
