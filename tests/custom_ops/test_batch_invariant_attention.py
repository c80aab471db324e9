"""BatchInvariantAttention (CPU): against a numpy reference and com.microsoft.GroupQueryAttention,
row invariance (an S-row call equals S one-row calls bit for bit), in-place IO binding, and errors."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

from tests.custom_ops.ops_models import attention_feeds, attention_model, reference_attention, session

OP = "BatchInvariantAttention"
CONFIGS = [(4, 4, 16), (4, 2, 32), (8, 2, 16), (2, 1, 64), (6, 3, 16)]  # (Hq, Hkv, D), incl. GQA groups
TOL = {"float32": 1e-5, "float16": 2e-3, "bfloat16": 2e-2}
OUTPUTS = ["output", "present_key", "present_value"]


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("Hq,Hkv,D", CONFIGS)
def test_matches_numpy_reference(library: Path, dtype: str, Hq: int, Hkv: int, D: int) -> None:
    rng = np.random.default_rng(Hq * 100 + D)
    T = 40
    sess = session(attention_model(OP, Hq=Hq, Hkv=Hkv, D=D, T=T, dtype=dtype), library)
    for B, S, n in [(1, 1, 0), (2, 1, 9), (1, 5, 0), (2, 4, 17)]:
        feeds = attention_feeds(rng, B=B, S=S, n=n, Hq=Hq, Hkv=Hkv, D=D, T=T, dtype=dtype)
        got = sess.run(OUTPUTS, feeds)
        want = reference_attention(feeds, Hq=Hq, Hkv=Hkv, D=D, dtype=dtype)
        np.testing.assert_allclose(
            got[0], want[0], rtol=TOL[dtype], atol=TOL[dtype], err_msg=f"{B=} {S=} {n=}"
        )
        np.testing.assert_allclose(got[1], want[1], rtol=TOL[dtype], atol=TOL[dtype])
        assert np.array_equal(got[2], want[2])


def test_scale_and_no_rotary(library: Path) -> None:
    rng = np.random.default_rng(3)
    Hq, Hkv, D, T = 4, 2, 16, 24
    sess = session(
        attention_model(OP, Hq=Hq, Hkv=Hkv, D=D, T=T, dtype="float32", attrs={"do_rotary": 0, "scale": 0.3}),
        library,
    )
    feeds = attention_feeds(rng, B=1, S=3, n=5, Hq=Hq, Hkv=Hkv, D=D, T=T, dtype="float32")
    got = sess.run(OUTPUTS, feeds)
    want = reference_attention(feeds, Hq=Hq, Hkv=Hkv, D=D, dtype="float32", scale=0.3, do_rotary=False)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("Hq,Hkv,D", CONFIGS)
def test_matches_group_query_attention(library: Path, Hq: int, Hkv: int, D: int) -> None:
    rng = np.random.default_rng(7)
    T = 32
    ours = session(attention_model(OP, Hq=Hq, Hkv=Hkv, D=D, T=T, dtype="float32"), library)
    gqa = session(attention_model("GroupQueryAttention", Hq=Hq, Hkv=Hkv, D=D, T=T, dtype="float32"), None)
    for B, S, n in [(1, 1, 0), (1, 1, 12), (2, 1, 7), (1, 6, 0), (1, 4, 9)]:
        feeds = attention_feeds(rng, B=B, S=S, n=n, Hq=Hq, Hkv=Hkv, D=D, T=T, dtype="float32")
        got, want = ours.run(OUTPUTS, feeds), gqa.run(OUTPUTS, feeds)
        np.testing.assert_allclose(got[0], want[0], rtol=1e-5, atol=1e-5, err_msg=f"{B=} {S=} {n=}")
        for g, w in zip(got[1:], want[1:]):  # GQA leaves positions >= n+S of its present unspecified
            np.testing.assert_allclose(g[:, :, : n + S], w[:, :, : n + S], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("Hq,Hkv,D", [(4, 4, 16), (8, 2, 32), (6, 3, 16), (2, 1, 64)])
def test_rows_do_not_depend_on_the_number_of_rows(
    library: Path, dtype: str, Hq: int, Hkv: int, D: int
) -> None:
    rng = np.random.default_rng(11)
    T, n = 48, 9
    sess = session(attention_model(OP, Hq=Hq, Hkv=Hkv, D=D, T=T, dtype=dtype), library)
    for W in (2, 5, 8, 32):
        feeds = attention_feeds(rng, B=2, S=W, n=n, Hq=Hq, Hkv=Hkv, D=D, T=T, dtype=dtype)
        out_w, pk_w, pv_w = sess.run(OUTPUTS, feeds)
        pk, pv, rows = feeds["past_key"].copy(), feeds["past_value"].copy(), []
        for i in range(W):  # W one-row calls, each committing its row before the next
            one = dict(
                feeds,
                query=feeds["query"][:, i : i + 1],
                past_key=pk,
                past_value=pv,
                seqlens_k=np.full((2,), n + i, np.int32),
                total_sequence_length=np.array(n + i + 1, np.int32),
            )
            out, pk, pv = sess.run(OUTPUTS, one)
            rows.append(out)
        assert np.array_equal(out_w, np.concatenate(rows, axis=1)), W
        assert np.array_equal(pk_w, pk) and np.array_equal(pv_w, pv), W


@pytest.mark.parametrize("dtype,np_dtype", [("float32", np.float32), ("float16", np.float16)])
def test_in_place_io_binding_equals_out_of_place(library: Path, dtype: str, np_dtype) -> None:
    rng = np.random.default_rng(5)
    Hq, Hkv, D, T = 8, 2, 16, 40
    sess = session(attention_model(OP, Hq=Hq, Hkv=Hkv, D=D, T=T, dtype=dtype), library)
    feeds = attention_feeds(rng, B=2, S=4, n=11, Hq=Hq, Hkv=Hkv, D=D, T=T, dtype=dtype)
    want = sess.run(OUTPUTS, feeds)
    binding = sess.io_binding()
    cache = {
        name: ort.OrtValue.ortvalue_from_numpy(feeds[name].copy()) for name in ("past_key", "past_value")
    }
    for name, value in feeds.items():
        if name in cache:
            binding.bind_ortvalue_input(name, cache[name])
            binding.bind_ortvalue_output(name.replace("past", "present"), cache[name])
        else:
            binding.bind_cpu_input(name, value)
    out = ort.OrtValue.ortvalue_from_shape_and_type(want[0].shape, np_dtype)
    binding.bind_ortvalue_output("output", out)
    sess.run_with_iobinding(binding)
    assert np.array_equal(out.numpy(), want[0])
    assert np.array_equal(cache["past_key"].numpy(), want[1])
    assert np.array_equal(cache["past_value"].numpy(), want[2])


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"attrs": {"rotary_interleaved": 1}}, "rotary_interleaved=1 is not supported"),
        ({"attrs": {"num_heads": 3}}, "multiple of kv_num_heads"),
    ],
)
def test_bad_attributes_are_rejected(library: Path, kwargs, message: str) -> None:
    with pytest.raises(Exception, match=message):
        session(attention_model(OP, Hq=4, Hkv=2, D=16, T=8, dtype="float32", **kwargs), library)


def test_bad_inputs_are_rejected(library: Path) -> None:
    rng = np.random.default_rng(0)
    feeds = attention_feeds(rng, B=1, S=2, n=3, Hq=4, Hkv=2, D=16, T=8, dtype="float32")
    keyed = session(attention_model(OP, Hq=4, Hkv=2, D=16, T=8, dtype="float32", with_key=True), library)
    with pytest.raises(Exception, match="key/value inputs must be absent"):
        keyed.run(OUTPUTS, dict(feeds, key=np.zeros((1, 2, 32), np.float32)))
    mismatch = session(attention_model(OP, Hq=4, Hkv=2, D=16, T=8, dtype="float32", past_D=32), library)
    with pytest.raises(
        Exception, match=r"past_key must be \[B, kv_num_heads, T, head_dim\].*head_dim mismatch"
    ):
        mismatch.run(
            OUTPUTS,
            dict(
                feeds,
                past_key=np.zeros((1, 2, 8, 32), np.float32),
                past_value=np.zeros((1, 2, 8, 32), np.float32),
            ),
        )
    plain = session(attention_model(OP, Hq=4, Hkv=2, D=16, T=8, dtype="float32"), library)
    with pytest.raises(Exception, match="outside the cache"):
        plain.run(OUTPUTS, dict(feeds, seqlens_k=np.array([8], np.int32)))
