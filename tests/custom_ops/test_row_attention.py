"""RowAttention (CPU): per-row (buffer, sequence, position) addressing. Each row equals the
one-row BatchInvariantAttention call at its position bit for bit (the pipeline's exactness rests
on it), inactive rows (-1) write nothing, the optional per-row sequence index (batching) and
masked key range (tree verify) follow a numpy reference, and bad addresses are refused."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from onnx import TensorProto, helper

from tests.custom_ops.ops_models import (
    OPSETS,
    as_dtype,
    attention_model,
    rotary_tables,
    session,
)

Hq, Hkv, D, T = 4, 2, 16, 24


def row_model(
    row_buffers: list[int],
    pairs: int,
    *,
    dtype: str = "float32",
    Bseq: int = 1,
    sequences: bool = False,
    masked: bool = False,
) -> bytes:
    t = {"float32": TensorProto.FLOAT, "float16": TensorProto.FLOAT16}[dtype]
    S = len(row_buffers)
    kv = [n for k in range(pairs) for n in (f"key_{k}", f"value_{k}")]
    inputs = [
        "query",
        "positions",
        "sequences" if sequences else "",
        "masked" if masked else "",
        "cos",
        "sin",
        *kv,
    ]
    node = helper.make_node(
        "RowAttention",
        inputs,
        ["output", *[f"present_{n}" for n in kv]],
        domain="loopcast",
        num_heads=Hq,
        kv_num_heads=Hkv,
        do_rotary=1,
        row_buffers=row_buffers,
    )
    vi = helper.make_tensor_value_info
    ins = [
        vi("query", t, [1, S, (Hq + 2 * Hkv) * D]),
        vi("positions", TensorProto.INT32, [S]),
        vi("cos", t, [T, D // 2]),
        vi("sin", t, [T, D // 2]),
    ]
    ins += [vi(n, t, [Bseq, Hkv, T, D]) for n in kv]
    if sequences:
        ins.append(vi("sequences", TensorProto.INT32, [S]))
    if masked:
        ins.append(vi("masked", TensorProto.INT32, [S, 2]))
    outs = [vi("output", t, [1, S, Hq * D])] + [vi(f"present_{n}", t, [Bseq, Hkv, T, D]) for n in kv]
    graph = helper.make_graph([node], "g", ins, outs)
    return helper.make_model(graph, ir_version=10, opset_imports=OPSETS).SerializeToString()


def feeds(rng, S: int, pairs: int, positions: list[int], dtype: str = "float32", Bseq: int = 1) -> dict:
    cos, sin = rotary_tables(T, D, dtype)
    out = {
        "query": as_dtype(rng.standard_normal((1, S, (Hq + 2 * Hkv) * D)), dtype),
        "positions": np.asarray(positions, np.int32),
        "cos": cos,
        "sin": sin,
    }
    for k in range(pairs):
        out[f"key_{k}"] = as_dtype(rng.standard_normal((Bseq, Hkv, T, D)), dtype)
        out[f"value_{k}"] = as_dtype(rng.standard_normal((Bseq, Hkv, T, D)), dtype)
    return out


def one_row(sess_bia, f: dict, i: int, pair: int, seq: int = 0) -> tuple[np.ndarray, ...]:
    """Row i as a one-row BatchInvariantAttention call on its own buffer pair."""
    p = int(f["positions"][i])
    single = {
        "query": f["query"][:, i : i + 1],
        "past_key": f[f"key_{pair}"][seq : seq + 1],
        "past_value": f[f"value_{pair}"][seq : seq + 1],
        "seqlens_k": np.array([p], np.int32),
        "total_sequence_length": np.array(p + 1, np.int32),
        "cos_cache": f["cos"],
        "sin_cache": f["sin"],
    }
    return tuple(sess_bia.run(["output", "present_key", "present_value"], single))


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("head_dim", [16, 32, 64, 128])
def test_each_row_is_the_one_row_call_bit_for_bit(
    library: Path, monkeypatch: pytest.MonkeyPatch, dtype: str, head_dim: int
) -> None:
    """Every head size: BatchInvariantAttention's weighted sum keeps its accumulators in
    registers at 32, 64 and 128 (RowAttention's runs key by key), the same bits."""
    monkeypatch.setitem(globals(), "D", head_dim)  # the module's helpers read D at call time
    rng = np.random.default_rng(1)
    # The pipeline's shape: row r at depth r on its own buffer pair, positions one apart.
    sess = session(row_model([0, 1, 2, 3], 4, dtype=dtype), library)
    bia = session(attention_model("BatchInvariantAttention", Hq=Hq, Hkv=Hkv, D=D, T=T, dtype=dtype), library)
    for positions in ([9, 8, 7, 6], [0, -1, -1, -1], [17, 16, -1, 14]):
        f = feeds(rng, 4, 4, positions, dtype)
        names = ["output"] + [f"present_{n}" for k in range(4) for n in (f"key_{k}", f"value_{k}")]
        got = dict(zip(names, sess.run(names, f)))
        for i, p in enumerate(positions):
            if p < 0:
                assert not got["output"][0, i].any(), "an inactive row outputs zeros"
                assert np.array_equal(got[f"present_key_{i}"], f[f"key_{i}"]), (
                    "an inactive row writes nothing"
                )
                continue
            out, pk, pv = one_row(bia, f, i, i)
            assert np.array_equal(got["output"][0, i], out[0, 0]), (positions, i)
            assert np.array_equal(got[f"present_key_{i}"], pk) and np.array_equal(
                got[f"present_value_{i}"], pv
            )


def test_row_independent_of_the_other_rows(library: Path) -> None:
    rng = np.random.default_rng(2)
    sess = session(row_model([0, 1, 2], 3), library)
    f = feeds(rng, 3, 3, [12, 11, 10])
    base = sess.run(["output"], f)[0]
    for other in ([12, -1, -1], [12, 3, 20]):
        g = dict(f, positions=np.asarray(other, np.int32))
        g["query"] = f["query"].copy()
        g["query"][0, 1:] = rng.standard_normal(g["query"][0, 1:].shape).astype(np.float32)
        assert np.array_equal(sess.run(["output"], g)[0][0, 0], base[0, 0])


def test_rows_sharing_a_buffer_see_earlier_rows(library: Path) -> None:
    """Verify-style rows in one pair: the same result as BatchInvariantAttention's S-row call."""
    rng = np.random.default_rng(3)
    sess = session(row_model([0, 0, 0], 1), library)
    f = feeds(rng, 3, 1, [5, 6, 7])
    got = sess.run(["output", "present_key_0"], f)
    bia = session(
        attention_model("BatchInvariantAttention", Hq=Hq, Hkv=Hkv, D=D, T=T, dtype="float32"), library
    )
    want = bia.run(
        ["output", "present_key"],
        {
            "query": f["query"],
            "past_key": f["key_0"],
            "past_value": f["value_0"],
            "seqlens_k": np.array([7], np.int32),
            "total_sequence_length": np.array(8, np.int32),
            "cos_cache": f["cos"],
            "sin_cache": f["sin"],
        },
    )
    assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1])


def _rotate(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, p: int) -> np.ndarray:
    x1, x2 = x[..., : D // 2], x[..., D // 2 :]
    return np.concatenate([x1 * cos[p] - x2 * sin[p], x2 * cos[p] + x1 * sin[p]], -1)


def test_sequence_index_and_masked_keys_follow_the_reference(library: Path) -> None:
    """The addressing batching and tree verify build on: rows of different sequences of one
    buffer pair, and a row that skips a key range, which also leaves the row's sequence (its
    rotary position is its cache position less the masked keys below it)."""
    rng = np.random.default_rng(4)
    sess = session(row_model([0, 0, 0], 1, Bseq=3, sequences=True, masked=True), library)
    f = feeds(rng, 3, 1, [4, 9, 7], Bseq=3)
    f["sequences"] = np.array([2, 0, 2], np.int32)
    f["masked"] = np.array([[0, 0], [2, 5], [5, 7]], np.int32)  # row 2 (pos 7) skips keys 5, 6
    rotary = [4, 9 - 3, 7 - 2]
    got = sess.run(["output", "present_key_0"], f)
    cos, sin = f["cos"], f["sin"]
    keys, values = f["key_0"].copy(), f["value_0"].copy()
    for i in range(3):  # writes first, as the op does
        p, sq = int(f["positions"][i]), int(f["sequences"][i])
        row = f["query"][0, i].reshape(Hq + 2 * Hkv, D)
        keys[sq, :, p] = _rotate(row[Hq : Hq + Hkv], cos, sin, rotary[i])
        values[sq, :, p] = row[Hq + Hkv :]
    np.testing.assert_allclose(got[1], keys, rtol=1e-6, atol=1e-6)
    scale = 1 / np.sqrt(D)
    for i in range(3):
        p, sq = int(f["positions"][i]), int(f["sequences"][i])
        lo, hi = f["masked"][i]
        q = _rotate(f["query"][0, i].reshape(Hq + 2 * Hkv, D)[:Hq], cos, sin, rotary[i])
        vis = [j for j in range(p + 1) if not lo <= j < hi]
        for h in range(Hq):
            k = keys[sq, h // (Hq // Hkv), vis]
            s = k @ q[h] * scale
            w = np.exp(s - s.max())
            want = (w / w.sum()) @ values[sq, h // (Hq // Hkv), vis]
            np.testing.assert_allclose(got[0][0, i, h * D : (h + 1) * D], want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("lo,hi", [(6, 9), (13, 17)])
def test_branch_rows_past_a_masked_range_are_the_decode_rows_bit_for_bit(
    library: Path, dtype: str, lo: int, hi: int
) -> None:
    """Tree verify's exactness: branch rows written at scratch positions past another branch,
    with that branch masked, equal the rows of a call on the compacted cache (the other
    branch's keys removed) at their logical positions, outputs and stored K/V bit for bit.
    The masked rows score their keys in two runs (below lo, from hi) and the compacted ones in
    one, so a key falls in blocks of 8, 4 or 1 keys in one and another block in the other."""
    rng = np.random.default_rng(8)
    m = 3  # stem 0..lo-1, other branch lo..hi-1, this branch at hi..hi+2
    sess = session(row_model([0] * m, 1, dtype=dtype, masked=True), library)
    bia = session(attention_model("BatchInvariantAttention", Hq=Hq, Hkv=Hkv, D=D, T=T, dtype=dtype), library)
    f = feeds(rng, m, 1, list(range(hi, hi + m)), dtype)
    f["masked"] = np.array([[lo, hi]] * m, np.int32)
    out, pk, pv = sess.run(["output", "present_key_0", "present_value_0"], f)
    compact_k = np.concatenate([f["key_0"][:, :, :lo], f["key_0"][:, :, hi:], f["key_0"][:, :, : hi - lo]], 2)
    compact_v = np.concatenate(
        [f["value_0"][:, :, :lo], f["value_0"][:, :, hi:], f["value_0"][:, :, : hi - lo]], 2
    )
    want, wk, wv = bia.run(
        ["output", "present_key", "present_value"],
        {
            "query": f["query"],
            "past_key": compact_k,
            "past_value": compact_v,
            "seqlens_k": np.array([lo + m - 1], np.int32),
            "total_sequence_length": np.array(lo + m, np.int32),
            "cos_cache": f["cos"],
            "sin_cache": f["sin"],
        },
    )
    assert np.array_equal(out, want)
    assert np.array_equal(pk[:, :, hi : hi + m], wk[:, :, lo : lo + m])
    assert np.array_equal(pv[:, :, hi : hi + m], wv[:, :, lo : lo + m])
    assert np.array_equal(pk[:, :, :hi], f["key_0"][:, :, :hi]), (
        "the stem and the other branch are not written"
    )


@pytest.mark.parametrize(
    "positions,match",
    [
        ([3, 3], "share the KV address"),
        ([30, 1], "outside the cache"),
        ([-2, 1], "outside the cache"),
    ],
)
def test_bad_addresses_are_refused_and_write_nothing(library: Path, positions, match) -> None:
    rng = np.random.default_rng(5)
    sess = session(row_model([0, 0], 1), library)
    f = feeds(rng, 2, 1, positions)
    with pytest.raises(Exception, match=match):
        sess.run(["output"], f)


def test_masked_range_must_leave_the_row_visible(library: Path) -> None:
    rng = np.random.default_rng(6)
    sess = session(row_model([0], 1, masked=True), library)
    f = feeds(rng, 1, 1, [6])
    f["masked"] = np.array([[4, 8]], np.int32)
    with pytest.raises(Exception, match="own position"):
        sess.run(["output"], f)


def test_a_pair_no_row_names_is_refused(library: Path) -> None:
    with pytest.raises(Exception, match="named by no row"):
        sess = session(row_model([0, 0], 2), library)
        sess.run(["output"], feeds(np.random.default_rng(7), 2, 2, [1, 2]))


def test_kv_in_place_writes_the_input_buffers(library: Path) -> None:
    """kv_in_place=1 (the cycle run): the same outputs, K/V written into the bound input buffers
    themselves, the present outputs left empty."""
    import onnxruntime as ort
    from onnx import load_model_from_string

    rng = np.random.default_rng(7)
    f = feeds(rng, 3, 3, [9, -1, 4])
    plain = session(row_model([0, 1, 2], 3), library)
    names = ["output"] + [f"present_{n}" for k in range(3) for n in (f"key_{k}", f"value_{k}")]
    want = dict(zip(names, plain.run(names, f)))
    model = load_model_from_string(row_model([0, 1, 2], 3))
    model.graph.node[0].attribute.append(helper.make_attribute("kv_in_place", 1))
    sess = session(model.SerializeToString(), library)
    bound = {k: v.copy() for k, v in f.items()}
    binding = sess.io_binding()
    for name, array in bound.items():
        binding.bind_ortvalue_input(name, ort.OrtValue.ortvalue_from_numpy(array))
    for name in names:
        binding.bind_output(name)
    sess.run_with_iobinding(binding)
    got = dict(zip(names, binding.copy_outputs_to_cpu()))
    assert np.array_equal(got["output"], want["output"])
    for k in range(3):
        for kv in ("key", "value"):
            assert got[f"present_{kv}_{k}"].size == 0
            assert np.array_equal(bound[f"{kv}_{k}"], want[f"present_{kv}_{k}"]), (kv, k)
