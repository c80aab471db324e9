"""Shared fixtures: the suite's isolation from the user's files, the tiny model shapes
(tests/tiny_models.py) and cached random-weight checkpoints.

Keep this file small: fixtures that only one part of the suite needs live in that part's own
conftest (tests/custom_ops/conftest.py, ...).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from loopcast.exporter.random_checkpoint import write_random_checkpoint

from loopcast.config import ModelConfig
from tests.artifacts import SCRATCH_ENV
from tests.tiny_models import FIXTURE_MODELS, TEST_CHECKPOINT_STD, TINY_MODELS


@dataclass(frozen=True)
class Isolation:
    """Where this session's user files go, and the user's own that it must not touch."""

    root: Path  # pytest's session temp dir (basetemp): removed after a passing run
    home: Path
    cache: Path  # $LOOPCAST_CACHE: op-library builds, the trusted-ops registry, the demo artifact
    real_home: Path
    real_cache: Path


@pytest.fixture(scope="session", autouse=True)
def isolation(tmp_path_factory) -> Isolation:
    """HOME (and the XDG dirs, ~/.ray/auth_token, ~/.cache/huggingface, ...), the loopcast
    cache with its trusted-ops registry, the temp dir and Ray's temp dir point into pytest's
    session temp dir for the whole run, subprocesses included. The loopcast cache is one per
    session, so the custom-op library is built once per run and shared by every export."""
    real_home = Path.home()
    real_cache = Path(os.environ.get("LOOPCAST_CACHE", real_home / ".cache" / "loopcast"))
    root = tmp_path_factory.getbasetemp()
    home = tmp_path_factory.mktemp("home", numbered=False)
    cache = home / ".cache" / "loopcast"
    tmp = tmp_path_factory.mktemp("tmp", numbered=False)
    # Ray's unix sockets live under its temp dir and their paths may not exceed 107 bytes: a
    # short directory of its own, removed at the end of the session.
    ray_tmp = Path(tempfile.mkdtemp(prefix="lc-ray-"))
    env = {
        "HOME": home,
        "XDG_CACHE_HOME": home / ".cache",
        "XDG_CONFIG_HOME": home / ".config",
        "XDG_DATA_HOME": home / ".local" / "share",
        "LOOPCAST_CACHE": cache,
        "TMPDIR": tmp,
        "RAY_TMPDIR": ray_tmp,
        SCRATCH_ENV: tmp_path_factory.mktemp("artifacts", numbered=False),
    }
    with pytest.MonkeyPatch.context() as mp:
        for name, value in env.items():
            mp.setenv(name, str(value))
        mp.delenv("HF_HOME", raising=False)
        mp.delenv("HF_HUB_CACHE", raising=False)
        mp.setattr(tempfile, "tempdir", None)  # gettempdir() reads TMPDIR again
        try:
            yield Isolation(root, home, cache, real_home, real_cache)
        finally:
            shutil.rmtree(ray_tmp, ignore_errors=True)


@pytest.fixture(scope="session")
def tiny_configs() -> list[ModelConfig]:
    """The fixture shapes: Ouro R=3 / R=2 GQA / R=4 one layer, Llama tied / untied GQA."""
    return [TINY_MODELS[name] for name in FIXTURE_MODELS]


@pytest.fixture(scope="session", params=list(FIXTURE_MODELS))
def tiny_config(request) -> ModelConfig:
    """Parametrizes a test over every fixture shape (id = its name in tests/tiny_models.py). A
    test can narrow the set (to any registry name):
    ``@pytest.mark.parametrize("tiny_config", ["ouro-r3", "llama-tied-gqa"], indirect=True)``."""
    return TINY_MODELS[request.param]


@pytest.fixture(scope="session")
def make_checkpoint(tmp_path_factory):
    """``make_checkpoint(config, seed=0, dtype=torch.float32) -> Path``: a random-weight
    checkpoint directory, written once per (config, seed, dtype, std) and shared by the session.
    Treat it as read-only: copy it (shutil.copytree) before breaking it on purpose."""
    made: dict[tuple, Path] = {}

    def make(
        config: ModelConfig,
        seed: int = 0,
        dtype: torch.dtype = torch.float32,
        *,
        std: float = TEST_CHECKPOINT_STD,
    ) -> Path:
        key = (config, seed, dtype, std)
        if key not in made:
            parent = tmp_path_factory.mktemp(f"ckpt-{config.model_type}-r{config.num_loops}")
            made[key] = write_random_checkpoint(
                config, parent / "checkpoint", seed=seed, dtype=dtype, std=std
            )
        return made[key]

    return make


def pytest_configure(config) -> None:
    # The torch reference and ONNX Runtime share 2 cores in one process: torch's own thread
    # pool only adds contention for these tiny matrices (measured: 234 s vs 7 s for
    # test_reference.py on a loaded machine).
    torch.set_num_threads(1)
