"""Quantized export (loopcast/quant.py, exporter/quantize.py): the RTN round trip in numpy, the
MatMulNBits layout against ONNX Runtime, the graphs against the torch reference on the
dequantized weights, and the options refused with one clear line."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from loopcast.cli import main
from loopcast.exporter.quantize import dequantize, quantize
from loopcast.exporter.reference import KVCache
from loopcast.ort_runtime.binding.generator import Generator
from loopcast.ort_runtime.loading.artifact import open_artifact

from loopcast.manifest import SCHEMA_VERSION, Manifest
from loopcast.quant import QuantScheme, WeightFormat
from tests.artifacts import checkpoint, dequantized_reference, quantized_artifact

# fp32 compute (accuracy_level 0) so the graphs match the dequantized reference to ~1e-4
SCHEMES = [
    QuantScheme(WeightFormat.INT4, 32, True, WeightFormat.INT4, accuracy_level=0),
    QuantScheme(WeightFormat.INT8, 64, False, WeightFormat.INT8, accuracy_level=0),
    QuantScheme(WeightFormat.INT4, 128, False, WeightFormat.FLOAT, accuracy_level=1),
    # quantized embeddings (GatherBlockQuantized): asymmetric int4 (packed zero points), and a
    # block longer than the tiny models' hidden size of 64 (one partial block per row)
    QuantScheme(WeightFormat.INT4, 32, False, WeightFormat.INT8, WeightFormat.INT4, accuracy_level=0),
    QuantScheme(WeightFormat.INT8, 128, True, WeightFormat.INT8, WeightFormat.INT8, accuracy_level=0),
]


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("block", [32, 64, 128])
@pytest.mark.parametrize("symmetric", [True, False])
def test_rtn_round_trip_is_within_half_a_step(bits: int, block: int, symmetric: bool) -> None:
    rng = np.random.default_rng(bits * block)
    w = rng.standard_normal((24, 200)).astype(np.float32)  # K=200: a partial last block
    qt = quantize(w, bits, block, symmetric)
    back = dequantize(qt)
    assert back.shape == w.shape
    nb = -(-200 // block)
    assert qt.packed.shape == (24, nb, block * bits // 8) and qt.scales.shape == (24 * nb,)
    assert (qt.zero_points is None) == symmetric
    # every value is within half a quantization step of its block (plus fp32 rounding), but for
    # symmetric int4 values of the other sign than the block's extreme past code 15: one step
    step = np.repeat(np.abs(qt.scales).reshape(24, nb), block, axis=1)[:, :200]
    clipped = (symmetric and bits == 4) & (np.abs(w) > 7 * step)
    assert np.all(np.abs(w - back) <= np.where(clipped, 1.0, 0.5) * step * (1 + 1e-5) + 1e-7)
    # a value the grid holds exactly comes back exactly
    assert np.array_equal(dequantize(quantize(back, bits, block, symmetric)), back) or not symmetric


def test_int4_packing_puts_the_first_value_in_the_low_nibble() -> None:
    w = np.zeros((1, 32), np.float32)
    w[0, 0], w[0, 1] = -8.0, 7.0  # symmetric: scale -8 / -8 = 1, zero point 8 -> codes 0 and 15
    qt = quantize(w, 4, 32, True)
    assert qt.packed[0, 0, 0] == 0 | (15 << 4)
    assert qt.packed[0, 0, 1] == 8 | (8 << 4)


def test_symmetric_int4_blocks_use_every_code() -> None:
    # The largest-magnitude value takes code 0 (sign kept in the scale) and comes back exactly;
    # absmax / 7 would leave code 0 unused.
    bits = 4
    w = np.random.default_rng(bits).standard_normal((16, 64)).astype(np.float32)
    qt = quantize(w, bits, 32, True)
    back = dequantize(qt).reshape(16, 2, 32)
    blocks = w.reshape(16, 2, 32)
    at = np.abs(blocks).argmax(axis=2)[:, :, None]
    np.testing.assert_array_equal(np.take_along_axis(back, at, 2), np.take_along_axis(blocks, at, 2))
    codes = np.stack([qt.packed & 0xF, qt.packed >> 4], axis=-1)
    assert codes.min() == 0 and codes.max() <= 15


@pytest.mark.parametrize(
    "bits,block,symmetric", [(4, 32, True), (4, 64, False), (8, 128, False), (8, 32, True)]
)
def test_matmulnbits_reads_our_layout(bits: int, block: int, symmetric: bool) -> None:
    """One MatMulNBits node on our tensors equals x @ dequantize(W)ᵀ (fp32 compute)."""
    from loopcast.exporter.matmulnbits_rows import matmulnbits_session

    from loopcast.quant import QuantLinear

    rng = np.random.default_rng(1)
    k, n = 96, 40
    w = np.random.default_rng(5).standard_normal((n, k)).astype(np.float32) * 0.05
    qt = quantize(w, bits, block, symmetric)
    linear = QuantLinear("w", k, n, bits, block, symmetric, 0)
    sess = matmulnbits_session(linear, qt.packed, qt.scales, qt.zero_points, threads=1)
    x = rng.standard_normal((3, k)).astype(np.float32)
    expected = x @ dequantize(qt).T
    np.testing.assert_allclose(sess.run(None, {"A": x})[0], expected, rtol=1e-4, atol=1e-5)


def _close(actual, expected) -> None:
    np.testing.assert_allclose(actual, expected.detach().numpy(), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", ["ouro-r3", "llama-tied-gqa", "llama-untied"])
@pytest.mark.parametrize(
    "scheme", SCHEMES, ids=lambda s: f"{s.layers}-b{s.block_size}-{s.head}-e{s.embedding}"
)
def test_graphs_match_the_reference_on_dequantized_weights(name: str, scheme: QuantScheme) -> None:
    model = dequantized_reference(name, scheme)
    path = quantized_artifact(name, scheme)
    manifest = Manifest.read(path)
    assert manifest.quantization == scheme and manifest.schema_version == SCHEMA_VERSION
    loaded = open_artifact(path)
    gen = Generator(loaded)
    cfg, W = model.config, manifest.verify_width
    cache = KVCache(cfg, manifest.max_length)
    rng = np.random.default_rng(3)
    prompt = rng.integers(3, cfg.vocab_size, 7).tolist()
    with torch.no_grad():
        ref = model(torch.tensor([prompt]), start=0, cache=cache)
        out = gen.run("prefill", 0, tokens=prompt)
        _close(out.logits[-1], ref.final_logits[0, -1])
        gen.commit(prompt)
        rows = rng.integers(3, cfg.vocab_size, W).tolist()
        ref = model(torch.tensor([rows]), start=gen.n, cache=cache)
        out = gen.run("verify", gen.n, tokens=rows)
        _close(out.logits, ref.final_logits[0])
        gen.commit(rows)
        if cfg.num_loops > 1:  # the draft depth, then loops d..R-1 from the depth-d state
            d = manifest.draft_depth
            token = int(out.next_ids[-1])
            ref_d = model(torch.tensor([[token]]), start=gen.n, cache=cache, last_loop=d)
            out = gen.run("draft", gen.n, tokens=[token])
            _close(out.logits, ref_d.final_logits[0])
            _close(out.hidden, ref_d.hidden[-1][0])
            hidden = torch.cat([ref_d.hidden[-1]] * W, dim=1)
            ref_t = model(None, start=gen.n, cache=cache, first_loop=d, hidden_BSH=hidden)
            out = gen.run("verify_tail", gen.n, hidden=hidden[0].numpy())
            _close(out.logits, ref_t.final_logits[0])


def test_quantized_weights_file_is_smaller_and_typed() -> None:
    from loopcast.exporter.weights import read_stored

    scheme = SCHEMES[0]
    stored = read_stored(quantized_artifact("llama-tied-gqa", scheme) / "weights.safetensors")
    assert stored["layers.0.qkv_proj.weight_q"].dtype == "uint8"
    assert stored["layers.0.qkv_proj.scales"].dtype == "fp32"
    assert "layers.0.qkv_proj.weight_T" not in stored
    assert stored["embed_tokens.weight"].dtype == "fp32"  # the Gather stays float
    assert "lm_head.weight_q" in stored  # the tied head's quantized copy
    assert stored["layers.0.input_layernorm.weight"].dtype == "fp32"


def test_a_quantized_embedding_replaces_the_float_one() -> None:
    from loopcast.exporter.weights import read_stored

    path = quantized_artifact("llama-tied-gqa", SCHEMES[3])
    stored = read_stored(path / "weights.safetensors")
    assert "embed_tokens.weight" not in stored
    V, H = 101, 64  # tests/tiny_models.py: llama-tied-gqa
    packed, scales, zero_points = (stored[f"embed_tokens.{t}"] for t in ("weight_q", "scales", "zero_points"))
    assert packed.dtype == "uint8" and tuple(packed.shape) == (V, H // 2)
    assert tuple(scales.shape) == (V, 2) and tuple(zero_points.shape) == (V, 1)
    import onnx

    graph = onnx.load(str(path / "prefill.onnx"), load_external_data=False).graph
    assert "GatherBlockQuantized" in {n.op_type for n in graph.node}


def _cli(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


@pytest.mark.parametrize(
    "extra,message",
    [
        (["--quantize", "int4", "--block-size", "48"], "--block-size must be one of 32, 64, 128, got 48"),
        (["--quantize", "int3"], "--quantize must be one of int4, int8, got 'int3'"),
        (["--quantize", "int4", "--dtype", "fp16"], "--quantize with --dtype fp16 needs --ops loopcast"),
        (["--quantize", "int4", "--dtype", "bf16", "--ops", "stock"], "--dtype bf16 needs --ops loopcast"),
        (
            ["--quantize", "int8", "--quantize-head", "float", "--quantize-embedding", "int8"],
            "--quantize-embedding with a tied float head",
        ),
        (
            ["--quantize", "int4", "--quantize-embedding", "int4", "--dtype", "fp16", "--ops", "loopcast"],
            "--quantize-embedding with --dtype fp16",
        ),
        (["--quantize", "int8", "--quantize-head", "int2"], "--quantize-head must be one of"),
        (["--block-size", "64"], "--block-size needs --quantize int4|int8"),
        (["--quantize", "int4", "--accuracy-level", "2"], "--accuracy-level must be 0, 1 or 4"),
    ],
)
def test_bad_options_give_one_line(tmp_path, extra: list[str], message: str) -> None:
    result = _cli("export", checkpoint("llama-tied-gqa"), "-o", tmp_path / "a", *extra)
    assert result.exit_code != 0
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], result.output
    assert not (tmp_path / "a" / "manifest.json").exists()


def test_16_bit_quantized_artifacts_take_the_loopcast_ops(tmp_path) -> None:
    """--target cuda --dtype fp16 --quantize int4: BatchInvariantMatMulNBits with fp16 activations
    (fp32 scales, uint8 codes); exact_verify["cuda"] is declared by the op set (the CPU runs fp32
    only)."""
    result = _cli(
        "export",
        checkpoint("ouro-r3"),
        "-o",
        tmp_path / "a",
        "--quantize",
        "int4",
        "--target",
        "cuda",
        "--dtype",
        "fp16",
    )
    assert result.exit_code == 0, result.output
    manifest = Manifest.read(tmp_path / "a")
    assert manifest.op_set == "loopcast" and manifest.dtype == "fp16"
    assert manifest.exact_verify == {"cpu": False, "cuda": True}
    assert "BatchInvariantMatMulNBits" in manifest.custom_ops


def test_inspect_shows_the_scheme() -> None:
    path = quantized_artifact("ouro-r3", SCHEMES[1])
    result = _cli("inspect", path)
    assert result.exit_code == 0, result.output
    assert "quantization    rtn int8 block 64 asymmetric, head int8" in result.output
