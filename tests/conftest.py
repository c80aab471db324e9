"""Shared fixtures: a handful of tiny model shapes and cached random-weight checkpoints.

Keep this file small: fixtures that only one part of the suite needs live in that part's own
conftest (tests/ort_runtime/conftest.py, ...).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from loopcast.exporter.random_checkpoint import write_random_checkpoint

from loopcast.config import PRESETS, ModelConfig

# head_dim stays 16 (the ONNX exporter needs a multiple of 16), hidden 64, vocab ~100.
TINY_CONFIGS: dict[str, ModelConfig] = {
    "ouro-r3": PRESETS["tiny-ouro"],
    "ouro-r2-gqa": PRESETS["tiny-ouro"].replace(
        num_loops=2, num_kv_heads=2, vocab_size=100, max_position_embeddings=64
    ),
    "ouro-r4-1layer": PRESETS["tiny-ouro"].replace(
        num_loops=4, num_layers=1, num_kv_heads=1, vocab_size=89, max_position_embeddings=96
    ),
    "llama-tied": PRESETS["tiny-llama"],
    "llama-untied-gqa": PRESETS["tiny-llama"].replace(
        tie_word_embeddings=False, num_kv_heads=1, vocab_size=96, max_position_embeddings=64
    ),
}

# Init std of the test checkpoints. 0.02 (the training init) gives near-uniform logits whose
# top-1/top-2 gap falls to ~5e-4; 0.1 keeps logits finite and |logit| < 4, and over 20-token
# generations the smallest gap stays >= 7e-4 while fp32 cached-vs-recompute noise stays <= 4e-6
# (at 0.2 the noise reaches 3e-5: sandwich norms amplify fp32 rounding of large activations).
TEST_CHECKPOINT_STD = 0.1


@pytest.fixture(scope="session")
def tiny_configs() -> list[ModelConfig]:
    """All tiny shapes: Ouro R=3 / R=2 GQA / R=4 one layer, Llama tied / untied GQA."""
    return list(TINY_CONFIGS.values())


@pytest.fixture(scope="session", params=list(TINY_CONFIGS))
def tiny_config(request) -> ModelConfig:
    """Parametrizes a test over every tiny shape (id = its name). A test can narrow the set:
    ``@pytest.mark.parametrize("tiny_config", ["ouro-r3", "llama-tied"], indirect=True)``."""
    return TINY_CONFIGS[request.param]


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
