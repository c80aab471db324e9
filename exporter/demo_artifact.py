"""The demo checkpoint exported into the user's cache on first use (fp32, CPU)."""

from __future__ import annotations

import os
from pathlib import Path

from loopcast.demo_checkpoint import demo_checkpoint_dir


def demo_artifact_dir(cache_dir: Path | None = None, *, progress: bool = False) -> Path:
    """The demo model exported (fp32, CPU) into the cache, exporting on first use."""
    import hashlib

    from loopcast import __version__
    from loopcast.manifest import SCHEMA_VERSION

    checkpoint = demo_checkpoint_dir()
    digest = hashlib.sha256((checkpoint / "model.safetensors").read_bytes()).hexdigest()[:12]
    root = cache_dir or Path(os.environ.get("LOOPCAST_CACHE", Path.home() / ".cache" / "loopcast"))
    artifact = Path(root) / f"demo-{__version__}-s{SCHEMA_VERSION}-{digest}"
    if not _usable(artifact):
        from loopcast.exporter.export import ExportOptions, export_checkpoint

        _discard(artifact)  # a damaged entry of our own cache: export refuses to replace a
        # directory that is not a readable artifact, so it is removed here, by its owner

        export_checkpoint(
            checkpoint,
            artifact,
            ExportOptions(dtype="fp32", max_length=1024, verify_width=5, draft_depth=1),
            progress=progress,
            overwrite=True,
        )
    return artifact


def _discard(artifact: Path) -> None:
    """Remove a cache entry that is not a usable demo artifact (the name is the cache's own)."""
    import shutil

    if artifact.is_dir() and not artifact.is_symlink():
        shutil.rmtree(artifact)
    elif os.path.lexists(artifact):
        artifact.unlink()


def _usable(artifact: Path) -> bool:
    """A cached demo artifact that reads cleanly and is what an export would write now (a damaged
    entry, one of another schema, or stock graphs cached while the op library could not be had
    that can be had now, is exported again rather than refused or reused on every run)."""
    from loopcast.errors import ArtifactError
    from loopcast.manifest import Manifest
    from loopcast.vocab import OpSet

    if not (artifact / "manifest.json").is_file():
        return False
    try:
        manifest = Manifest.read(artifact)
    except ArtifactError:
        return False
    return manifest.op_set != OpSet.STOCK or not library_available()


def library_available() -> bool:
    """Whether the loopcast op library can be had without building blind: a matching prebuilt
    one, a cached build, or the ONNX Runtime headers and a C++ compiler to build it."""
    import shutil

    from loopcast.custom_ops import build, library

    if library.usable_prebuilt()[0] is not None or library.cached_build() is not None:
        return True
    return build.find_ort_include() is not None and shutil.which("c++") is not None
