#!/usr/bin/env python3
"""Build the prebuilt custom-op library as a platform wheel, ``loopcast_ops``.

    python -m tools.release.build_ops_wheel                       # release: CPU + CUDA sm_90, sm_100
    python -m tools.release.build_ops_wheel --no-cuda             # CPU kernels only (what CI builds)
    pip install dist/loopcast_ops-*.whl                   # exports then use it, no compiler needed

The ONNX Runtime C headers come from a package registry (Debian's libonnxruntime-dev, through
``custom_ops/fetch_ort_headers.sh``) unless ``--ort-include`` names a directory. The wheel holds
``loopcast_ops/libloopcast_ops.so`` and ``build_info.json`` (the kernel-source digest it was built
from, the CUDA architectures, the header version), which ``custom_ops/library.py`` checks before
using it. sm_80 is not offered: the kernels need sm_90 (griddepcontrol, TMA).

The tag is ``py3-none-linux_<machine>``: the library needs only libc/libstdc++ and (CUDA
kernels) links cudart statically, but a manylinux tag for an index upload needs ``auditwheel``.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import platform
import re
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RELEASE_ARCHS = ("90", "100")
INIT = '"""Prebuilt loopcast custom-op library (data only): libloopcast_ops.so and build_info.json."""\n'


def fetch_headers() -> Path:
    out = (
        subprocess.run(
            [str(ROOT / "custom_ops" / "fetch_ort_headers.sh")],
            check=True,
            capture_output=True,
            text=True,
        )
        .stdout.strip()
        .splitlines()[-1]
    )
    return Path(out)


def header_version(include: Path) -> str:
    match = re.search(r"#define ORT_API_VERSION (\d+)", (include / "onnxruntime_c_api.h").read_text())
    return f"1.{match.group(1)}" if match else "unknown"


def check_loads(library: Path, cuda: bool) -> None:
    """The library must register in a CPU-only ONNX Runtime session on this GPU-less build
    machine (cudart is static and initialised lazily), and carry CUDA kernels iff asked to."""
    import onnxruntime as ort
    from loopcast.custom_ops import build

    ort.SessionOptions().register_custom_ops_library(str(library))
    if build.has_cuda(library) != cuda:
        raise SystemExit(f"error: {library} {'lacks' if cuda else 'has'} CUDA kernels")


def _record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def write_wheel(out_dir: Path, version: str, files: dict[str, bytes]) -> Path:
    """A wheel (PEP 427) with ``files`` under their archive names, plus its dist-info."""
    tag = f"py3-none-linux_{platform.machine()}"
    dist_info = f"loopcast_ops-{version}.dist-info"
    files = dict(files)
    files[f"{dist_info}/METADATA"] = (
        f"Metadata-Version: 2.1\nName: loopcast-ops\nVersion: {version}\n"
        "Summary: Prebuilt loopcast custom-op library (ONNX Runtime custom ops, CPU and CUDA kernels)\n"
        "License: Apache-2.0\n"
    ).encode()
    files[f"{dist_info}/WHEEL"] = (
        f"Wheel-Version: 1.0\nGenerator: loopcast build_ops_wheel\nRoot-Is-Purelib: false\nTag: {tag}\n"
    ).encode()
    record = [f"{name},{_record_hash(data)},{len(data)}" for name, data in files.items()]
    files[f"{dist_info}/RECORD"] = ("\n".join(record + [f"{dist_info}/RECORD,,"]) + "\n").encode()
    out_dir.mkdir(parents=True, exist_ok=True)
    wheel = out_dir / f"loopcast_ops-{version}-{tag}.whl"
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED) as archive:
        for name, data in files.items():
            info = zipfile.ZipInfo(name, date_time=(2020, 1, 1, 0, 0, 0))
            info.external_attr = (0o755 if name.endswith(".so") else 0o644) << 16
            info.compress_type = zipfile.ZIP_DEFLATED
            archive.writestr(info, data)
    return wheel


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "dist", help="wheel directory (default: dist/)")
    parser.add_argument("--cuda-archs", default=",".join(RELEASE_ARCHS), help="SM versions (default: 90,100)")
    parser.add_argument("--no-cuda", action="store_true", help="CPU kernels only")
    parser.add_argument(
        "--ort-include", type=Path, default=None, help="ONNX Runtime headers (default: fetched)"
    )
    parser.add_argument("--jobs", type=int, default=None, help="parallel compiles (default: CPUs)")
    args = parser.parse_args(argv)

    from loopcast.custom_ops import build

    from loopcast import __version__
    from loopcast.errors import LoopcastError

    include = args.ort_include or fetch_headers()
    archs = () if args.no_cuda else build.cuda_archs(tuple(a for a in args.cuda_archs.split(",") if a))
    what = "CPU kernels" + (f" + CUDA sm_{', sm_'.join(archs)}" if archs else "")
    print(f"building {build.LIBRARY_NAME} ({what}) against ONNX Runtime headers {include} ...", flush=True)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        try:
            library = build.build_library(tmp, include, cuda=bool(archs), archs=archs or None, jobs=args.jobs)
        except LoopcastError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        check_loads(library, bool(archs))
        data = library.read_bytes()
    seconds = time.perf_counter() - start
    info = {
        "source_digest": build.source_digest(),
        "cuda_archs": list(archs),
        "loopcast_version": __version__,
        "ort_headers": header_version(include),
        "library_sha256": hashlib.sha256(data).hexdigest(),
        "build_seconds": round(seconds, 1),
        "platform": platform.platform(),
    }
    wheel = write_wheel(
        args.out,
        __version__,
        {
            "loopcast_ops/__init__.py": INIT.encode(),
            f"loopcast_ops/{build.LIBRARY_NAME}": data,
            "loopcast_ops/build_info.json": (json.dumps(info, indent=1) + "\n").encode(),
        },
    )
    print(
        f"built {wheel} in {seconds:.0f} s ({wheel.stat().st_size / 2**20:.1f} MiB; library "
        f"{len(data) / 2**20:.1f} MiB)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
