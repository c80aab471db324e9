"""``export --batch-invariant``: every verify row is the M=1 decode row, bit for bit (CPU fp32).

The stock graphs only promise rows within ~1e-6 (GroupQueryAttention reduces differently for
M=1 and M=W); with the loopcast ops the equality is exact, so speculation returns plain
greedy's tokens by construction rather than by margin.
"""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest
import torch
from loopcast.custom_ops.build import find_ort_include
from loopcast.ort_runtime import load
from loopcast.ort_runtime.decoding.exactness import decode_rows
from loopcast.ort_runtime.decoding.proposers import SelfDraftProposer

from loopcast.manifest import DRAFT, VERIFY, VERIFY_TAIL, Manifest
from tests.artifacts import TINY, artifact, reference
from tests.ort_runtime.test_generator import DEMO_PROMPTS

# Looped models also get the pipeline's cycle graph, whose attention is RowAttention.
OPS = ["BatchInvariantAttention", "BatchInvariantMatMul", "LaneStep", "ResidualRMSNorm", "RowAttention"]


@pytest.fixture(scope="module", autouse=True)
def _needs_compiler():
    if find_ort_include() is None or shutil.which("c++") is None:
        if os.environ.get("LOOPCAST_REQUIRE_C") == "1":
            pytest.fail("ORT C++ headers or a C++ compiler missing")
        pytest.skip("ORT C++ headers or a C++ compiler missing (tools/c_generate/fetch_deps.sh)")


def _bi(name: str, **kw):
    return artifact(
        name,
        draft_depth=1 if TINY.get(name, None) is None or TINY[name].num_loops > 1 else None,
        batch_invariant=True,
        **kw,
    )


def _decode_rows(model, prompt: list[int], steps: int) -> tuple[list[int], list[np.ndarray]]:
    """Plain M=1 decode from ``prompt`` on a fresh generator: the fed tokens and each step's logits row."""
    return decode_rows(model.new_generator(), prompt, steps)


def test_manifest_lists_the_ops_and_the_artifact_carries_the_library() -> None:
    path = _bi("ouro-r3")
    manifest = Manifest.read(path)
    assert manifest.custom_ops == OPS
    assert (path / manifest.custom_op_library).is_file()
    graph = (path / "verify.onnx").read_bytes()
    assert b"GroupQueryAttention" not in graph and b"BatchInvariantAttention" in graph


# heads padded (exporter/head_padding.py: 16 stored as 32) keep the rows row-invariant
@pytest.mark.parametrize(
    "name, pad", [("demo", None), *((n, None) for n in TINY), ("ouro-r3", 32), ("llama-tied-gqa", 32)]
)
def test_verify_rows_are_the_decode_rows_bit_for_bit(name: str, pad: int | None) -> None:
    model = load(_bi(name, pad_heads_to=pad))
    assert model.loaded.manifest.kv_head_size == (pad or model.config.head_dim)
    W = model.loaded.manifest.verify_width
    rng = np.random.default_rng(5)
    prompts = (
        [model.encode(p) for p in DEMO_PROMPTS[:4]]
        if name == "demo"
        else [rng.integers(0, model.config.vocab_size, n).tolist() for n in (1, 6, 13)]
    )
    for prompt in prompts:
        fed, rows = _decode_rows(model, prompt, W)
        gen = model.new_generator()
        gen.prefill(prompt)
        out = gen.run(VERIFY, gen.n, tokens=fed)
        for i in range(W):
            assert np.array_equal(out.logits[i], rows[i]), (
                name,
                i,
                float(np.abs(out.logits[i] - rows[i]).max()),
            )
        # Fewer real rows than W (padding repeats the last token) changes nothing either.
        short = model.new_generator()
        short.prefill(prompt)
        out = short.run(VERIFY, short.n, tokens=fed[:2])
        assert np.array_equal(out.logits[0], rows[0]) and np.array_equal(out.logits[1], rows[1])


@pytest.mark.parametrize("name", ["demo", "ouro-r3", "ouro-r2-gqa"])
def test_verify_tail_rows_are_the_decode_rows_bit_for_bit(name: str) -> None:
    model = load(_bi(name))
    W = model.loaded.manifest.verify_width
    prompt = model.encode(DEMO_PROMPTS[1]) if name == "demo" else list(range(3, 12))
    fed, rows = _decode_rows(model, prompt, W)
    gen = model.new_generator()
    gen.prefill(prompt)
    start = gen.n
    hidden = [gen.run(DRAFT, start + i, tokens=[t]).hidden[0].copy() for i, t in enumerate(fed)]
    out = gen.run(VERIFY_TAIL, start, hidden=np.stack(hidden))
    for i in range(W):
        assert np.array_equal(out.logits[i], rows[i]), (name, i)


@pytest.mark.parametrize("name", ["ouro-r3", "llama-tied-gqa"])
def test_logits_match_the_torch_reference(name: str) -> None:
    model = load(_bi(name))
    ref = reference(name)
    prompt = list(range(2, 11))
    fed, rows = _decode_rows(model, prompt, 4)
    with torch.no_grad():
        logits = ref(torch.tensor([prompt + fed])).final_logits[0]
    for i, row in enumerate(rows):
        np.testing.assert_allclose(row, logits[len(prompt) + i].numpy(), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("mode", ["prompt-lookup", "self"])
def test_speculation_equals_plain_greedy(mode: str) -> None:
    model = load(_bi("demo"))
    for prompt in DEMO_PROMPTS[:6]:
        plain = model.generate(prompt, 96)
        spec = model.generate(prompt, 96, speculative=mode, num_draft_tokens=4)
        assert spec.tokens == plain.tokens, prompt
        assert spec.stats.exact_greedy


@pytest.mark.parametrize("kind", ["always-wrong", "last-wrong"])
def test_forced_rejections_keep_exact_tokens(kind: str) -> None:
    model = load(_bi("demo"))
    prompt = model.encode("def merge(left, right):\n    result = []\n")
    plain = model.generate(prompt, 64, stop_ids=())
    vocab = model.config.vocab_size
    perturb = {
        "always-wrong": lambda i, t: (t + 1) % vocab,
        "last-wrong": lambda i, t: (t + 3) % vocab if i == 3 else t,
    }[kind]
    spec = model.generate(
        prompt, 64, stop_ids=(), speculative="self", num_draft_tokens=4, proposer=SelfDraftProposer(perturb)
    )
    assert spec.tokens == plain.tokens


def test_cli_target_cuda_selects_the_loopcast_ops(tmp_path) -> None:
    from click.testing import CliRunner
    from loopcast.cli import main

    from tests.artifacts import checkpoint

    # cpu: the default fp32 op set, the loopcast attention op with stock MatMul (exact on the CPU)
    for target, ops in (("cuda", OPS), ("cpu", ["BatchInvariantAttention", "LaneStep", "RowAttention"])):
        out = tmp_path / target
        result = CliRunner().invoke(
            main, ["export", str(checkpoint("ouro-r3")), "-o", str(out), "--target", target]
        )
        assert result.exit_code == 0, result.output
        assert Manifest.read(out).custom_ops == ops, target


def test_norm_prologue_artifact_gives_the_same_bits(tmp_path, monkeypatch) -> None:
    """LOOPCAST_NORM_PROLOGUE=1 (graphs/norm_prologue.py) folds the norms into the projections:
    decode rows bit for bit those of the separate-norm artifact, and verify rows those decode rows."""
    from loopcast.exporter.export import ExportOptions, export_checkpoint

    from tests.artifacts import checkpoint

    monkeypatch.setenv("LOOPCAST_NORM_PROLOGUE", "1")
    fused_path = tmp_path / "fused"
    export_checkpoint(checkpoint("ouro-r3"), fused_path, ExportOptions("fp32", None, 5, 1, True, "auto"))
    monkeypatch.delenv("LOOPCAST_NORM_PROLOGUE")
    plain, fused = load(_bi("ouro-r3")), load(fused_path)
    graph = (fused_path / "decode.onnx").read_bytes()
    assert graph.count(b"ResidualRMSNorm") < (_bi("ouro-r3") / "decode.onnx").read_bytes().count(
        b"ResidualRMSNorm"
    )
    prompt = list(range(3, 12))
    fed, rows = _decode_rows(plain, prompt, 5)
    fed_fused, rows_fused = _decode_rows(fused, prompt, 5)
    assert fed == fed_fused and all(np.array_equal(a, b) for a, b in zip(rows, rows_fused))
    gen = fused.new_generator()
    gen.prefill(prompt)
    out = gen.run(VERIFY, gen.n, tokens=fed)
    for i in range(5):
        assert np.array_equal(out.logits[i], rows[i]), i
