"""A recurrent-depth (Huginn) artifact in the row-invariant op set (``--ops loopcast``), fp32 on
the CPU: every hot op is a loopcast op (the projections BatchInvariantMatMul with the q/k bias an
Add after it, the norms ResidualRMSNorm, the SwiGLU inside the down projection, the tied head read
in place), the logits track the torch reference at r = 1, 4 and 32, verify rows and the
pipeline's cycle rows are decode rows bit for bit, and every speculative mode gives plain
decoding's tokens. The same artifact on CUDA: tests/ort_runtime/test_recurrent_cuda.py."""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import onnx  # noqa: E402
from loopcast.exporter.checkpoint import load_checkpoint  # noqa: E402
from loopcast.exporter.reference_huginn import greedy_generate  # noqa: E402
from loopcast.ort_runtime.binding.recurrent_generator import RecurrentGenerator  # noqa: E402
from loopcast.ort_runtime.loading.artifact import open_artifact  # noqa: E402

from tests.artifacts import huginn as tiny_huginn  # noqa: E402
from tests.artifacts import require_exact_cpu_artifacts  # noqa: E402
from tests.ort_runtime.test_recurrent_pipeline import Oracle, check_cycles, plain, run  # noqa: E402

MAX_LENGTH = 48
PROMPT = [3, 17, 42, 8, 3, 17, 42]
KINDS = ("prelude", "core_step", "coda", "recurrent_cycle")
# what the stock and loopcast-attention op sets use and the row-invariant one must not
STOCK_HOT_OPS = {
    "MatMul",
    "Gemm",
    "RMSNormalization",
    "SkipSimplifiedLayerNormalization",
    "GroupQueryAttention",
}


@pytest.fixture(scope="module")
def huginn():
    require_exact_cpu_artifacts()
    ckpt, art = tiny_huginn(MAX_LENGTH, "loopcast")
    return ckpt, art, load_checkpoint(ckpt)


@pytest.fixture(scope="module")
def gen(huginn):
    return RecurrentGenerator(open_artifact(huginn[1]))


@pytest.fixture(scope="module")
def padded_gen(huginn):
    """The same checkpoint with its heads of 16 stored as 32 (exporter/head_padding.py)."""
    gen = RecurrentGenerator(open_artifact(tiny_huginn(MAX_LENGTH, "loopcast", pad_heads_to=32)[1]))
    assert gen.loaded.manifest.kv_head_size == 32
    return gen


def test_every_hot_op_is_a_loopcast_op(huginn):
    _, art, _ = huginn
    manifest = json.loads((art / "manifest.json").read_text())
    assert manifest["op_set"] == "loopcast"
    assert manifest["exact_verify"] == {"cpu": True, "cuda": True}
    assert set(manifest["graphs"]) == set(KINDS)
    layers = {"prelude": 2, "core_step": 2, "coda": 2, "recurrent_cycle": 6}
    for kind in KINDS:
        nodes = onnx.load(art / f"{kind}.onnx", load_external_data=False).graph.node
        types = [n.op_type for n in nodes]
        assert not STOCK_HOT_OPS & set(types), (kind, STOCK_HOT_OPS & set(types))
        # per block: qkv, o, gate|up, down (+ the adapter in a core step, the head in the coda)
        extra = {"prelude": 0, "core_step": 1, "coda": 1, "recurrent_cycle": 2}[kind]
        assert types.count("BatchInvariantMatMul") == 4 * layers[kind] + extra, kind
        # per block: n1 alone, [+x, n2, n3], [+x1, n4]; the coda's ln_f twice
        assert types.count("ResidualRMSNorm") == 3 * layers[kind] + 2 * (kind in ("coda", "recurrent_cycle"))
        bias_adds = [n for n in nodes if n.op_type == "Add" and n.name.endswith("qkv_proj/bias")]
        assert len(bias_adds) == layers[kind], kind  # the q/k bias after the row-invariant MatMul


@pytest.mark.parametrize("loops", [1, 4, 32])
@pytest.mark.parametrize("seed", [None, 7])
def test_logits_match_the_reference(huginn, gen, loops, seed):
    _, _, model = huginn
    gen.rewind(0)
    gen.configure(loops, seed)
    tokens, logits = gen.greedy(PROMPT, 8)
    want_tokens, want_logits = greedy_generate(
        model, PROMPT, 8, loops=loops, seed=seed, max_length=MAX_LENGTH
    )
    assert tokens == want_tokens
    for got, want in zip(logits, want_logits):
        np.testing.assert_allclose(got, want.numpy(), atol=1e-4, rtol=0)


@pytest.mark.parametrize("padded", [False, True], ids=["heads-16", "padded-to-32"])
@pytest.mark.parametrize("loops", [1, 4, 32])
def test_verify_rows_are_decode_rows(request, loops, padded):
    """One M-row call against M one-row calls at the same positions, bit for bit."""
    gen = request.getfixturevalue("padded_gen" if padded else "gen")
    gen.rewind(0)
    gen.configure(loops, 7)
    first = gen.step(PROMPT)
    fed = [int(first.next_ids[-1])]
    rows = []
    for _ in range(6):
        out = gen.step([fed[-1]])
        rows.append(out.logits[-1])
        fed.append(int(out.next_ids[-1]))
    gen.rewind(len(PROMPT))
    verified = gen.verify(fed[:6])
    for i, row in enumerate(rows):
        assert np.array_equal(verified.logits[i], row), f"row {i} at r = {loops}"


@pytest.mark.parametrize("loops", [4, 32])
@pytest.mark.parametrize("spoil", [(), range(0, 99, 3)], ids=["none", "every-third"])
def test_cycle_rows_are_decode_rows(gen, loops, spoil):
    """The pipeline on oracle drafts: every leaving row is plain's one-row coda call bit for bit
    and the tokens are plain's."""
    want, logits, n_left = plain(gen, PROMPT, 20, loops, state_seed=7)
    sequence = PROMPT + want
    got, stats, n_got = run(
        gen,
        PROMPT,
        20,
        loops=loops,
        state_seed=7,
        speculative="pipeline",
        gate="always",
        proposer=Oracle(sequence, spoil),
        trace=True,
    )
    assert got == want and n_got == n_left and stats.exact_greedy
    assert check_cycles(stats.pipeline_trace, sequence, logits, len(PROMPT), loops) == len(want) - 1


@pytest.mark.parametrize("mode", ["prompt-lookup", "self", "pipeline"])
def test_speculative_modes_give_plain_tokens(gen, mode):
    want, _, _ = plain(gen, PROMPT, 16, 32, state_seed=3)
    extra = {"draft_loops": 8} if mode == "self" else {}
    got, stats, _ = run(gen, PROMPT, 16, loops=32, state_seed=3, speculative=mode, **extra)
    assert got == want and stats.exact_greedy


def test_half_precision_loopcast_attention_refuses_only_what_padding_cannot_fix():
    """Huginn-0125's head_dim 96: the CUDA attention kernels take 16, 32, 64 or 128, so its heads
    are padded to 128 (exporter/head_padding.py) and its fp16/bf16 export with the loopcast
    attention ops goes ahead, quantized weights included (quantized in the padded layout); a
    head above 128 is refused before anything is written."""
    import dataclasses

    from loopcast.exporter.export_options import ExportOptions, check_cuda_attention, head_size

    from loopcast.errors import ExportError
    from loopcast.presets import PRESETS
    from loopcast.quant import QuantScheme

    big = PRESETS["huginn-3.5b"]
    bf16 = ExportOptions(dtype="bf16")
    for ops in ("loopcast", "loopcast-attention"):
        check_cuda_attention(big, bf16, ops)
        assert head_size(big, bf16, ops) == 128
    assert head_size(big, bf16, "stock") == 96  # GroupQueryAttention takes 96 as it is
    wide = dataclasses.replace(big, hidden_size=55 * 160, head_dim=160)
    with pytest.raises(ExportError, match="head size 160 .* padded to at most 128"):
        check_cuda_attention(wide, bf16, "loopcast")
    quantized = dataclasses.replace(bf16, quantization=QuantScheme(layers="int4"))
    check_cuda_attention(big, quantized, "loopcast")
    assert head_size(big, quantized, "loopcast") == 128
    check_cuda_attention(big, bf16, "stock")
    check_cuda_attention(wide, ExportOptions(), "loopcast")  # fp32: the CPU kernels take any even size
    check_cuda_attention(PRESETS["tiny-huginn"], ExportOptions(dtype="fp16"), "loopcast")
