"""Head padding (exporter/head_padding.py) without exporting: the stored layout, the rotary
math on a padded head against the model's, which head size an export stores, and the manifest's
``attention_head_size`` as the loader reads and checks it (the CUDA check included, without CUDA).
The padded artifacts themselves: tests/ort_runtime/test_padded_heads.py."""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path

import numpy as np
import pytest
from loopcast.exporter.export_options import ExportOptions, head_size
from loopcast.exporter.head_padding import HeadPadding
from loopcast.ort_runtime.loading.op_attributes import check_cuda_shapes

from loopcast.errors import ArtifactError, ExportError
from loopcast.manifest import Manifest
from loopcast.manifest_schema import parse_manifest
from loopcast.presets import PRESETS
from loopcast.quant import QuantScheme

HUGINN = PRESETS["huginn-3.5b"]  # 55 heads of 96


def test_zeros_follow_each_rotary_half_of_every_head() -> None:
    pad = HeadPadding(6, 10)
    x = np.arange(1, 13, dtype=np.float32)  # two heads of 6
    want = [1, 2, 3, 0, 0, 4, 5, 6, 0, 0, 7, 8, 9, 0, 0, 10, 11, 12, 0, 0]
    assert pad.heads(x, 2).tolist() == want
    # o_proj's [H, heads·d]: the input columns, the same layout
    m = np.stack([x, -x])
    assert pad.heads(m, 2, axis=1).tolist() == [want, [-v for v in want]]
    table = np.array([[0.5, 0.25, 0.125]], np.float32)
    assert pad.rotary(table, 1.0).tolist() == [[0.5, 0.25, 0.125, 1.0, 1.0]]
    assert pad.rotary(table, 0.0).tolist() == [[0.5, 0.25, 0.125, 0.0, 0.0]]
    same = HeadPadding(6, 6)
    assert same.heads(x, 2) is x and same.rotary(table, 1.0) is table
    with pytest.raises(ValueError, match="2 heads of 6"):
        pad.heads(x[:10], 2)
    with pytest.raises(ValueError):
        HeadPadding(6, 9)


def _rotate_half(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """The attention ops' rotary (rotary_interleaved=0): element i pairs with i + D/2."""
    half = x.shape[-1] // 2
    a, b = x[..., :half], x[..., half:]
    return np.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)


def test_padded_heads_compute_the_models_attention() -> None:
    """Rotary, q·k, softmax at the model's scale and the value sum on padded heads, then the
    padded rows of o_proj: the unpadded head's output (an independent numpy computation of what
    the attention ops do with the stored layout)."""
    rng = np.random.default_rng(0)
    d, D, S, H = 96, 128, 7, 16
    q, k, v = (rng.standard_normal((S, d)) for _ in range(3))
    o = rng.standard_normal((H, d))  # o_proj weight [out, in] of one head
    angles = np.arange(S)[:, None] * 50000.0 ** (-np.arange(0, d, 2) / d)[None, :]
    cos, sin = np.cos(angles), np.sin(angles)
    pad = HeadPadding(d, D)

    def attend(q, k, v, cos, sin, o):
        scores = _rotate_half(q, cos, sin) @ _rotate_half(k, cos, sin).T * d**-0.5  # 1/sqrt(d) both
        scores += np.triu(np.full((S, S), -np.inf), 1)
        p = np.exp(scores - scores.max(-1, keepdims=True))
        return (p / p.sum(-1, keepdims=True)) @ v @ o.T

    want = attend(q, k, v, cos, sin, o)
    got = attend(
        *(pad.heads(t, 1, axis=1) for t in (q, k, v)),
        pad.rotary(cos, 1.0),
        pad.rotary(sin, 0.0),
        pad.heads(o, 1, axis=1),
    )
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-12)

    # the zeros at the end of the head instead pair the wrong dims under rotate-half
    def tail(t):
        return np.concatenate([t, np.zeros((t.shape[0], D - d))], axis=1)

    wrong = attend(tail(q), tail(k), tail(v), pad.rotary(cos, 1.0), pad.rotary(sin, 0.0), tail(o))
    assert np.abs(wrong - want).max() > 0.1


def test_the_stored_head_size() -> None:
    """Padded with the loopcast attention ops to the next size their CUDA kernels take, on every
    dtype (quantized weights: fp16/bf16 only); never with the stock ops or above 128;
    pad_heads_to for tests."""
    fp32 = ExportOptions()
    for ops in ("loopcast-attention", "loopcast"):
        assert head_size(HUGINN, fp32, ops) == 128
        assert head_size(HUGINN, ExportOptions(dtype="bf16"), ops) == 128
    assert head_size(HUGINN, fp32, "stock") == 96
    assert head_size(HUGINN, dataclasses.replace(fp32, quantization=QuantScheme("int4")), "loopcast") == 96
    bf16_int4 = ExportOptions(dtype="bf16", quantization=QuantScheme("int4"))
    assert head_size(HUGINN, bf16_int4, "loopcast") == 128  # a CUDA-only artifact: padded
    tiny = PRESETS["tiny-ouro"]
    assert head_size(tiny, fp32, "loopcast-attention") == 16
    assert head_size(tiny.replace(hidden_size=96, head_dim=24), fp32, "loopcast-attention") == 32
    assert head_size(tiny.replace(hidden_size=4 * 160, head_dim=160), fp32, "loopcast") == 160
    assert head_size(tiny, ExportOptions(pad_heads_to=32), "loopcast-attention") == 32
    assert head_size(HUGINN, ExportOptions(pad_heads_to=96), "loopcast") == 96  # padding off
    with pytest.raises(ExportError, match="pad_heads_to 32 needs the loopcast attention ops"):
        head_size(tiny, ExportOptions(pad_heads_to=32), "stock")
    for bad in (15, 14, 258):
        with pytest.raises(ExportError, match="pad_heads_to must be an even head size in 16..256"):
            ExportOptions(pad_heads_to=bad).resolved(tiny)
    assert ExportOptions(pad_heads_to=32, quantization=QuantScheme("int8")).resolved(tiny).pad_heads_to == 32


@pytest.fixture(scope="module")
def padded_raw(tmp_path_factory) -> tuple[dict, Path]:
    """The manifest of a padded tiny export, as JSON (heads of 16 stored as 32)."""
    import json

    from loopcast.exporter.export import export_checkpoint
    from loopcast.exporter.random_checkpoint import write_random_checkpoint

    from tests.artifacts import require_exact_cpu_artifacts

    require_exact_cpu_artifacts()
    root = tmp_path_factory.mktemp("padded-manifest")
    ckpt = write_random_checkpoint(PRESETS["tiny-llama"], root / "ckpt", seed=0)
    art = root / "art"
    export_checkpoint(ckpt, art, ExportOptions(max_length=32, ops="loopcast-attention", pad_heads_to=32))
    return json.loads((art / "manifest.json").read_text()), art


def test_manifest_records_the_stored_head_size(padded_raw) -> None:
    raw, art = padded_raw
    assert raw["attention_head_size"] == 32 and raw["kv_layout"]["shape"] == [1, 2, 32, 32]
    manifest = Manifest.read(art)
    assert manifest.attention_head_size == 32 and manifest.kv_head_size == 32
    assert manifest.config.head_dim == 16  # the model's config keeps the real head size


def test_manifests_without_the_field_read_as_unpadded(padded_raw) -> None:
    """An artifact written before head padding has no attention_head_size: heads of head_dim."""
    raw = copy.deepcopy(padded_raw[0])
    del raw["attention_head_size"]
    with pytest.raises(ArtifactError, match=r"kv_layout.shape must be \[1, 2, 32, 16\]"):
        parse_manifest(raw, Path("m.json"))
    raw["kv_layout"]["shape"] = [1, 2, 32, 16]
    manifest = parse_manifest(raw, Path("m.json"))
    assert manifest.attention_head_size is None and manifest.kv_head_size == 16


@pytest.mark.parametrize(
    "value, message",
    [
        (16, "attention_head_size must be in 17..1024"),
        (33, "attention_head_size must be even"),
        ("32", "attention_head_size must be an integer"),
        (64, r"kv_layout.shape must be \[1, 2, 32, 64\] \(1, KV heads, max_length, attention_head_size\)"),
    ],
)
def test_a_bad_stored_head_size_is_refused(padded_raw, value, message) -> None:
    raw = copy.deepcopy(padded_raw[0])
    raw["attention_head_size"] = value
    with pytest.raises(ArtifactError, match=message):
        parse_manifest(raw, Path("m.json"))


def test_cuda_check_takes_the_stored_head_size(padded_raw) -> None:
    """A Huginn-0125-shaped manifest (heads of 96) loads on CUDA when its heads are stored as 128
    and is refused unpadded; the check reads the manifest only (no GPU needed)."""
    manifest = Manifest.read(padded_raw[1])
    big = dataclasses.replace(manifest, model=HUGINN.to_hf_dict(), attention_head_size=128)
    assert big.config.head_dim == 96 and big.kv_head_size == 128
    check_cuda_shapes(Path("art"), big)
    with pytest.raises(ArtifactError, match=r"head size 16/32/64/128 .*this artifact: 96, "):
        check_cuda_shapes(Path("art"), dataclasses.replace(big, attention_head_size=None))
    with pytest.raises(ArtifactError, match=r"this artifact: 112 \(heads of 96 padded\)"):
        check_cuda_shapes(Path("art"), dataclasses.replace(big, attention_head_size=112))
    check_cuda_shapes(Path("art"), dataclasses.replace(big, attention_head_size=None, op_set="stock"))
    check_cuda_shapes(Path("art"), manifest)  # the tiny one, stored as 32
