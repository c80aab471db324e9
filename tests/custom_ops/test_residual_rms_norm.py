"""ResidualRMSNorm (CPU): against the torch reference RMSNorm with the same roundings for every
combination of optional weights, against the stock-op chain it replaces (RMSNormalization-23 +
Add), row invariance, the forms a node can take (trailing inputs left off or "", one output or
two), and errors that name the problem."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import onnx
import pytest

from tests.custom_ops.fused_reference import assert_close, residual_rms_norm, to_torch
from tests.custom_ops.ops_models import (
    NORM_WEIGHTS,
    as_dtype,
    residual_norm_model,
    session,
    stock_residual_norm_model,
)

DTYPES = ["float32", "float16", "bfloat16"]
COMBOS = [tuple(w for w, on in zip(NORM_WEIGHTS, mask) if on) for mask in itertools.product((0, 1), repeat=3)]


def _feeds(
    rng: np.random.Generator,
    lead: tuple[int, int],
    H: int,
    dtype: str,
    weights: tuple[str, ...] = NORM_WEIGHTS,
) -> dict[str, np.ndarray]:
    """Branch, residual (a larger running stream) and weights spread around 1, as trained ones are."""
    feeds = {
        "branch": as_dtype(rng.standard_normal((*lead, H)), dtype),
        "residual": as_dtype(2 * rng.standard_normal((*lead, H)), dtype),
    }
    feeds.update({w: as_dtype(1 + 0.5 * rng.standard_normal(H), dtype) for w in weights})
    return feeds


def _reference(feeds: dict[str, np.ndarray], dtype: str, eps: float = 1e-6) -> list:
    t = {k: to_torch(v, dtype) for k, v in feeds.items()}
    s, normed = residual_rms_norm(t.pop("branch"), t.pop("residual"), t, eps)
    return [s] if normed is None else [s, normed]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("weights", COMBOS, ids=lambda w: "+".join(w) or "none")
def test_matches_torch_reference(library: Path, dtype: str, weights: tuple[str, ...]) -> None:
    rng = np.random.default_rng(len(weights) * 10 + DTYPES.index(dtype))
    for H in (7, 64, 384, 2048):
        sess = session(residual_norm_model(H, dtype, weights), library)
        feeds = _feeds(rng, (3, 5), H, dtype, weights)
        got = sess.run(None, feeds)
        want = _reference(feeds, dtype)
        assert len(got) == len(want)
        for g, w in zip(got, want):
            assert_close(to_torch(g, dtype), w, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_epsilon_attribute(library: Path, dtype: str) -> None:
    """A large epsilon changes the result measurably, so a kernel ignoring it fails."""
    rng = np.random.default_rng(4)
    feeds = _feeds(rng, (1, 3), 32, dtype)
    feeds["branch"] = as_dtype(0.05 * feeds["branch"].astype(np.float32), dtype)
    got = session(residual_norm_model(32, dtype, epsilon=0.01), library).run(None, feeds)
    for g, w in zip(got, _reference(feeds, dtype, eps=0.01)):
        assert_close(to_torch(g, dtype), w, dtype)


@pytest.mark.parametrize("dtype", ["float32", "float16"])  # ORT's CPU RMSNormalization has no bf16
@pytest.mark.parametrize(
    "weights", [NORM_WEIGHTS, ("branch_weight", "out_weight"), ("loop_weight",)], ids=lambda w: "+".join(w)
)
def test_matches_the_stock_op_chain(library: Path, dtype: str, weights: tuple[str, ...]) -> None:
    rng = np.random.default_rng(5)
    H = 384
    fused = session(residual_norm_model(H, dtype, weights, epsilon=1e-5), library)
    stock = session(stock_residual_norm_model(H, dtype, weights, epsilon=1e-5), None)
    for lead in [(1, 1), (2, 7)]:
        feeds = _feeds(rng, lead, H, dtype, weights)
        for g, w in zip(fused.run(None, feeds), stock.run(None, feeds)):
            # ORT's fp16 RMSNormalization rounds once, not twice: close, but many bits differ
            assert_close(to_torch(g, dtype), to_torch(w, dtype), dtype, max_fraction=1.0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("weights", COMBOS, ids=lambda w: "+".join(w) or "none")
def test_rows_do_not_depend_on_the_number_of_rows(
    library: Path, dtype: str, weights: tuple[str, ...]
) -> None:
    rng = np.random.default_rng(6)
    for H in (7, 2048, 8192):
        sess = session(residual_norm_model(H, dtype, weights), library)
        feeds = _feeds(rng, (1, 7), H, dtype, weights)
        many = sess.run(None, feeds)
        for i in range(7):
            row = {k: feeds[k][:, i : i + 1] for k in ("branch", "residual")}
            one = sess.run(None, dict(feeds, **row))
            for a, b in zip(many, one):
                assert np.array_equal(a[:, i : i + 1], b), (H, i)


def test_node_forms(library: Path) -> None:
    """Trailing optional inputs left off or given as "", a skipped middle input, and output 1
    declared as "" all mean absent."""
    rng = np.random.default_rng(7)
    H = 16
    feeds = _feeds(rng, (2, 3), H, "float32")
    for weights in [(), ("loop_weight",), ("branch_weight",), ("branch_weight", "out_weight")]:
        want = session(residual_norm_model(H, "float32", weights), library).run(
            None, {k: v for k, v in feeds.items() if k in ("branch", "residual", *weights)}
        )
        got = session(residual_norm_model(H, "float32", weights, trim=False), library).run(
            None, {k: v for k, v in feeds.items() if k in ("branch", "residual", *weights)}
        )
        assert len(got) == len(want) == (2 if "out_weight" in weights else 1)
        assert all(np.array_equal(a, b) for a, b in zip(got, want)), weights
    model = onnx.load_from_string(residual_norm_model(H, "float32", ("loop_weight",), normed=True))
    model.graph.node[0].output[1] = ""  # ["sum", ""]
    del model.graph.output[1]
    got = session(model.SerializeToString(), library).run(
        None, {k: feeds[k] for k in ("branch", "residual", "loop_weight")}
    )
    want = _reference({k: feeds[k] for k in ("branch", "residual", "loop_weight")}, "float32")
    assert_close(to_torch(got[0], "float32"), want[0], "float32")


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_without_residual_it_norms_like_the_fused_form(library: Path, dtype: str) -> None:
    """No residual: sum is the branch itself and normed is norm(branch, out_weight) with the same
    bits the fused form gives for the same sum. A graph that starts from a hidden state (the
    verify_tail) opens its stack this way and must reproduce the full graph's rows exactly."""
    rng = np.random.default_rng(11)
    H = 384
    feeds = _feeds(rng, (1, 5), H, dtype)
    fused = session(residual_norm_model(H, dtype, ("branch_weight", "loop_weight", "out_weight")), library)
    s, h = fused.run(
        None, {k: feeds[k] for k in ("branch", "residual", "branch_weight", "loop_weight", "out_weight")}
    )
    plain = session(residual_norm_model(H, dtype, ("out_weight",), residual=False), library)
    s2, h2 = plain.run(None, {"branch": s, "out_weight": feeds["out_weight"]})
    assert np.array_equal(s2, s) and np.array_equal(h2, h)


def _run(library: Path, model: bytes, feeds: dict[str, np.ndarray]) -> None:
    session(model, library).run(None, feeds)


def test_errors_name_the_problem(library: Path) -> None:
    x = np.zeros((1, 2, 16), np.float32)
    w = np.ones(16, np.float32)
    with pytest.raises(
        Exception,
        match=r"ResidualRMSNorm: loop_weight must be \[H\] = \[16\] for branch \[1, 2, 16\], "
        r"got \[8\]",
    ):
        _run(
            library,
            residual_norm_model("H", "float32", ("loop_weight",), weight_shape=["W"]),
            {"branch": x, "residual": x, "loop_weight": np.ones(8, np.float32)},
        )
    with pytest.raises(
        Exception, match=r"ResidualRMSNorm: out_weight must be \[H\] = \[16\] .*got \[1, 16\]"
    ):
        _run(
            library,
            residual_norm_model("H", "float32", ("out_weight",), weight_shape=[1, "H"]),
            {"branch": x, "residual": x, "out_weight": w[None]},
        )
    with pytest.raises(
        Exception,
        match=r"ResidualRMSNorm: branch \[1, 2, 16\] and residual \[1, 3, 16\] must have "
        r"the same shape",
    ):
        _run(
            library,
            residual_norm_model("H", "float32", ()),
            {"branch": x, "residual": np.zeros((1, 3, 16), np.float32)},
        )
    with pytest.raises(
        Exception,
        match=r"ResidualRMSNorm: output 1 \(normed\) is requested but input 4 \(out_weight\) "
        r"is absent",
    ):
        _run(
            library,
            residual_norm_model("H", "float32", ("loop_weight",), normed=True),
            {"branch": x, "residual": x, "loop_weight": w},
        )
    with pytest.raises(
        Exception,
        match=r"ResidualRMSNorm: input 4 \(out_weight\) is given but output 1 \(normed\) is "
        r"absent",
    ):
        _run(
            library,
            residual_norm_model("H", "float32", ("out_weight",), normed=False),
            {"branch": x, "residual": x, "out_weight": w},
        )
