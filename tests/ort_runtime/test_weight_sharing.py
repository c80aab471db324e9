"""Fewer copies of the weights on the CPU: decode runs on prefill's session (one prepacked copy
fewer) with bit-identical rows; ``share_weights=True`` (no prepacking) is declared inexact
where the stock MatMul's one-row path differs from its multi-row path."""

from __future__ import annotations

import numpy as np
import pytest

from loopcast.errors import RequestError
from loopcast.manifest import DECODE, PREFILL, VERIFY
from loopcast.ort_runtime import load
from loopcast.ort_runtime.artifact import open_artifact
from loopcast.ort_runtime.exactness import decode_rows
from loopcast.ort_runtime.generator import Generator
from tests.artifacts import artifact, require_exact_cpu_artifacts


def _decode_logits(model, prompt: list[int], steps: int) -> list[np.ndarray]:
    """Feed the prompt one token at a time through decode, then decode greedily: every row."""
    gen, rows, token = Generator(model), [], prompt[0]
    for i in range(len(prompt) + steps):
        out = gen.run(DECODE, gen.n, tokens=[token])
        rows.append(out.logits[0].copy())
        gen.commit([token])
        token = prompt[i + 1] if i + 1 < len(prompt) else int(out.next_ids[0])
    return rows


@pytest.mark.parametrize("name,kw", [("demo", {}), ("llama-untied", {}), ("ouro-r3", {"ops": "stock"}),
                                     ("ouro-r2-gqa", {"draft_depth": 1})])
def test_decode_on_prefill_session_is_bit_identical(name, kw) -> None:
    path = artifact(name, **kw)
    shared = open_artifact(path, "cpu")
    own = open_artifact(path, "cpu", kinds=(DECODE, VERIFY))   # no prefill: decode gets its own session
    assert shared.shared_sessions == {DECODE: PREFILL}
    assert shared.sessions[DECODE] is shared.sessions[PREFILL]
    assert len({id(s) for s in shared.sessions.values()}) == len(shared.sessions) - 1
    assert own.shared_sessions == {} and own.sessions[DECODE] is not own.sessions[VERIFY]
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    for a, b in zip(_decode_logits(shared, prompt, 12), _decode_logits(own, prompt, 12), strict=True):
        assert np.array_equal(a, b)


def test_generation_unchanged_by_shared_decode() -> None:
    """Plain greedy through the public API equals a run on the decode graph's own session."""
    path = artifact("demo")
    model = open_artifact(path, "cpu", kinds=(DECODE, VERIFY))
    rows = _decode_logits(model, [5, 6, 7], 16)
    greedy = [int(np.argmax(r)) for r in rows[2:]]
    tokens = load(path).generate([5, 6, 7], 16, stop_ids=(), speculative="none").tokens
    assert tokens == greedy[:16]


def test_cuda_keeps_one_session_per_kind() -> None:
    """The sharing is a CPU decision: CUDA captures decode as a graph of its own."""
    from loopcast.ort_runtime.artifact import _cpu_shared_sessions
    from loopcast.manifest import Manifest

    manifest = Manifest.read(artifact("demo"))
    assert _cpu_shared_sessions(manifest, list(manifest.graphs)) == {DECODE: PREFILL}
    assert _cpu_shared_sessions(manifest, [DECODE, VERIFY]) == {}


def test_share_weights_declares_stock_matmul_inexact_on_cpu() -> None:
    """Without prepacking MLAS runs M=1 on its GEMV kernel and M=W on GEMM: measured here, the
    rows differ, so speculation is refused unless allowed, and tokens stay plain greedy."""
    require_exact_cpu_artifacts()
    path = artifact("demo")
    plain = load(path)
    shared = load(path, share_weights=True)
    assert plain.loaded.exact_verify and not shared.loaded.exact_verify
    gen = Generator(shared.loaded)
    fed, rows = decode_rows(gen, [5, 6, 7, 8], 5)
    gen.rewind(4)
    out = gen.run(VERIFY, gen.n, tokens=fed)
    assert not all(np.array_equal(out.logits[i], rows[i]) for i in range(5))  # the reason for the declaration
    with pytest.raises(RequestError, match="not exact"):
        shared.generate([5, 6, 7, 5, 6, 7], 8, speculative="prompt-lookup", gate="none")
    assert (shared.generate([5, 6, 7], 12, stop_ids=(), speculative="none").tokens
            == plain.generate([5, 6, 7], 12, stop_ids=(), speculative="none").tokens)


def test_share_weights_keeps_loopcast_matmul_exact() -> None:
    """The loopcast MatMul never prepacks: its artifacts stay exact with share_weights."""
    require_exact_cpu_artifacts()
    shared = load(artifact("ouro-r3", batch_invariant=True), share_weights=True)
    assert shared.loaded.exact_verify
