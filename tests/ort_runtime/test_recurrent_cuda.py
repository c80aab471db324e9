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


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_last_exited_copies_the_exit_steps_kv_on_the_device(checkpoint, dtype):
    """kv_policy last-exited on CUDA: the skipped core steps' slots at the call's positions hold
    the exit step's K/V bit for bit (the op library's device copy), the other positions are
    untouched, and decoding goes on from there."""
    ckpt, root = checkpoint
    out = root / f"art-{dtype}-attention"  # the device copy is the op library's: not in stock artifacts
    if not out.exists():
        export_checkpoint(ckpt, out, ExportOptions(dtype=dtype, max_length=48, ops="loopcast-attention"))
    cfg = PRESETS["tiny-huginn"]
    g = RecurrentGenerator(open_artifact(out, "cuda"), loops=8, state_seed=7)
    g.step(PROMPT)  # every step's slots at positions 0..3
    first = g.step([5], kl_exit=KLExit(1e9, kv_policy="last-exited"))  # exits after step 1
    assert first.exit_loops == 1
    n = len(PROMPT)
    for l in range(cfg.num_layers):
        exit_kv = [b.pull().copy() for b in g.kv[cfg.core_slot(0, l)]]
        for k in range(1, 8):
            for src, buf in zip(exit_kv, g.kv[cfg.core_slot(k, l)]):
                got = buf.pull()
                assert np.array_equal(got[:, :, n], src[:, :, n]), (l, k)
                assert not np.array_equal(got[:, :, :n], src[:, :, :n])  # the prompt's own steps
                assert not got[:, :, n + 1 :].any()  # nothing past the call
    nxt = g.step([int(first.next_ids[-1])], kl_exit=KLExit(0.3, kv_policy="last-exited"))
    assert 1 <= nxt.exit_loops <= 8 and g.n == n + 2
    with pytest.raises(RequestError, match="kv_policy 'full'"):
        g.verify([1, 2], kl_exit=KLExit(0.3, kv_policy="last-exited"))


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


@pytest.fixture(scope="module")
def invariant(checkpoint):
    """The row-invariant op set's artifacts (--ops loopcast), one per half dtype."""
    ckpt, root = checkpoint
    out = {}
    for dtype in ("fp16", "bf16"):
        out[dtype] = root / f"art-{dtype}-loopcast"
        if not out[dtype].exists():
            export_checkpoint(ckpt, out[dtype], ExportOptions(dtype=dtype, max_length=48, ops="loopcast"))
    return out


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("loops", [4, 32])
def test_row_invariant_rows_are_decode_rows_on_cuda(invariant, dtype, loops):
    """--ops loopcast on CUDA: verify rows and the pipeline's cycle rows are the one-row decode
    rows bit for bit, and the pipeline (oracle drafts, with and without rejections), prompt
    lookup and self-speculation give plain decoding's tokens."""
    from tests.ort_runtime.test_recurrent_pipeline import Oracle, check_cycles, plain, run

    loaded = open_artifact(invariant[dtype], "cuda")
    assert loaded.exact_verify and loaded.manifest.exact_verify["cuda"]
    gen = RecurrentGenerator(loaded, loops=loops, state_seed=7)
    first = gen.step(PROMPT)
    fed, rows = [int(first.next_ids[-1])], []
    for _ in range(6):
        out = gen.step([fed[-1]])
        rows.append(out.logits[-1])
        fed.append(int(out.next_ids[-1]))
    gen.rewind(len(PROMPT))
    verified = gen.verify(fed[:6])
    for i, row in enumerate(rows):
        assert np.array_equal(verified.logits[i], row), f"{dtype} r = {loops}: verify row {i}"

    want, logits, n_left = plain(gen, PROMPT, 16, loops, state_seed=7)
    sequence = PROMPT + want
    for spoil in ((), range(0, 99, 3)):
        got, stats, n_got = run(
            gen,
            PROMPT,
            16,
            loops=loops,
            state_seed=7,
            speculative="pipeline",
            gate="always",
            proposer=Oracle(sequence, spoil),
            trace=True,
        )
        assert got == want and n_got == n_left and stats.exact_greedy
        assert check_cycles(stats.pipeline_trace, sequence, logits, len(PROMPT), loops) == len(want) - 1
    for mode, extra in (("prompt-lookup", {}), ("self", {"draft_loops": max(1, loops // 4)})):
        got, stats, _ = run(gen, PROMPT, 16, loops=loops, state_seed=7, speculative=mode, **extra)
        assert got == want and stats.exact_greedy, mode


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_pipeline_with_the_kl_exit_on_cuda(invariant, dtype):
    """The pipeline under the KL exit on the device: the lanes' states come back from the carried
    buffer for the leaving lane's coda checks; tokens, exits and every KV slot below n equal
    plain decoding's (tests/ort_runtime/test_recurrent_pipeline.py's check)."""
    from tests.ort_runtime.test_recurrent_pipeline import check_kl_pipeline

    gen = RecurrentGenerator(open_artifact(invariant[dtype], "cuda"))
    check_kl_pipeline(gen, dict(loops=32, kl_threshold=0.3, state_seed=7), range(0, 99, 3))


@pytest.fixture(scope="module", params=["fp16", "bf16"])
def batched(checkpoint, request):
    """The row-invariant op set's artifact with the batched kinds (--ops loopcast --max-batch 4)."""
    from loopcast.ort_runtime.api import load

    ckpt, root = checkpoint
    out = root / f"art-{request.param}-loopcast-batch4"
    if not out.exists():
        options = ExportOptions(dtype=request.param, max_length=48, ops="loopcast", max_batch=4)
        export_checkpoint(ckpt, out, options)
    return load(out, "cuda")


def test_batched_rows_are_one_sequence_rows_on_cuda(batched):
    """--ops loopcast with --max-batch on CUDA: every row of prelude_batch → core_step_batch (mixed
    depths, seeds, a free slot, a prompt prefilled in chunks) → coda_batch is its request's
    one-sequence step bit for bit."""
    from tests.ort_runtime.test_recurrent_batch import check_batched_rows, check_kl_verify_rows

    check_batched_rows(batched.loaded)
    check_kl_verify_rows(batched.loaded)  # KL-exit verify rows (not yet run on a GPU)


def test_batched_engine_gives_each_request_its_tokens_alone_on_cuda(batched):
    """The batching engine over the recurrent slots on CUDA. The references run first: a second
    thread's CUDA generation beside the engine thread's would share the attention kernel's
    process-wide scratch (custom_ops/src/attention_cuda.cu), which forbids concurrent launches."""
    from loopcast.ort_runtime.batching.engine import BatchingEngine, BatchRequest
    from loopcast.ort_runtime.binding.recurrent_batch_generator import RecurrentBatchGenerator

    model = batched
    cases = [([3, 17, 42, 8], 4, None), ([5, 6, 7], 32, 7), ([9, 9], 1, 2), ([1, 2], 8, None), ([4], 2, 3)]
    want = [model.generate(p, 10, loops=r, state_seed=s, stop_ids=()).tokens for p, r, s in cases]
    engine = BatchingEngine(RecurrentBatchGenerator(model.loaded)).start()
    try:
        done = [
            engine.submit(BatchRequest(p, 10, config=model.generation_config(None, loops=r, state_seed=s)))
            for p, r, s in cases
        ]
        assert [completion.result(timeout=120) for completion in done] == want
    finally:
        engine.shutdown()
