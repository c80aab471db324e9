"""Check and time the loopcast custom ops on CUDAExecutionProvider (run once on a GPU machine).

    python tools/check_ops_cuda.py --lib custom_ops/build/libloopcast_ops.so --out ops_cuda.json

(a) CUDA op vs CPU op of the same library, per dtype tolerance;
(b) CUDA rows bit-identical for one M=W call vs W one-row calls (matmul and attention, fp16/bf16),
    and attention in place (past and present bound to one device buffer) vs out of place;
(c) microbenchmarks with IO binding and device-resident inputs: BatchInvariantMatMul vs MatMul on
    the Ouro-1.4B shapes, BatchInvariantAttention vs GroupQueryAttention (past 1024, 16x128 heads).
Each timed graph chains `copies` independent nodes with their own weights/caches (more bytes
than L2 holds) and runs under an ORT CUDA graph when capture works (eager otherwise), so the
per-node time is the run time / copies. Prints a table, writes JSON, exits 1 if any check fails.

Needs onnxruntime-gpu, torch with CUDA (bandwidth reference and timing sync), numpy, onnx,
ml_dtypes. bf16 crosses the Python API as fp32 through exact Casts inside the graphs.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
import traceback
from pathlib import Path

import numpy as np

OPSETS = None  # filled lazily: importing this module has no side effects
SHAPES = [(2048, 6144), (2048, 2048), (2048, 11264), (5632, 2048)]  # Ouro-1.4B [K, N]
OUTPUTS = ["output", "present_key", "present_value"]
TOL = {"float32": 1e-4, "float16": 2e-2, "bfloat16": 6e-2}


# ----------------------------------------------------------------------------- models
def _onnx():
    from onnx import TensorProto, helper
    return TensorProto, helper


def _elem(dtype: str) -> int:
    TensorProto, _ = _onnx()
    return {"float32": TensorProto.FLOAT, "float16": TensorProto.FLOAT16, "bfloat16": TensorProto.BFLOAT16}[dtype]


def _np(dtype: str):
    import ml_dtypes
    return {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}[dtype]


def as_dtype(x: np.ndarray, dtype: str) -> np.ndarray:
    """Round to the op dtype; the array fed is fp32 for bf16 (Casts inside the graph are exact)."""
    y = np.asarray(x).astype(_np(dtype))
    return y.astype(np.float32) if dtype == "bfloat16" else y


def _model(nodes, inputs, outputs, dtype, cast, initializers=()) -> bytes:
    """Graph whose `cast` names are fp32 at the boundary for bf16 (Cast in / Cast out)."""
    TensorProto, helper = _onnx()
    io_t = TensorProto.FLOAT if dtype == "bfloat16" else _elem(dtype)
    body, rename = [], {}
    if dtype == "bfloat16":
        for name, _ in inputs:
            if name in cast:
                body.append(helper.make_node("Cast", [name], [name + "_c"], to=TensorProto.BFLOAT16))
                rename[name] = name + "_c"
    for node in nodes:
        node.input[:] = [rename.get(i, i) for i in node.input]
        if dtype == "bfloat16":
            node.output[:] = [o + "_c" if o in cast else o for o in node.output]
        body.append(node)
    if dtype == "bfloat16":
        for name, _ in outputs:
            if name in cast:
                body.append(helper.make_node("Cast", [name + "_c"], [name], to=TensorProto.FLOAT))

    def info(name, shape):
        t = TensorProto.INT32 if name.startswith(("seqlens_k", "total_sequence_length")) else io_t
        return helper.make_tensor_value_info(name, t, shape)

    graph = helper.make_graph(body, "g", [info(n, s) for n, s in inputs], [info(n, s) for n, s in outputs],
                              initializer=list(initializers))
    opsets = [helper.make_opsetid("", 23), helper.make_opsetid("loopcast", 1), helper.make_opsetid("com.microsoft", 1)]
    return helper.make_model(graph, ir_version=10, opset_imports=opsets).SerializeToString()


def matmul_model(K: int, N: int, dtype: str, op: str = "BatchInvariantMatMul", weights: list | None = None) -> bytes:
    """One node per weight (inputs B0.. when weights is None, else initializers), sharing A."""
    TensorProto, helper = _onnx()
    count = len(weights) if weights else 1
    domain = "loopcast" if op == "BatchInvariantMatMul" else ""
    nodes = [helper.make_node(op, ["A", f"B{i}"], [f"Y{i}"], domain=domain, name=f"/mm{i}") for i in range(count)]
    inits = []
    if weights:
        for i, w in enumerate(weights):  # raw bytes: works for bf16 too
            inits.append(helper.make_tensor(f"B{i}", _elem(dtype), list(w.shape), w.tobytes(), raw=True))
            if dtype == "bfloat16":
                inits[-1].name = f"B{i}_c"  # already bf16: bypass the boundary Cast
    inputs = [("A", ["M", K])] + ([] if weights else [("B0", [K, N])])
    cast = {"A", *(f"Y{i}" for i in range(count))} | (set() if weights else {"B0"})
    if weights and dtype == "bfloat16":
        for node in nodes:
            node.input[1] = node.input[1] + "_c"
    return _model(nodes, inputs, [(f"Y{i}", ["M", N]) for i in range(count)], dtype, cast, inits)


def attention_model(op: str, Hq: int, Hkv: int, D: int, T: int, dtype: str, copies: int = 1) -> bytes:
    """`copies` attention nodes sharing the query, each with its own cache pair."""
    _, helper = _onnx()
    domain = "loopcast" if op == "BatchInvariantAttention" else "com.microsoft"
    past = ["B", Hkv, T, D]
    nodes, inputs, outputs, cast = [], [("query", ["B", "S", (Hq + 2 * Hkv) * D])], [], {"query", "cos_cache", "sin_cache"}
    for c in range(copies):
        sfx = "" if copies == 1 else str(c)
        # inputs 0 query, 1 key, 2 value ("" = packed), 3 past_key, 4 past_value, 5 seqlens_k,
        # 6 total_sequence_length, 7 cos_cache, 8 sin_cache
        nodes.append(helper.make_node(
            op, ["query", "", "", "past_key" + sfx, "past_value" + sfx, "seqlens_k", "total_sequence_length",
                 "cos_cache", "sin_cache"], ["output" + sfx, "present_key" + sfx, "present_value" + sfx],
            domain=domain, name=f"/attn{c}", num_heads=Hq, kv_num_heads=Hkv, do_rotary=1, rotary_interleaved=0))
        inputs += [("past_key" + sfx, past), ("past_value" + sfx, past)]
        outputs += [("output" + sfx, ["B", "S", Hq * D]), ("present_key" + sfx, past), ("present_value" + sfx, past)]
        cast |= {"past_key" + sfx, "past_value" + sfx, "output" + sfx, "present_key" + sfx, "present_value" + sfx}
    inputs += [("seqlens_k", ["B"]), ("total_sequence_length", []), ("cos_cache", [T, D // 2]),
               ("sin_cache", [T, D // 2])]
    return _model(nodes, inputs, outputs, dtype, cast)


def attention_feeds(rng, B, S, n, Hq, Hkv, D, T, dtype) -> dict:
    inv = 1.0 / 10000.0 ** (np.arange(0, D, 2) / D)
    ang = np.arange(T)[:, None] * inv[None, :]
    return {"query": as_dtype(rng.standard_normal((B, S, (Hq + 2 * Hkv) * D)), dtype),
            "past_key": as_dtype(rng.standard_normal((B, Hkv, T, D)), dtype),
            "past_value": as_dtype(rng.standard_normal((B, Hkv, T, D)), dtype),
            "seqlens_k": np.full((B,), n + S - 1, np.int32), "total_sequence_length": np.array(n + S, np.int32),
            "cos_cache": as_dtype(np.cos(ang), dtype), "sin_cache": as_dtype(np.sin(ang), dtype)}


# ----------------------------------------------------------------------------- sessions
def make_session(model: bytes, lib: str | None, provider: str, cuda_graph: bool = False):
    import onnxruntime as ort
    so = ort.SessionOptions()
    if lib:
        so.register_custom_ops_library(lib)
    if provider == "cuda":
        opts = {"device_id": 0}
        if cuda_graph:
            opts["enable_cuda_graph"] = "1"
        return ort.InferenceSession(model, so, providers=[("CUDAExecutionProvider", opts)])
    return ort.InferenceSession(model, so, providers=["CPUExecutionProvider"])


class Report:
    def __init__(self) -> None:
        self.checks: list[dict] = []
        self.bench: list[dict] = []

    def check(self, name: str, ok: bool, detail: str = "") -> None:
        self.checks.append({"name": name, "ok": bool(ok), "detail": detail})
        print(f"  [{'ok' if ok else 'FAIL'}] {name}{'  ' + detail if detail else ''}", flush=True)

    def guarded(self, name: str, fn) -> None:
        try:
            fn()
        except Exception as e:  # keep going: report and fail at the end
            self.check(name, False, f"{type(e).__name__}: {e}".splitlines()[0][:300])
            traceback.print_exc()


def _close(a: np.ndarray, b: np.ndarray, tol: float) -> tuple[bool, str]:
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    err = float(np.max(np.abs(a - b))) if a.size else 0.0
    return bool(np.allclose(a, b, rtol=tol, atol=tol)), f"max|diff|={err:.3g}"


# ----------------------------------------------------------------------------- checks
def check_matmul(rep: Report, lib: str) -> None:
    rng = np.random.default_rng(0)
    for dtype in ("float32", "float16", "bfloat16"):
        for K, N in [(2048, 2048), (384, 1000), (37, 100)]:
            model = matmul_model(K, N, dtype)
            cuda, cpu = make_session(model, lib, "cuda"), make_session(model, lib, "cpu")
            A = as_dtype(rng.standard_normal((32, K)), dtype)
            B = as_dtype(rng.standard_normal((K, N)) / math.sqrt(K), dtype)
            full = cuda.run(None, {"A": A, "B0": B})[0]
            ok, detail = _close(full, cpu.run(None, {"A": A, "B0": B})[0], TOL[dtype])
            rep.check(f"matmul cuda~cpu {dtype} K={K} N={N}", ok, detail)
            if dtype == "float32":
                continue
            single = np.concatenate([cuda.run(None, {"A": A[i:i + 1], "B0": B})[0] for i in range(32)])
            bad = [W for W in (2, 5, 8, 16, 32) if not np.array_equal(cuda.run(None, {"A": A[:W], "B0": B})[0],
                                                                       single[:W])]
            rep.check(f"matmul rows M=1 == M=W {dtype} K={K} N={N}", not bad, f"differs for W={bad}" if bad else "")


def _cuda_attention_run(sess, feeds: dict, out_width: int, in_place: bool) -> list[np.ndarray]:
    """Run with device-resident inputs; in place binds present_* to the past_* buffers."""
    import onnxruntime as ort
    binding = sess.io_binding()
    vals = {k: ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(v), "cuda", 0) for k, v in feeds.items()}
    for k, v in vals.items():
        binding.bind_ortvalue_input(k, v)
    q = feeds["query"]
    outs = {"output": ort.OrtValue.ortvalue_from_shape_and_type((*q.shape[:2], out_width), q.dtype, "cuda", 0)}
    for name in OUTPUTS[1:]:
        outs[name] = vals[name.replace("present", "past")] if in_place else \
            ort.OrtValue.ortvalue_from_shape_and_type(feeds["past_key"].shape, q.dtype, "cuda", 0)
    for k, v in outs.items():
        binding.bind_ortvalue_output(k, v)
    sess.run_with_iobinding(binding)
    return [outs[name].numpy() for name in OUTPUTS]


def check_attention(rep: Report, lib: str) -> None:
    rng = np.random.default_rng(1)
    for dtype in ("float32", "float16", "bfloat16"):
        for Hq, Hkv, D, T, n in [(16, 16, 128, 1100, 1000), (8, 2, 64, 300, 150)]:
            model = attention_model("BatchInvariantAttention", Hq, Hkv, D, T, dtype)
            cuda, cpu = make_session(model, lib, "cuda"), make_session(model, lib, "cpu")
            tag = f"{dtype} Hq={Hq} Hkv={Hkv} D={D} n={n}"
            feeds = attention_feeds(rng, 1, 8, n, Hq, Hkv, D, T, dtype)
            got = cuda.run(OUTPUTS, feeds)
            want = cpu.run(OUTPUTS, feeds)
            oks = [_close(g, w, TOL[dtype]) for g, w in zip(got, want)]
            rep.check(f"attention cuda~cpu {tag}", all(o for o, _ in oks), " ".join(d for _, d in oks))
            inplace = _cuda_attention_run(cuda, feeds, Hq * D, in_place=True)
            same = all(np.array_equal(a, b) for a, b in zip(inplace, got))
            rep.check(f"attention in-place == out-of-place {tag}", same)
            if dtype == "float32":
                continue
            bad = []
            for W in (2, 5, 8, 16, 32):
                f = attention_feeds(rng, 1, W, n, Hq, Hkv, D, T, dtype)
                ref = cuda.run(OUTPUTS, f)
                pk, pv, rows = f["past_key"], f["past_value"], []
                for i in range(W):
                    one = dict(f, query=f["query"][:, i:i + 1], past_key=pk, past_value=pv,
                               seqlens_k=np.array([n + i], np.int32), total_sequence_length=np.array(n + i + 1, np.int32))
                    out, pk, pv = cuda.run(OUTPUTS, one)
                    rows.append(out)
                if not (np.array_equal(ref[0], np.concatenate(rows, axis=1)) and np.array_equal(ref[1], pk)
                        and np.array_equal(ref[2], pv)):
                    bad.append(W)
            rep.check(f"attention rows S=1 == S=W {tag}", not bad, f"differs for W={bad}" if bad else "")


# ----------------------------------------------------------------------------- benchmarks
def device_bandwidth() -> float:
    """Bytes/s of a large device-to-device copy (read + write), measured with torch."""
    import torch
    x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        y.copy_(x)
    end.record()
    torch.cuda.synchronize()
    bw = 2 * x.numel() * 10 / (start.elapsed_time(end) / 1e3)
    del x, y
    torch.cuda.empty_cache()
    return bw


def _timed(sess, binding, iters: int) -> float:
    """Seconds per run_with_iobinding (each run ends with ORT's stream sync)."""
    for _ in range(3):
        sess.run_with_iobinding(binding)
    binding.synchronize_outputs()
    t0 = time.perf_counter()
    for _ in range(iters):
        sess.run_with_iobinding(binding)
    binding.synchronize_outputs()
    return (time.perf_counter() - t0) / iters


def _bound_session(model: bytes, lib: str, feeds: dict, outputs: dict, in_place: dict | None = None):
    """CUDA session with every input/output bound to a device buffer; CUDA graph when it captures."""
    import onnxruntime as ort
    vals = {k: ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(v), "cuda", 0) for k, v in feeds.items()}
    outs = {k: ort.OrtValue.ortvalue_from_shape_and_type(s, d, "cuda", 0) for k, (s, d) in outputs.items()}
    for out_name, in_name in (in_place or {}).items():
        outs[out_name] = vals[in_name]
    last = None
    for graph in (True, False):
        try:
            sess = make_session(model, lib, "cuda", cuda_graph=graph)
            binding = sess.io_binding()
            for k, v in vals.items():
                binding.bind_ortvalue_input(k, v)
            for k, v in outs.items():
                binding.bind_ortvalue_output(k, v)
            sess.run_with_iobinding(binding)
            return sess, binding, graph, vals
        except Exception as e:  # capture refused: time eagerly
            last = e
    raise RuntimeError(f"no CUDA session: {last}")


def bench_matmul(rep: Report, lib: str, peak: float, budget_s: float) -> None:
    rng = np.random.default_rng(2)
    t_end = time.perf_counter() + budget_s
    for dtype in ("float16", "bfloat16"):
        for K, N in SHAPES:
            wbytes = K * N * 2
            copies = max(4, math.ceil(128e6 / wbytes))  # more weight bytes than L2 (60 MB) holds
            base = rng.standard_normal((K, N), dtype=np.float32) / math.sqrt(K)
            weights = [np.roll(base, i, axis=1).astype(_np(dtype)) for i in range(copies)]
            models = {op: matmul_model(K, N, dtype, op, weights) for op in ("BatchInvariantMatMul", "MatMul")}
            del weights
            for M in (1, 5, 16, 32):
                if time.perf_counter() > t_end:
                    rep.bench.append({"kind": "matmul", "dtype": dtype, "K": K, "N": N, "M": M, "skipped": "time"})
                    continue
                A = as_dtype(rng.standard_normal((M, K)), dtype)
                out_t = np.float32 if dtype == "bfloat16" else _np(dtype)
                row = {"kind": "matmul", "dtype": dtype, "K": K, "N": N, "M": M, "copies": copies}
                for op, model in models.items():
                    try:
                        sess, binding, graph, _ = _bound_session(
                            model, lib, {"A": A}, {f"Y{i}": ((M, N), out_t) for i in range(copies)})
                        per = _timed(sess, binding, 30) / copies
                        key = "bi" if op == "BatchInvariantMatMul" else "stock"
                        row[f"{key}_us"] = per * 1e6
                        row[f"{key}_GBps"] = wbytes / per / 1e9
                        row[f"{key}_pct_bw"] = 100 * wbytes / per / peak
                        row[f"{key}_cuda_graph"] = graph
                        del sess, binding
                    except Exception as e:
                        row[f"{op}_error"] = str(e).splitlines()[0][:200]
                rep.bench.append(row)
                print(f"  matmul {dtype:8s} K={K:5d} N={N:5d} M={M:2d}  bi {row.get('bi_us', float('nan')):7.2f} us "
                      f"{row.get('bi_GBps', float('nan')):6.0f} GB/s {row.get('bi_pct_bw', float('nan')):5.1f}%   "
                      f"MatMul {row.get('stock_us', float('nan')):7.2f} us {row.get('stock_pct_bw', float('nan')):5.1f}%"
                      f"  (graph={row.get('bi_cuda_graph')})", flush=True)
            del models


def bench_attention(rep: Report, lib: str) -> None:
    rng = np.random.default_rng(3)
    Hq = Hkv = 16
    D, n, T, copies = 128, 1024, 1100, 16
    for dtype in ("float16",):  # bf16 caches would cross the boundary through Casts: not timed
        for M in (1, 5):
            row = {"kind": "attention", "dtype": dtype, "past": n, "M": M, "Hq": Hq, "Hkv": Hkv, "D": D,
                   "copies": copies}
            f = attention_feeds(rng, 1, M, n, Hq, Hkv, D, T, dtype)
            feeds = {"query": f["query"], "seqlens_k": f["seqlens_k"], "total_sequence_length": f["total_sequence_length"],
                     "cos_cache": f["cos_cache"], "sin_cache": f["sin_cache"]}
            for c in range(copies):
                feeds[f"past_key{c}"], feeds[f"past_value{c}"] = f["past_key"].copy(), f["past_value"].copy()
            out_t = f["query"].dtype
            outputs = {f"output{c}": ((1, M, Hq * D), out_t) for c in range(copies)}
            in_place = {f"present_{kv}{c}": f"past_{kv}{c}" for c in range(copies) for kv in ("key", "value")}
            for op, key in (("BatchInvariantAttention", "bi"), ("GroupQueryAttention", "stock")):
                try:
                    model = attention_model(op, Hq, Hkv, D, T, dtype, copies)
                    sess, binding, graph, _ = _bound_session(model, lib, feeds, outputs, in_place)
                    row[f"{key}_us"] = _timed(sess, binding, 50) / copies * 1e6
                    row[f"{key}_cuda_graph"] = graph
                    del sess, binding
                except Exception as e:
                    row[f"{key}_error"] = str(e).splitlines()[0][:200]
            rep.bench.append(row)
            print(f"  attention {dtype:8s} past={n} M={M}  bi {row.get('bi_us', float('nan')):7.2f} us   "
                  f"GQA {row.get('stock_us', float('nan')):7.2f} us  {row.get('bi_error', '')}{row.get('stock_error', '')}",
                  flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lib", required=True, help="libloopcast_ops.so built with CUDA kernels")
    parser.add_argument("--out", default="ops_cuda.json", help="JSON report")
    parser.add_argument("--skip-bench", action="store_true")
    args = parser.parse_args(argv)
    import onnxruntime as ort
    if hasattr(ort, "preload_dlls"):
        ort.preload_dlls()
    lib = str(Path(args.lib).resolve())
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        print("error: CUDAExecutionProvider not available (install onnxruntime-gpu)", file=sys.stderr)
        return 2
    import ctypes
    if not ctypes.CDLL(lib).loopcast_ops_has_cuda():
        print(f"error: {lib} was built without CUDA kernels", file=sys.stderr)
        return 2
    rep = Report()
    t0 = time.perf_counter()
    print("correctness", flush=True)
    rep.guarded("matmul checks", lambda: check_matmul(rep, lib))
    rep.guarded("attention checks", lambda: check_attention(rep, lib))
    peak = float("nan")
    if not args.skip_bench:
        print("benchmarks", flush=True)
        try:
            peak = device_bandwidth()
            print(f"  device copy bandwidth {peak / 1e9:.0f} GB/s", flush=True)
        except Exception as e:
            rep.check("torch bandwidth reference", False, str(e))
        remaining = 150 - (time.perf_counter() - t0)
        rep.guarded("matmul benchmark", lambda: bench_matmul(rep, lib, peak, max(20.0, remaining - 25)))
        rep.guarded("attention benchmark", lambda: bench_attention(rep, lib))
    failed = [c for c in rep.checks if not c["ok"]]
    Path(args.out).write_text(json.dumps({"library": lib, "onnxruntime": ort.__version__, "peak_bytes_per_s": peak,
                                          "checks": rep.checks, "bench": rep.bench, "failed": len(failed),
                                          "seconds": time.perf_counter() - t0}, indent=1))
    print(f"{len(rep.checks) - len(failed)}/{len(rep.checks)} checks passed; {time.perf_counter() - t0:.0f} s; "
          f"report {args.out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
