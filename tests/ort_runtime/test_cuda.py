"""The CUDA path (needs onnxruntime-gpu and a GPU; skipped elsewhere, as in CI).

Captured CUDA graphs must give the tokens of eager runs; fp16/bf16 graphs track the fp32 torch
reference within dtype tolerance; with the batch-invariant ops every verify row equals the
M=1 decode row bit for bit and speculation equals plain greedy of the same dtype.
"""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
import torch
from loopcast.ort_runtime import load
from loopcast.ort_runtime.decoding.exactness import decode_rows

from loopcast.errors import ArtifactError
from loopcast.manifest import CYCLE, CYCLE_RUN, DECODE, DRAFT, VERIFY, VERIFY_TAIL
from loopcast.vocab import BATCH_KINDS, LOOP_STEP_KINDS
from tests.artifacts import artifact, reference
from tests.ort_runtime.test_generator import DEMO_PROMPTS

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        "CUDAExecutionProvider" not in ort.get_available_providers(),
        reason="needs onnxruntime-gpu (CUDAExecutionProvider)",
    ),
]
HOT = (DECODE, VERIFY, DRAFT, VERIFY_TAIL)
TOLERANCE = {"fp32": 1e-3, "fp16": 0.08, "bf16": 0.5}  # max |logit diff| vs the fp32 reference


def _capturable(model) -> set[str]:
    """The kinds a load captures on CUDA: every fixed-row graph but the batched and loop-step
    kinds (the static-depth decode@k / verify@k and the exit gate's graph included)."""
    manifest = model.loaded.manifest
    return {
        kind
        for kind, spec in manifest.graphs.items()
        if spec.rows is not None and kind not in BATCH_KINDS and kind not in LOOP_STEP_KINDS
    }


def _decoded(model, prompt: str, steps: int):
    """A fresh generator that decoded ``prompt`` then ``steps`` tokens one row at a time
    (``decode_rows``), rewound to the prompt: (generator, tokens fed, each row's logits)."""
    ids = model.encode(prompt)
    gen = model.new_generator()
    fed, rows = decode_rows(gen, ids, steps)
    gen.rewind(len(ids))
    return gen, fed, rows


def _demo(dtype: str, batch_invariant: bool = False, **kw):
    ops = "loopcast" if batch_invariant else "stock"
    return load(
        artifact("demo", dtype, draft_depth=1, batch_invariant=batch_invariant, ops=ops), "cuda", **kw
    )


def test_fp32_stock_graphs_are_refused_on_cuda() -> None:
    # GroupQueryAttention has no fp32 CUDA kernel; run on the CPU between device KV buffers it
    # gave logits off by 7.7 (first decode step, H200, 2026-11-29).
    with pytest.raises(ArtifactError, match="fp32 stock graphs do not run correctly on CUDA"):
        _demo("fp32")


def test_fp32_cuda_logits_track_cpu_step_by_step() -> None:
    """fp32 with the loopcast ops, teacher-forced on the CPU's greedy tokens: every GPU decode
    row stays within 1e-3 of the CPU row (token equality would also hinge on near-ties between
    two fp32 kernels)."""
    cpu = load(artifact("demo", draft_depth=1, batch_invariant=True))
    gpu = _demo("fp32", True)
    for prompt in DEMO_PROMPTS[:5]:
        ids = cpu.encode(prompt)
        tokens = cpu.generate(ids, 32, stop_ids=()).tokens
        a, b = cpu.new_generator(), gpu.new_generator()
        a.prefill(ids[:-1])
        b.prefill(ids[:-1])
        for token in [ids[-1], *tokens[:-1]]:
            row_a = a.run(DECODE, a.n, tokens=[token]).logits[0].copy()
            row_b = b.run(DECODE, b.n, tokens=[token]).logits[0]
            diff = float(np.abs(row_a - row_b).max())
            assert diff < 1e-3, (prompt, a.n, diff, float(np.abs(row_a).max()))
            a.commit([token])
            b.commit([token])


def test_stock_graphs_run_eagerly_and_say_why() -> None:
    model = _demo("fp16")
    assert model.loaded.graph_kinds == frozenset()
    assert set(HOT) <= _capturable(model)
    assert set(model.loaded.graph_fallbacks) == _capturable(model)
    assert "total_sequence_length" in model.loaded.graph_fallbacks[DECODE]


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_captured_equals_eager_and_slots_capture_once(dtype: str) -> None:
    captured, eager = _demo(dtype, True), _demo(dtype, True, cuda_graphs=False)
    assert {*HOT, CYCLE, CYCLE_RUN} <= _capturable(captured)
    assert captured.loaded.graph_kinds == _capturable(captured), captured.loaded.graph_fallbacks
    gen = captured.new_generator()  # one generator throughout: its slots must capture once
    for mode in ("none", "prompt-lookup", "self", "pipeline"):
        for prompt in DEMO_PROMPTS[:4]:
            gen.rewind(0)  # generate(..., generator=gen) continues gen's context otherwise
            a = captured.generate(prompt, 64, speculative=mode, generator=gen)
            b = eager.generate(prompt, 64, speculative=mode)
            assert a.tokens == b.tokens, (mode, prompt)
    for kind, slot in gen.graph_slots().items():  # every slot that ran really ran captured
        if kind in {*HOT, CYCLE, CYCLE_RUN} or slot["replays"] or slot["warmups"]:
            assert slot["captures"] == 1 and slot["fallbacks"] == 0 and slot["failure"] is None, (kind, slot)


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_half_precision_tracks_the_fp32_reference(dtype: str) -> None:
    model = _demo(dtype)
    ref = reference("demo")
    for prompt in DEMO_PROMPTS[:3]:
        ids = model.encode(prompt)
        gen = model.new_generator()
        gen.prefill(ids[:-1])
        logits = gen.run(DECODE, gen.n, tokens=[ids[-1]]).logits[0]
        with torch.no_grad():
            expected = ref(torch.tensor([ids])).final_logits[0, -1].numpy()
        assert float(np.abs(logits - expected).max()) < TOLERANCE[dtype]


def test_two_generators_keep_their_own_graphs() -> None:
    model = _demo("fp16", True)
    alone = [model.generate(p, 48).tokens for p in DEMO_PROMPTS[:2]]
    a, b = model.new_generator(), model.new_generator()
    sa = model.stream_ids(DEMO_PROMPTS[0], 48, generator=a)
    sb = model.stream_ids(DEMO_PROMPTS[1], 48, generator=b)
    got_a, got_b = [], []
    for x, y in zip(sa, sb):
        got_a.append(x)
        got_b.append(y)
    assert [got_a, got_b] == alone


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_batch_invariant_rows_and_speculation_are_exact(dtype: str) -> None:
    model = _demo(dtype, batch_invariant=True)
    W = model.loaded.manifest.verify_width
    for prompt in DEMO_PROMPTS[:4]:
        gen, fed, rows = _decoded(model, prompt, W)
        verify = gen.run(VERIFY, gen.n, tokens=fed).logits
        for i in range(W):
            assert np.array_equal(verify[i], rows[i]), (dtype, prompt, i)
    for prompt in DEMO_PROMPTS:
        plain = model.generate(prompt, 96).tokens
        for mode in ("prompt-lookup", "self", "pipeline"):
            assert model.generate(prompt, 96, speculative=mode).tokens == plain, (mode, prompt)
            assert model.generate(prompt, 96, speculative=mode, gate="always").tokens == plain, (mode, prompt)


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_pipeline_cycle_rows_are_decode_rows_bit_for_bit(dtype: str) -> None:
    """A lane's full-depth logits row in a captured cycle equals the decode step's row at that
    position, bit for bit, with the other rows busy (fp16/bf16, loopcast ops)."""
    model = _demo(dtype, batch_invariant=True)
    R = model.config.num_loops
    for prompt in DEMO_PROMPTS[:3]:
        ids = model.encode(prompt)
        fed, rows = decode_rows(model.new_generator(), ids, 2 * R)
        gen = model.new_generator()
        gen.prefill(ids)
        n0 = len(ids)
        # Teacher-forced lanes: the lane for fed[i] enters at cycle i, so at cycle i row R-1
        # holds the lane of fed[i - R + 1], which has run every loop.
        for c in range(len(fed)):
            positions = [n0 + c - r if 0 <= c - r < len(fed) else -1 for r in range(R)]
            gen.run_cycle(fed[c] if c < len(fed) else 0, positions)
            if c >= R - 1:
                got = gen.cycle.logits.pull()[0, R - 1]
                assert np.array_equal(got, rows[c - R + 1]), (dtype, prompt, c)


@pytest.mark.parametrize("dtype,ops", [("fp16", "loopcast"), ("bf16", "loopcast"), ("fp16", "stock")])
def test_one_device_copy_of_the_weights_gives_the_same_bits(dtype: str, ops: str) -> None:
    """Every session reads the one device copy (ort_runtime/loading/shared_weights.py): the decode rows
    (captured graphs) equal those of sessions that each load their own copy, bit for bit."""
    from loopcast.ort_runtime.binding.generator import Generator
    from loopcast.ort_runtime.loading.artifact import open_artifact

    path = artifact("demo", dtype, draft_depth=1, batch_invariant=ops == "loopcast", ops=ops)
    shared = open_artifact(path, "cuda")
    own = open_artifact(path, "cuda", shared_initializers=False)
    assert shared.shared_weights is not None and own.shared_weights is None
    assert shared.shared_weights.device == "cuda"
    prompt = load(path, "cuda").encode(DEMO_PROMPTS[0])
    fed_a, rows_a = decode_rows(Generator(shared), prompt, 24)
    fed_b, rows_b = decode_rows(Generator(own), prompt, 24)
    assert fed_a == fed_b and all(np.array_equal(a, b) for a, b in zip(rows_a, rows_b, strict=True))
    if ops == "loopcast":
        model = load(path, "cuda")
        plain = model.generate(prompt, 32, stop_ids=(), speculative="none").tokens
        assert model.generate(prompt, 32, stop_ids=(), speculative="self", gate="always").tokens == plain


def test_exact_device_allocations_hold_their_bytes() -> None:
    """ort_runtime/loading/device_memory.py: a DLPack value over one cuMemAlloc reads back what was
    uploaded (fp32, fp16, bf16 as raw uint16), and add_initializer accepts it (our buffer)."""
    from loopcast.ort_runtime.loading import device_memory

    assert device_memory.available()
    rng = np.random.default_rng(0)
    for onnx_type, host in (
        (1, rng.standard_normal((3, 5)).astype(np.float32)),
        (10, rng.standard_normal((4, 7)).astype(np.float16)),
        (16, rng.integers(0, 2**16, (2, 9), dtype=np.uint16)),
    ):
        value = device_memory.device_value(host.shape, onnx_type, host)
        assert value.device_name().lower() == "cuda" and value.shape() == list(host.shape)
        mirror = np.zeros_like(host)  # the host array a CPU value views (bf16 as raw uint16)
        back = (
            ort.OrtValue.ortvalue_from_numpy_with_onnx_type(mirror, onnx_type)
            if onnx_type == 16
            else ort.OrtValue.ortvalue_from_numpy(mirror)
        )
        back.update_inplace(value)  # device -> the mirror's memory
        assert np.array_equal(mirror, host)
        ort.SessionOptions().add_initializer("w", value)


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_alternate_suffix_is_exact(dtype: str) -> None:
    """Tree verify on CUDA (fp16/bf16, loopcast ops): branch rows at scratch positions are the
    decode rows of their logical positions bit for bit; forced branches (selected, partial,
    discarded, fork miss) and the model's own near ties return plain greedy's tokens and leave its
    KV, bit for bit (the winning branch's KV moved on the device)."""
    from loopcast.ort_runtime.decoding.exactness import tree_rows_match
    from loopcast.ort_runtime.decoding.speculate import GenerationStats

    from tests.ort_runtime.stream_helpers import engine_stream
    from tests.ort_runtime.test_alternate import Oracle, assert_plain_kv

    model = load(
        artifact("demo", dtype, draft_depth=1, batch_invariant=True, ops="loopcast", tree_verify=True), "cuda"
    )
    W = model.loaded.manifest.verify_width
    for prompt in DEMO_PROMPTS[:3]:
        gen, fed, rows = _decoded(model, prompt, W)
        assert tree_rows_match(gen, fed, rows), (dtype, prompt)
    vocab = model.config.vocab_size
    for prompt in DEMO_PROMPTS[:3]:
        ids = model.encode(prompt)
        gen, reference = model.new_generator(), model.new_generator()
        plain = list(engine_stream(reference, ids, 48))
        for primary, alternate, continuation in (
            (False, True, True),
            (False, True, False),
            (True, False, None),
            (False, False, None),
        ):
            gen.rewind(0)
            stats = GenerationStats()
            proposer = Oracle(ids + plain, vocab, primary, alternate, continuation).proposer()
            got = list(
                engine_stream(
                    gen,
                    ids,
                    48,
                    **dict(mode="self", num_draft_tokens=2, gate="always", proposer=proposer),
                    stats=stats,
                )
            )
            assert got == plain and stats.forks > 0, (dtype, prompt, primary, alternate)
            assert_plain_kv(gen, reference)
        for gap in (0.1, 1.0):
            assert (
                model.generate(prompt, 96, speculative="self", alternate_gap=gap, gate="always").tokens
                == model.generate(prompt, 96).tokens
            ), (dtype, prompt, gap)
