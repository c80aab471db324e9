"""A recurrent-depth (Huginn) artifact on CUDA, fp16 and bf16 (needs onnxruntime-gpu and a GPU;
skipped elsewhere, as in CI): teacher-forced on the fp32 CPU run's tokens, every row tracks the
fp32 torch reference within the dtype's tolerance at r = 1, 4 and 32."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest

from loopcast.errors import RequestError
from loopcast.kl_exit import KLExit
from loopcast.presets import PRESETS

torch = pytest.importorskip("torch")

from loopcast.exporter.checkpoint import load_checkpoint  # noqa: E402
from loopcast.exporter.export import ExportOptions, export_checkpoint  # noqa: E402
from loopcast.exporter.random_checkpoint import write_random_checkpoint  # noqa: E402
from loopcast.exporter.reference_huginn import greedy_generate  # noqa: E402
from loopcast.ort_runtime.binding.recurrent_generator import RecurrentGenerator  # noqa: E402
from loopcast.ort_runtime.loading.artifact import open_artifact  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        "CUDAExecutionProvider" not in ort.get_available_providers(),
        reason="needs onnxruntime-gpu (CUDAExecutionProvider)",
    ),
]
TOLERANCE = {"fp16": 0.08, "bf16": 0.5}  # max |logit diff| vs the fp32 reference
PROMPT = [3, 17, 42, 8]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    root = tmp_path_factory.mktemp("huginn-cuda")
    return write_random_checkpoint(PRESETS["tiny-huginn"], root / "ckpt", seed=4, std=0.1), root


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("loops", [1, 4, 32])
def test_half_precision_tracks_the_fp32_reference(checkpoint, dtype, loops):
    ckpt, root = checkpoint
    out = root / f"art-{dtype}"
    if not out.exists():
        export_checkpoint(ckpt, out, ExportOptions(dtype=dtype, max_length=48))
    loaded = open_artifact(out, "cuda")
    tokens, logits = greedy_generate(load_checkpoint(ckpt), PROMPT, 8, loops=loops, seed=7, max_length=48)
    g = RecurrentGenerator(loaded, loops=loops, state_seed=7)
    rows = [g.step(PROMPT).logits[-1]] + [g.step([t]).logits[-1] for t in tokens[:-1]]
    for got, want in zip(rows, logits):
        assert float(np.abs(got - want.numpy()).max()) < TOLERANCE[dtype]
    g.rewind(0)
    assert g.step(PROMPT, kl_exit=KLExit(0.3)).exit_loops <= loops  # the full policy runs on CUDA
    with pytest.raises(RequestError, match="last-exited"):
        g.step([1], kl_exit=KLExit(0.3, kv_policy="last-exited"))


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("kl", [None, 0.3])
def test_speculation_on_cuda(checkpoint, dtype, kl):
    """Through the API on the device: where the artifact declares exact verify rows for CUDA,
    every mode gives plain decoding's tokens; elsewhere speculation is refused without
    allow_inexact, and with it says that it is not exact (the KL verify's states come back to
    the host and go out again as one-row coda inputs)."""
    from loopcast.ort_runtime.api import load

    ckpt, root = checkpoint
    out = root / f"art-{dtype}"
    if not out.exists():
        export_checkpoint(ckpt, out, ExportOptions(dtype=dtype, max_length=48))
    model = load(out, "cuda")
    options = dict(loops=32, state_seed=7, kl_threshold=kl, stop_ids=())
    plain = model.generate(PROMPT, 12, **options)
    for mode in ("prompt-lookup", "self"):
        if model.loaded.exact_verify:
            got = model.generate(PROMPT, 12, speculative=mode, **options)
            assert got.tokens == plain.tokens and got.stats.exact_greedy
            continue
        with pytest.raises(RequestError, match="allow_inexact"):
            model.generate(PROMPT, 12, speculative=mode, **options)
        got = model.generate(PROMPT, 12, speculative=mode, allow_inexact=True, **options)
        assert len(got.tokens) == 12 and not got.stats.exact_greedy
        assert got.stats.rounds > 0 or mode == "prompt-lookup"  # self always drafts
