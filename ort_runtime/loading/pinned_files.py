"""A loaded model's files stay the ones it loaded (docs/trust.md, "A loaded model pins its files").

Sessions made after load — the deferred speculative kinds (ort_runtime/loading/session_table.py)
— open their graph, and through it the weights, from the artifact directory again. If the
directory was replaced meanwhile (``export --overwrite`` of another model into it), opening them
from the new files would splice two models: a draft of one and a verifier of the other, whose
tokens come out silently wrong. So before a deferred session is made, the files it will read
are checked against the manifest the model was loaded with: the graph's full SHA-256 (graphs
keep their weights outside, so they are small), the weights' size and sampled SHA-256 (1 MiB
read; a different model's weights differ there), and the op library's SHA-256 when one is
registered. A mismatch is an ArtifactError that says to load the artifact again.
"""

from __future__ import annotations

from pathlib import Path

from loopcast.confined_files import confined_file
from loopcast.errors import ArtifactError
from loopcast.manifest import Manifest, file_digest, sampled_sha256


def check_unchanged(path: Path, manifest: Manifest, kind: str, library: Path | None) -> None:
    """Raise ArtifactError when a file ``kind``'s session would read no longer matches the
    manifest this model was loaded with."""
    spec = manifest.graphs[kind]  # by name: the kind, or kind@k at a static depth
    checks = [(spec.file, f"graph file for '{kind}'", True), (manifest.weights_file, "weights file", False)]
    if library is not None and manifest.custom_op_library:
        checks.append((manifest.custom_op_library, "custom-op library", True))
    for name, what, full in checks:
        record = manifest.files.get(name)
        if record is None:
            continue  # Manifest.read required every file it reads later to be recorded
        try:
            target = confined_file(path, name, what)
            assert target is not None
            same = target.stat().st_size == record.size and (
                file_digest(target, record.hash) == record.sha256
                if full
                else record.sampled_sha256 is None or sampled_sha256(target) == record.sampled_sha256
            )
        except ArtifactError as exc:
            raise ArtifactError(f"{_changed(path, kind)} ({exc})") from None
        if not same:
            raise ArtifactError(f"{_changed(path, kind)} (the {what} {name} is not the one loaded)")


def _changed(path: Path, kind: str) -> str:
    return (
        f"{path}: the artifact changed on disk since this model was loaded (re-exported or replaced), "
        f"so the '{kind}' session it opens on first use would not be this model's; load it again"
    )
