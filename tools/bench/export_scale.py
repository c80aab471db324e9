"""Export an Ouro-1.4B-shaped random fp16 checkpoint and record time, peak RSS and sizes.

    python -m tools.bench.export_scale --work /tmp/scale --out docs/export-scale.json

The checkpoint is written first (sharded, streamed), then `loopcast export` runs in a child
process so that its peak RSS (ru_maxrss of the child) is the export's alone.
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path


def dir_size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work", type=Path, default=Path("/tmp/loopcast-scale"))
    p.add_argument("--out", type=Path, default=Path("docs/export-scale.json"))
    p.add_argument("--preset", default="ouro-1.4b")
    p.add_argument("--max-length", type=int, default=1024)
    args = p.parse_args()
    ckpt, art = args.work / "checkpoint", args.work / "artifact"
    shutil.rmtree(args.work, ignore_errors=True)
    args.work.mkdir(parents=True)
    cli = [sys.executable, "-m", "loopcast.cli"]
    t0 = time.perf_counter()
    subprocess.run(
        cli
        + [
            "random-checkpoint",
            str(ckpt),
            "--preset",
            args.preset,
            "--dtype",
            "fp16",
            "--max-shard-mb",
            "2000",
        ],
        check=True,
    )
    t_ckpt = time.perf_counter() - t0
    t0 = time.perf_counter()
    # The child reports its own peak (RUSAGE_SELF) so the checkpoint writer's peak is not mixed in.
    probe = (
        "import resource, sys\nfrom loopcast.cli import main\ntry:\n    main(sys.argv[1:])\n"
        "except SystemExit as e:\n    code = e.code\nelse:\n    code = 0\n"
        "print('PEAK_KIB', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)\nsys.exit(code)\n"
    )
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            probe,
            "export",
            str(ckpt),
            "-o",
            str(art),
            "--dtype",
            "fp16",
            "--max-length",
            str(args.max_length),
        ],
        check=True,
        capture_output=True,
        text=True,
    )
    t_export = time.perf_counter() - t0
    peak_kib = int(proc.stdout.split("PEAK_KIB")[1].split()[0])
    weights = sum(f.stat().st_size for f in ckpt.glob("*.safetensors"))
    result = {
        "preset": args.preset,
        "dtype": "fp16",
        "max_length": args.max_length,
        "checkpoint_bytes": weights,
        "checkpoint_write_s": round(t_ckpt, 1),
        "export_s": round(t_export, 1),
        "export_peak_rss_bytes": peak_kib * 1024,
        "peak_rss_over_weights": round(peak_kib * 1024 / weights, 3),
        "artifact_bytes": dir_size(art),
        "artifact_over_weights": round(dir_size(art) / weights, 4),
        "note": "peak RSS (ru_maxrss) of the export process alone; mmap'd checkpoint pages count",
        "machine": {"platform": platform.platform(), "python": platform.python_version()},
        "date": time.strftime("%Y-%m-%d"),
    }
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))
    shutil.rmtree(args.work, ignore_errors=True)


if __name__ == "__main__":
    main()
