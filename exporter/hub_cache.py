"""Checkpoint ids (``org/name``) resolved offline from the local Hugging Face hub cache.

The cache layout the ``huggingface_hub`` library writes::

    $HF_HUB_CACHE (else $HF_HOME/hub, else ~/.cache/huggingface/hub)
      models--org--name/
        refs/main            → a commit hash
        snapshots/<hash>/    config.json, *.safetensors (usually symlinks into blobs/), tokenizer …

Nothing is downloaded: a model that is not in the cache is an error that says where we looked.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from loopcast.errors import CheckpointError

_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")
_REVISION = re.compile(r"^[A-Za-z0-9._-]+$")


def looks_like_hub_id(text: str) -> bool:
    """``org/name`` with the characters the hub allows (a relative path of two parts also matches;
    callers try the path first)."""
    return bool(_ID.match(text)) and ".." not in text


def hub_cache_dir() -> Path:
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"])
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]) / "hub"
    return Path.home() / ".cache" / "huggingface" / "hub"


def resolve_hub_id(model_id: str, revision: str = "main") -> Path:
    """The snapshot directory of ``model_id`` at ``revision`` (a ref name or a commit hash)."""
    cache = hub_cache_dir()
    repo = cache / ("models--" + model_id.replace("/", "--"))
    if not repo.is_dir():
        raise CheckpointError(
            f"{model_id}: not a checkpoint directory, and not in the Hugging Face cache "
            f"({repo} not found; loopcast does not download, fetch it with "
            f"`huggingface-cli download {model_id}` or set HF_HUB_CACHE/HF_HOME)"
        )
    ref = repo / "refs" / revision
    commit = ref.read_text().strip() if ref.is_file() else revision
    if not _REVISION.match(commit):
        raise CheckpointError(f"{ref}: malformed ref {commit!r}")
    snapshot = repo / "snapshots" / commit
    if not snapshot.is_dir():
        raise CheckpointError(
            f"{model_id}: revision {revision!r} is not in the Hugging Face cache ({snapshot} not found)"
        )
    if not (snapshot / "config.json").exists():
        raise CheckpointError(f"{snapshot}: cached snapshot of {model_id} has no config.json")
    return snapshot
