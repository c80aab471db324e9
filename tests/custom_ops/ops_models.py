"""Tiny ONNX models around the custom ops (and the stock ops they replace) for the tests.

bf16 cannot cross ORT's Python API as numpy, so bf16 models take and return fp32 through exact
Casts (every value fed is already bf16-representable, and bf16 -> fp32 is exact).
"""

from __future__ import annotations

from pathlib import Path

import ml_dtypes
import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper

DTYPES = {
    "float32": (TensorProto.FLOAT, np.float32),
    "float16": (TensorProto.FLOAT16, np.float16),
    "bfloat16": (TensorProto.BFLOAT16, ml_dtypes.bfloat16),
}
OPSETS = [
    helper.make_opsetid("", 23),
    helper.make_opsetid("loopcast", 1),
    helper.make_opsetid("com.microsoft", 1),
]


def as_dtype(x: np.ndarray, dtype: str) -> np.ndarray:
    """Round to the op dtype, returned as the array the model is fed (fp32 for bf16)."""
    y = np.asarray(x).astype(DTYPES[dtype][1])
    return y.astype(np.float32) if dtype == "bfloat16" else y


def _io(dtype: str) -> int:
    return TensorProto.FLOAT if dtype == "bfloat16" else DTYPES[dtype][0]


def _wrap(
    nodes: list,
    inputs: list[tuple[str, int, list]],
    outputs: list[tuple[str, int, list]],
    dtype: str,
    cast: set[str],
) -> bytes:
    """Graph with `nodes`; the names in `cast` go through Cast(bf16) in and Cast(fp32) out for bf16."""
    body, rename = [], {}
    if dtype == "bfloat16":
        for name, _, _ in inputs:
            if name in cast:
                body.append(helper.make_node("Cast", [name], [name + "_bf16"], to=TensorProto.BFLOAT16))
                rename[name] = name + "_bf16"
    for node in nodes:
        node.input[:] = [rename.get(i, i) for i in node.input]
        if dtype == "bfloat16":
            node.output[:] = [o + "_bf16" if o in cast else o for o in node.output]
        body.append(node)
    if dtype == "bfloat16":
        for name, _, _ in outputs:
            if name in cast:
                body.append(helper.make_node("Cast", [name + "_bf16"], [name], to=TensorProto.FLOAT))
    graph = helper.make_graph(
        body,
        "g",
        [helper.make_tensor_value_info(n, t, s) for n, t, s in inputs],
        [helper.make_tensor_value_info(n, t, s) for n, t, s in outputs],
    )
    return helper.make_model(graph, ir_version=10, opset_imports=OPSETS).SerializeToString()


def session(model: bytes, library: Path | None) -> ort.InferenceSession:
    so = ort.SessionOptions()
    if library is not None:
        so.register_custom_ops_library(str(library))
    return ort.InferenceSession(model, so, providers=["CPUExecutionProvider"])


def matmul_model(
    K: int | str, N: int | str, dtype: str, trans_b: bool = False, swiglu: bool = False
) -> bytes:
    """BatchInvariantMatMul; with `swiglu` A is [M, 2K] (gate | up; "A2" when K is symbolic)."""
    t = _io(dtype)
    attrs = {**({"trans_b": 1} if trans_b else {}), **({"swiglu": 1} if swiglu else {})}
    node = helper.make_node(
        "BatchInvariantMatMul", ["A", "B"], ["Y"], domain="loopcast", name="/matmul", **attrs
    )
    a_width = (2 * K if isinstance(K, int) else "A2") if swiglu else K
    return _wrap(
        [node],
        [("A", t, ["M", a_width]), ("B", t, [N, K] if trans_b else [K, N])],
        [("Y", t, ["M", N])],
        dtype,
        {"A", "B", "Y"},
    )


def attention_model(
    op: str,
    *,
    Hq: int,
    Hkv: int,
    D: int,
    T: int,
    dtype: str,
    rotary_len: int | None = None,
    attrs: dict | None = None,
    with_key: bool = False,
    past_D: int | None = None,
) -> bytes:
    """op: "BatchInvariantAttention" or "GroupQueryAttention" (com.microsoft), packed q|k|v."""
    t = _io(dtype)
    width = (Hq + 2 * Hkv) * D
    past = ["B", Hkv, T, past_D or D]
    a = {"num_heads": Hq, "kv_num_heads": Hkv, "do_rotary": 1, "rotary_interleaved": 0}
    a.update(attrs or {})
    domain = "loopcast" if op == "BatchInvariantAttention" else "com.microsoft"
    # inputs 0 query, 1 key, 2 value ("" = packed), 3 past_key, 4 past_value, 5 seqlens_k,
    # 6 total_sequence_length, 7 cos_cache, 8 sin_cache
    node = helper.make_node(
        op,
        [
            "query",
            "key" if with_key else "",
            "",
            "past_key",
            "past_value",
            "seqlens_k",
            "total_sequence_length",
            "cos_cache",
            "sin_cache",
        ],
        ["output", "present_key", "present_value"],
        domain=domain,
        name="/attn",
        **a,
    )
    inputs = [
        ("query", t, ["B", "S", width]),
        ("past_key", t, past),
        ("past_value", t, past),
        ("seqlens_k", TensorProto.INT32, ["B"]),
        ("total_sequence_length", TensorProto.INT32, []),
        ("cos_cache", t, [rotary_len or T, D // 2]),
        ("sin_cache", t, [rotary_len or T, D // 2]),
    ]
    if with_key:
        inputs.append(("key", t, ["B", "S", Hkv * D]))
    outputs = [("output", t, ["B", "S", Hq * D]), ("present_key", t, past), ("present_value", t, past)]
    return _wrap(
        [node],
        inputs,
        outputs,
        dtype,
        {
            "query",
            "past_key",
            "past_value",
            "cos_cache",
            "sin_cache",
            "key",
            "output",
            "present_key",
            "present_value",
        },
    )


def rotary_tables(T: int, D: int, dtype: str, theta: float = 10000.0) -> tuple[np.ndarray, np.ndarray]:
    inv = 1.0 / theta ** (np.arange(0, D, 2, dtype=np.float64) / D)
    ang = np.arange(T, dtype=np.float64)[:, None] * inv[None, :]
    return as_dtype(np.cos(ang), dtype), as_dtype(np.sin(ang), dtype)


def attention_feeds(
    rng: np.random.Generator, *, B: int, S: int, n: int, Hq: int, Hkv: int, D: int, T: int, dtype: str
) -> dict[str, np.ndarray]:
    """Random feeds for rows at positions n..n+S-1 over a cache holding random past values."""
    cos, sin = rotary_tables(T, D, dtype)
    return {
        "query": as_dtype(rng.standard_normal((B, S, (Hq + 2 * Hkv) * D)), dtype),
        "past_key": as_dtype(rng.standard_normal((B, Hkv, T, D)), dtype),
        "past_value": as_dtype(rng.standard_normal((B, Hkv, T, D)), dtype),
        "seqlens_k": np.full((B,), n + S - 1, dtype=np.int32),
        "total_sequence_length": np.array(n + S, dtype=np.int32),
        "cos_cache": cos,
        "sin_cache": sin,
    }


def reference_attention(
    feeds: dict[str, np.ndarray],
    *,
    Hq: int,
    Hkv: int,
    D: int,
    dtype: str,
    scale: float | None = None,
    do_rotary: bool = True,
) -> tuple[np.ndarray, ...]:
    """numpy model of the op: fp32 math, rotated k rounded to the dtype before it is stored/used."""
    q_all = feeds["query"].astype(np.float32)
    B, S, _ = q_all.shape
    pk, pv = feeds["past_key"].copy(), feeds["past_value"].copy()
    cos, sin = feeds["cos_cache"].astype(np.float32), feeds["sin_cache"].astype(np.float32)
    scale = scale or 1.0 / np.sqrt(D)
    half = D // 2
    out = np.zeros((B, S, Hq * D), np.float32)

    def rot(x, p):
        if not do_rotary:
            return x
        x1, x2 = x[..., :half], x[..., half:]
        return np.concatenate([x1 * cos[p] - x2 * sin[p], x2 * cos[p] + x1 * sin[p]], axis=-1)

    for b in range(B):
        n = int(feeds["seqlens_k"][b]) + 1 - S
        for i in range(S):
            row = q_all[b, i].reshape(Hq + 2 * Hkv, D)
            pk[b, :, n + i] = as_dtype(rot(row[Hq : Hq + Hkv], n + i), dtype)
            pv[b, :, n + i] = row[Hq + Hkv :]
        for i in range(S):
            p = n + i
            row = q_all[b, i].reshape(Hq + 2 * Hkv, D)
            for h in range(Hq):
                kv = h // (Hq // Hkv)
                q = rot(row[h], p)
                s = (pk[b, kv, : p + 1].astype(np.float32) @ q) * scale
                e = np.exp(s - s.max())
                out[b, i, h * D : (h + 1) * D] = (e @ pv[b, kv, : p + 1].astype(np.float32)) / e.sum()
    return as_dtype(out, dtype), pk, pv


NORM_WEIGHTS = ("branch_weight", "loop_weight", "out_weight")


def residual_norm_model(
    H: int | str,
    dtype: str,
    weights: tuple[str, ...] = NORM_WEIGHTS,
    *,
    normed: bool | None = None,
    epsilon: float | None = None,
    trim: bool = True,
    weight_shape: list | None = None,
    residual: bool = True,
) -> bytes:
    """ResidualRMSNorm over [B, S, H] with the named weights; the others are "" (trailing ones left
    off the node when `trim`). Output 1 `normed` is declared when `normed` (default: with out_weight).
    Without `residual` input 1 is "" (the op is then a plain RMSNorm of the branch)."""
    t = _io(dtype)
    normed = "out_weight" in weights if normed is None else normed
    # inputs 0 branch, 1 residual, 2 branch_weight, 3 loop_weight, 4 out_weight ("" = absent)
    names = ["branch", "residual" if residual else "", *(w if w in weights else "" for w in NORM_WEIGHTS)]
    while trim and names[-1] == "":
        names.pop()
    outs = ["sum", "normed"] if normed else ["sum"]
    attrs = {} if epsilon is None else {"epsilon": epsilon}
    node = helper.make_node("ResidualRMSNorm", names, outs, domain="loopcast", name="/residual_norm", **attrs)
    x = ["B", "S", H]
    inputs = (
        [("branch", t, x)]
        + ([("residual", t, x)] if residual else [])
        + [(w, t, weight_shape or [H]) for w in NORM_WEIGHTS if w in weights]
    )
    return _wrap([node], inputs, [(o, t, x) for o in outs], dtype, {n for n, _, _ in inputs} | set(outs))


def stock_residual_norm_model(
    H: int, dtype: str, weights: tuple[str, ...] = NORM_WEIGHTS, epsilon: float = 1e-6
) -> bytes:
    """The chain ResidualRMSNorm replaces, from stock ops (RMSNormalization-23 with fp32 stash):

    branch ──[RMSNorm(branch_weight)]──┐
    residual ─────────────────────────Add──[RMSNorm(loop_weight)]── sum ──[RMSNorm(out_weight)]── normed
    """
    t = _io(dtype)
    nodes, x = [], ["B", "S", H]

    def norm(src: str, weight: str, dst: str) -> str:
        nodes.append(
            helper.make_node(
                "RMSNormalization",
                [src, weight],
                [dst],
                name=f"/{dst}",
                axis=-1,
                epsilon=epsilon,
                stash_type=1,
            )
        )
        return dst

    b = norm("branch", "branch_weight", "branch_normed") if "branch_weight" in weights else "branch"
    s = "sum" if "loop_weight" not in weights else "added"
    nodes.append(helper.make_node("Add", ["residual", b], [s], name="/add"))
    if "loop_weight" in weights:
        norm(s, "loop_weight", "sum")
    outs = ["sum"]
    if "out_weight" in weights:
        outs.append(norm("sum", "out_weight", "normed"))
    inputs = [("branch", t, x), ("residual", t, x)] + [(w, t, [H]) for w in NORM_WEIGHTS if w in weights]
    return _wrap(nodes, inputs, [(o, t, x) for o in outs], dtype, {n for n, _, _ in inputs} | set(outs))


def swiglu_model(width: int | str, dtype: str) -> bytes:
    """SwiGLU over gate_up [B, S, width] -> out [B, S, width/2] (width "W": any, checked at run)."""
    t = _io(dtype)
    node = helper.make_node("SwiGLU", ["gate_up"], ["out"], domain="loopcast", name="/swiglu")
    half = width // 2 if isinstance(width, int) else "I"
    return _wrap(
        [node], [("gate_up", t, ["B", "S", width])], [("out", t, ["B", "S", half])], dtype, {"gate_up", "out"}
    )


def matmul_nbits_model(
    K: int,
    N: int,
    bits: int,
    block_size: int,
    dtype: str,
    *,
    zero_points: bool,
    swiglu: bool = False,
    symbolic: bool = False,
    accuracy_level: int = 0,
    float_zero_points: bool = False,
) -> bytes:
    """BatchInvariantMatMulNBits over fed quantized tensors B, scales (and zero_points, packed
    uint8 or with `float_zero_points` fp32 [N · n_blocks]): A [M, K] (with `swiglu` [M, 2K] =
    gate | up) -> Y [M, N]; `symbolic`: every input dim symbolic, so the op's own shape checks see
    what is fed."""
    t = _io(dtype)
    nb = -(-K // block_size)
    names = ["A", "B", "scales", *(["zero_points"] if zero_points else [])]
    node = helper.make_node(
        "BatchInvariantMatMulNBits",
        names,
        ["Y"],
        domain="loopcast",
        name="/matmul_nbits",
        K=K,
        N=N,
        bits=bits,
        block_size=block_size,
        **({"swiglu": 1} if swiglu else {}),
        **({"accuracy_level": accuracy_level} if accuracy_level else {}),
    )
    inputs = [
        ("A", t, ["M", 2 * K if swiglu else K]),
        ("B", TensorProto.UINT8, [N, nb, block_size * bits // 8]),
        ("scales", TensorProto.FLOAT, [N * nb]),
    ]
    if zero_points and float_zero_points:
        inputs.append(("zero_points", TensorProto.FLOAT, [N * nb]))
    elif zero_points:
        inputs.append(("zero_points", TensorProto.UINT8, [N * (-(-nb * bits // 8))]))
    if symbolic:
        inputs = [(name, ty, [f"{name}{i}" for i in range(len(shape))]) for name, ty, shape in inputs]
    return _wrap([node], inputs, [("Y", t, ["M", N])], dtype, {"A", "Y"})
