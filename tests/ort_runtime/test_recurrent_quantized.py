"""Quantized recurrent-depth (Huginn) artifacts (``export --quantize``), fp32 activations on the CPU.

The release's fused matrices (Wqkv with its q/k heads in halves order, proj, mlp.fc, mlp.proj)
and the head are quantized after the layout change; the adapter, the norms and the embedding stay
float. Fidelity: with fp32 compute (``accuracy_level`` 0) the logits track the torch reference on
the dequantized weights at r = 1, 4 and 32. Exactness: at the default level (int8 activations)
every speculative mode returns the artifact's own plain tokens, and batched rows are its
one-sequence rows bit for bit."""

from __future__ import annotations

import json

import numpy as np
import pytest

from loopcast.quant import QuantScheme, WeightFormat

torch = pytest.importorskip("torch")

from loopcast.exporter.checkpoint import load_checkpoint  # noqa: E402
from loopcast.exporter.export import ExportOptions, export_checkpoint  # noqa: E402
from loopcast.exporter.reference_huginn import greedy_generate  # noqa: E402
from loopcast.ort_runtime.api import load  # noqa: E402
from loopcast.ort_runtime.binding.recurrent_generator import RecurrentGenerator  # noqa: E402

from tests.artifacts import huginn as tiny_huginn  # noqa: E402
from tests.artifacts import scratch_root  # noqa: E402
from tests.ort_runtime.test_recurrent_batch import check_batched_rows, check_verify_rows  # noqa: E402

MAX_LENGTH = 48
PROMPT = [3, 17, 42, 8]
# release matrices under --quantize: each is [N, K], blocked along K (the output rows' order,
# which the halves reordering changes, does not move a block)
PROJECTIONS = ("attn.Wqkv.weight", "attn.proj.weight", "mlp.fc.weight", "mlp.proj.weight")


def dequantized_checkpoint(scheme: QuantScheme, pad_heads_to: int | None = None):
    """tiny-huginn with every quantized matrix replaced by its RTN round trip; a quantized tied
    head becomes an untied head holding the embedding's round trip (the embedding stays float).
    ``pad_heads_to``: the round trip in the padded layout (attn.proj's input columns, one block
    run per stored head, then the model's columns taken back; Wqkv's padded rows are whole zero
    rows, so its real rows' blocks do not move)."""
    from loopcast.exporter.head_padding import HeadPadding
    from loopcast.exporter.quantize import dequantize, quantize
    from safetensors.numpy import load_file, save_file

    from loopcast.presets import PRESETS

    ckpt, _ = tiny_huginn(MAX_LENGTH)
    tag = "-".join(f"{v}" for v in scheme.to_dict().values())
    out = scratch_root() / ("huginn-deq-" + tag + (f"-pad{pad_heads_to}" if pad_heads_to else ""))
    out.mkdir(exist_ok=True)
    tensors = {}
    for f in sorted(ckpt.glob("*.safetensors")):
        tensors.update(load_file(f))
    config = json.loads((ckpt / "config.json").read_text())

    def roundtrip(w, fmt: WeightFormat):
        return dequantize(quantize(w, fmt.bits, scheme.block_size, scheme.symmetric)).astype(w.dtype)

    cfg = PRESETS["tiny-huginn"]
    pad = HeadPadding(cfg.head_dim, pad_heads_to or cfg.head_dim)
    model_columns = np.concatenate([h * pad.stored + pad.positions() for h in range(cfg.num_heads)])
    for key in list(tensors):
        if key.endswith("attn.proj.weight") and pad.padded:
            padded = pad.heads(tensors[key], cfg.num_heads, axis=1)
            tensors[key] = np.ascontiguousarray(roundtrip(padded, scheme.layers)[:, model_columns])
        elif key.endswith(PROJECTIONS):
            tensors[key] = roundtrip(tensors[key], scheme.layers)
    if scheme.head is not WeightFormat.FLOAT:
        assert config.get("tie_embeddings", True)
        config["tie_embeddings"] = False
        tensors["lm_head.weight"] = roundtrip(tensors["transformer.wte.weight"], scheme.head)
    save_file(tensors, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(config))
    return out


def quantized_artifact(scheme: QuantScheme, tag: str, **options):
    ckpt, _ = tiny_huginn(MAX_LENGTH)
    out = scratch_root() / f"huginn-q-{tag}"
    if not out.exists():
        export_checkpoint(ckpt, out, ExportOptions(max_length=MAX_LENGTH, quantization=scheme, **options))
    return out


FIDELITY = [
    ("int4-b32", QuantScheme(WeightFormat.INT4, 32, True, WeightFormat.INT4, accuracy_level=0)),
    ("int8-b32-h4", QuantScheme(WeightFormat.INT8, 32, True, WeightFormat.INT4, accuracy_level=0)),
    ("int4-b64-asym-hfloat", QuantScheme(WeightFormat.INT4, 64, False, WeightFormat.FLOAT, accuracy_level=0)),
]


@pytest.mark.parametrize("tag, scheme", FIDELITY, ids=[t for t, _ in FIDELITY])
@pytest.mark.parametrize("loops", [1, 4, 32])
def test_logits_track_the_dequantized_reference(tag, scheme, loops):
    art = quantized_artifact(scheme, tag)
    reference = load_checkpoint(dequantized_checkpoint(scheme))
    tokens, logits = greedy_generate(reference, PROMPT, 8, loops=loops, seed=7, max_length=MAX_LENGTH)
    gen = RecurrentGenerator(load(art).loaded, loops=loops, state_seed=7)
    rows = [gen.step(PROMPT).logits[-1]] + [gen.step([t]).logits[-1] for t in tokens[:-1]]
    for got, want in zip(rows, logits, strict=True):
        assert float(np.abs(got - want.numpy()).max()) < 2e-4
        assert int(np.argmax(got)) == int(want.argmax())


@pytest.mark.parametrize("loops", [1, 4])
def test_padded_heads_are_quantized_in_their_stored_layout(loops):
    """--quantize with heads stored padded (what --target cuda does for Huginn-0125's heads of
    96): the attention matrices are quantized after the padding, so attn.proj's blocks run over
    each stored head; the logits track the reference dequantized in that layout, which differs
    from the unpadded layout's."""
    from loopcast.manifest import Manifest

    scheme = QuantScheme(WeightFormat.INT4, 32, True, WeightFormat.INT4, accuracy_level=0)
    ckpt, _ = tiny_huginn(MAX_LENGTH)
    art = scratch_root() / "huginn-q-int4-b32-pad32"
    if not art.exists():
        options = ExportOptions(max_length=MAX_LENGTH, quantization=scheme, ops="loopcast", pad_heads_to=32)
        export_checkpoint(ckpt, art, options)
    manifest = Manifest.read(art)
    assert manifest.attention_head_size == 32 and manifest.exact_verify["cpu"]
    reference = load_checkpoint(dequantized_checkpoint(scheme, pad_heads_to=32))
    unpadded = load_checkpoint(dequantized_checkpoint(scheme))
    tokens, logits = greedy_generate(reference, PROMPT, 8, loops=loops, seed=7, max_length=MAX_LENGTH)
    _, other = greedy_generate(unpadded, PROMPT, 8, loops=loops, seed=7, max_length=MAX_LENGTH)
    assert max(float((a - b).abs().max()) for a, b in zip(logits, other)) > 1e-3  # the layout matters
    gen = RecurrentGenerator(load(art).loaded, loops=loops, state_seed=7)
    rows = [gen.step(PROMPT).logits[-1]] + [gen.step([t]).logits[-1] for t in tokens[:-1]]
    for got, want in zip(rows, logits, strict=True):
        assert float(np.abs(got - want.numpy()).max()) < 2e-4
        assert int(np.argmax(got)) == int(want.argmax())


def test_manifest_and_inspect_show_the_scheme():
    from loopcast.ort_runtime.loading.describe import describe_artifact

    art = quantized_artifact(
        QuantScheme(WeightFormat.INT4, 32, True, WeightFormat.INT4), "int4-default", max_batch=4
    )
    manifest = json.loads((art / "manifest.json").read_text())
    assert manifest["quantization"]["layers"] == "int4" and manifest["model"]["model_type"] == "huginn_raven"
    assert "quantization    rtn int4 block 32 symmetric, head int4" in describe_artifact(art)


@pytest.mark.parametrize("layers", [WeightFormat.INT4, WeightFormat.INT8])
def test_every_mode_returns_the_quantized_plain_tokens(layers):
    """At the default accuracy level (int8 activations, row-invariant at block 32): prompt
    lookup, self-speculation and the pipeline give the artifact's own plain tokens at r = 4 and
    32, seeded; batched decode and verify rows are its one-sequence rows bit for bit."""
    art = quantized_artifact(QuantScheme(layers, 32, True, layers), f"{layers}-exact", max_batch=4)
    model = load(art)
    assert model.loaded.exact_verify
    loop = [5, 9, 11, 5, 9, 11, 5, 9]
    for loops in (4, 32):
        plain = model.generate(loop, 16, loops=loops, state_seed=3, stop_ids=()).tokens
        for mode in ("prompt-lookup", "self", "pipeline"):
            got = model.generate(
                loop, 16, loops=loops, state_seed=3, stop_ids=(), speculative=mode, gate="always"
            )
            assert got.tokens == plain and got.stats.exact_greedy, (mode, loops)
    check_batched_rows(model.loaded)
    check_verify_rows(model.loaded)
