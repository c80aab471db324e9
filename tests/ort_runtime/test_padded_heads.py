"""Artifacts with padded attention heads (exporter/head_padding.py), fp32 on the CPU with the
loopcast attention ops: the same greedy tokens as the unpadded export and logits within 1e-4
(sums over more zero terms: equal to rounding, not promised bit for bit), KV buffers of the
stored head size, the manifest and ``inspect`` saying so, and verify rows still the decode rows
bit for bit. Heads of 16 are padded on request (``pad_heads_to``); heads of 24, which the CUDA
kernels lack, are padded to 32 on their own, as Huginn-0125's 96 are to 128. Row invariance of
padded artifacts is also checked by the existing tests, parametrized over padding
(test_batch_invariant_artifact.py, test_recurrent_invariant.py)."""

from __future__ import annotations

import dataclasses
import json
import math
import shutil

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from loopcast.exporter.checkpoint import load_checkpoint  # noqa: E402
from loopcast.exporter.export import ExportOptions, export_checkpoint  # noqa: E402
from loopcast.exporter.random_checkpoint import write_random_checkpoint  # noqa: E402
from loopcast.exporter.reference_huginn import greedy_generate  # noqa: E402
from loopcast.ort_runtime.binding.generator import Generator  # noqa: E402
from loopcast.ort_runtime.binding.recurrent_generator import RecurrentGenerator  # noqa: E402
from loopcast.ort_runtime.decoding.exactness import decode_rows, rows_match_on_cpu  # noqa: E402
from loopcast.ort_runtime.loading.artifact import open_artifact  # noqa: E402
from loopcast.ort_runtime.loading.describe import describe_artifact  # noqa: E402

from loopcast.manifest import Manifest  # noqa: E402
from loopcast.presets import PRESETS  # noqa: E402
from tests.artifacts import artifact, checkpoint, huginn, require_exact_cpu_artifacts, scratch_root  # noqa: E402

OPS = "loopcast-attention"
PROMPT = [3, 17, 42, 8, 3, 17, 42]
MAX_LENGTH = 48


@pytest.fixture(scope="module", autouse=True)
def _needs_the_op_library():
    require_exact_cpu_artifacts()


def _looped_rows(path, prompt, steps=12):
    gen = Generator(open_artifact(path))
    fed, rows = decode_rows(gen, prompt, steps)
    return fed, rows, gen


def _same_generation(got, want) -> None:
    (got_ids, got_rows), (want_ids, want_rows) = got, want
    assert got_ids == want_ids
    for a, b in zip(got_rows, want_rows):
        np.testing.assert_allclose(a, b, atol=1e-4, rtol=0)


def _declares_padding(path, head_dim: int, stored: int) -> None:
    manifest = Manifest.read(path)
    assert manifest.config.head_dim == head_dim
    assert manifest.attention_head_size == stored and manifest.kv_layout["shape"][-1] == stored
    assert manifest.exact_verify["cpu"]  # measured at export: rows stay row-invariant
    assert f"KV heads of {head_dim}, stored as {stored} (zero-padded" in describe_artifact(path)


@pytest.mark.parametrize("name", ["ouro-r3", "llama-tied-gqa"])
def test_padded_looped_artifact_generates_the_unpadded_tokens(name) -> None:
    plain, padded = artifact(name, ops=OPS), artifact(name, ops=OPS, pad_heads_to=32)
    _declares_padding(padded, 16, 32)
    assert Manifest.read(plain).attention_head_size is None
    fed, rows, _ = _looped_rows(plain, PROMPT)
    fed_p, rows_p, gen = _looped_rows(padded, PROMPT)
    _same_generation((fed_p, rows_p), (fed, rows))
    cfg = gen.model.config
    for slot in range(cfg.num_kv_slots):
        key, value = gen.kv_arrays(slot)
        assert key.shape == value.shape == (1, cfg.num_kv_heads, gen.max_length, 32)
    # every graph kind's rows (verify, draft + verify_tail, the cycle) against decode's
    assert rows_match_on_cpu(padded)


def test_an_artifact_without_the_field_still_loads(tmp_path) -> None:
    """An artifact exported before head padding: no attention_head_size in its manifest."""
    old = tmp_path / "old"
    shutil.copytree(artifact("ouro-r3", ops=OPS), old)
    raw = json.loads((old / "manifest.json").read_text())
    del raw["attention_head_size"]
    (old / "manifest.json").write_text(json.dumps(raw))
    assert Manifest.read(old).kv_head_size == 16
    fed, rows, _ = _looped_rows(old, PROMPT, 4)
    want, want_rows, _ = _looped_rows(artifact("ouro-r3", ops=OPS), PROMPT, 4)
    assert fed == want and all(np.array_equal(a, b) for a, b in zip(rows, want_rows))


def _greedy(gen, loops, n=8):
    gen.rewind(0)
    gen.configure(loops, 7)
    return gen.greedy(PROMPT, n)


@pytest.fixture(scope="module")
def huginn_pair():
    _, plain = huginn(MAX_LENGTH, OPS)
    ckpt, padded = huginn(MAX_LENGTH, OPS, pad_heads_to=32)
    return ckpt, RecurrentGenerator(open_artifact(plain)), RecurrentGenerator(open_artifact(padded)), padded


@pytest.mark.parametrize("loops", [1, 4])
def test_padded_huginn_generates_the_unpadded_tokens(huginn_pair, loops) -> None:
    _, plain, padded, path = huginn_pair
    _declares_padding(path, 16, 32)
    _same_generation(_greedy(padded, loops), _greedy(plain, loops))
    cfg = padded.config
    assert all(
        k.host.shape == v.host.shape == (1, cfg.num_kv_heads, MAX_LENGTH, 32) for k, v in padded.kv.values()
    )


# tiny-huginn with heads of 24 (hidden 96): a size the CUDA kernels lack, as they lack Huginn-0125's 96
HUGINN_24 = dataclasses.replace(
    PRESETS["tiny-huginn"],
    hidden_size=96,
    head_dim=24,
    embed_scale=math.sqrt(96),
    state_std=math.sqrt(2 / (5 * 96)) * math.sqrt(96),
)


@pytest.fixture(scope="module")
def huginn_24():
    """tiny-huginn with heads of 24 (hidden 96: the CUDA kernels lack 24, as they lack
    Huginn-0125's 96): exported as it is (pad_heads_to=24: no padding) and by default."""
    config = HUGINN_24
    root = scratch_root() / "huginn-24"
    ckpt = write_random_checkpoint(config, root / "ckpt", seed=4, std=0.1)
    arts = {}
    for pad in (24, None):
        arts[pad] = root / f"art-{pad}"
        export_checkpoint(ckpt, arts[pad], ExportOptions(max_length=MAX_LENGTH, ops=OPS, pad_heads_to=pad))
    return load_checkpoint(ckpt), arts


@pytest.mark.parametrize("loops", [1, 4])
def test_a_head_size_the_cuda_kernels_lack_is_padded_on_its_own(huginn_24, loops) -> None:
    """Heads of 24 (with the q/k bias and the pair-to-half reordering) stored as 32 by default:
    tokens equal to the unpadded export's and to the torch reference's, logits within 1e-4."""
    model, arts = huginn_24
    _declares_padding(arts[None], 24, 32)
    assert Manifest.read(arts[24]).attention_head_size is None
    plain, padded = (RecurrentGenerator(open_artifact(arts[p])) for p in (24, None))
    got = _greedy(padded, loops)
    _same_generation(got, _greedy(plain, loops))
    want_ids, want_logits = greedy_generate(model, PROMPT, 8, loops=loops, seed=7, max_length=MAX_LENGTH)
    _same_generation(got, (want_ids, [w.numpy() for w in want_logits]))
    assert rows_match_on_cpu(arts[None])


def test_a_cuda_quantized_export_pads_its_heads_and_the_cpu_one_does_not(tmp_path) -> None:
    """Heads of 24 under --quantize: a bf16 --ops loopcast artifact (CUDA only) stores them as
    32, its attention matrices quantized in that layout (o_proj's K = heads·32); the fp32 one
    (the CPU's) keeps 24."""
    from loopcast.exporter.weights import read_stored

    from loopcast.quant import QuantScheme

    config = HUGINN_24
    ckpt = write_random_checkpoint(config, tmp_path / "ckpt", seed=4, std=0.1)
    for dtype, stored in (("bf16", 32), ("fp32", 24)):
        out = tmp_path / dtype
        options = dict(max_length=MAX_LENGTH, ops="loopcast", quantization=QuantScheme("int4"))
        export_checkpoint(ckpt, out, ExportOptions(dtype, **options))
        manifest = Manifest.read(out)
        assert manifest.kv_head_size == stored, dtype
        o_proj = read_stored(out / manifest.weights_file)["layers.0.o_proj.weight_q"]
        assert o_proj.shape == (96, config.num_heads * stored // 32, 16), dtype  # [N, K blocks, 32 codes]


def test_a_padded_quantized_looped_artifact_tracks_the_unpadded_one() -> None:
    """A looped model's heads of 16 stored as 32 under --quantize int8 (the embedding quantized
    too, which is not padded): the projections' blocks are the unpadded ones but o_proj's, so
    the logits stay near the unpadded quantized artifact's, and rows stay the decode rows."""
    from loopcast.quant import QuantScheme, WeightFormat
    from tests.artifacts import quantized_artifact

    scheme = QuantScheme(WeightFormat.INT8, 32, True, WeightFormat.INT8, WeightFormat.INT8)
    plain = quantized_artifact("llama-tied-gqa", scheme, ops="loopcast")
    padded = scratch_root() / "qart-llama-tied-gqa-int8-pad32"
    if not padded.exists():
        options = ExportOptions(ops="loopcast", quantization=scheme, pad_heads_to=32)
        export_checkpoint(checkpoint("llama-tied-gqa"), padded, options)
    _declares_padding(padded, 16, 32)
    fed, rows, _ = _looped_rows(plain, PROMPT, 4)
    fed_p, rows_p, _ = _looped_rows(padded, PROMPT, 4)
    assert fed_p == fed
    for a, b in zip(rows_p, rows, strict=True):
        assert np.corrcoef(a, b)[0, 1] > 0.999
    assert rows_match_on_cpu(padded)
