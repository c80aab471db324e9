"""CPU time of loopcast's BatchInvariantAttention per call: one op library against another on the
same feeds (docs/perf.md, "The CPU op set").

    python -m tools.bench.bench_attention_cpu --lib new=LIB [--lib base=OTHER_LIB] [--rows 1,8]
        [--past 300] [--threads 1]

One-node graphs at a ~135M Llama's attention shape (9 query heads, 3 KV heads, head_dim 64) and
the demo's, rows at positions past..past+S-1, the cache bound in place through IO binding (as
the runtime binds it, so no copy of the cache per call); the libraries are timed interleaved
(median of --repeats rounds of --iters calls, process CPU time with --threads 1 by default, so a
shared VM still measures one core's work). Prints µs per call and each library's time over the
first one's.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper

# (label, Hq, Hkv, D)
SHAPES = [("135M", 9, 3, 64), ("demo", 8, 4, 32)]


def _model(Hq: int, Hkv: int, D: int, T: int) -> bytes:
    width = (Hq + 2 * Hkv) * D
    past = [1, Hkv, T, D]
    node = helper.make_node(
        "BatchInvariantAttention",
        ["query", "", "", "past_key", "past_value", "seqlens_k", "total_sequence_length"]
        + ["cos_cache", "sin_cache"],
        ["output", "present_key", "present_value"],
        domain="loopcast",
        num_heads=Hq,
        kv_num_heads=Hkv,
        do_rotary=1,
        rotary_interleaved=0,
    )
    f = TensorProto.FLOAT
    graph = helper.make_graph(
        [node],
        "attention",
        [
            helper.make_tensor_value_info("query", f, [1, "S", width]),
            helper.make_tensor_value_info("past_key", f, past),
            helper.make_tensor_value_info("past_value", f, past),
            helper.make_tensor_value_info("seqlens_k", TensorProto.INT32, [1]),
            helper.make_tensor_value_info("total_sequence_length", TensorProto.INT32, []),
            helper.make_tensor_value_info("cos_cache", f, [T, D // 2]),
            helper.make_tensor_value_info("sin_cache", f, [T, D // 2]),
        ],
        [
            helper.make_tensor_value_info("output", f, [1, "S", Hq * D]),
            helper.make_tensor_value_info("present_key", f, past),
            helper.make_tensor_value_info("present_value", f, past),
        ],
    )
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("loopcast", 1)]
    return helper.make_model(graph, opset_imports=opsets, ir_version=9).SerializeToString()


class Contender:
    """One library's session and its in-place binding for one shape and row count."""

    def __init__(self, lib: str, shape: tuple, S: int, past: int, threads: int) -> None:
        _, Hq, Hkv, D = shape
        T = past + S + 8
        opts = ort.SessionOptions()
        opts.register_custom_ops_library(lib)
        opts.intra_op_num_threads = threads
        self.sess = ort.InferenceSession(_model(Hq, Hkv, D, T), opts, providers=["CPUExecutionProvider"])
        rng = np.random.default_rng(0)
        ang = np.arange(T)[:, None] / 10000 ** (np.arange(0, D, 2) / D)[None, :]
        feeds = {
            "query": rng.standard_normal((1, S, (Hq + 2 * Hkv) * D)).astype(np.float32),
            "seqlens_k": np.array([past + S - 1], dtype=np.int32),
            "total_sequence_length": np.array(past + S, dtype=np.int32),
            "cos_cache": np.cos(ang).astype(np.float32),
            "sin_cache": np.sin(ang).astype(np.float32),
        }
        self.binding = self.sess.io_binding()
        for name, value in feeds.items():
            self.binding.bind_cpu_input(name, value)
        for name in ("key", "value"):
            cache = ort.OrtValue.ortvalue_from_numpy(rng.standard_normal((1, Hkv, T, D)).astype(np.float32))
            self.binding.bind_ortvalue_input(f"past_{name}", cache)
            self.binding.bind_ortvalue_output(f"present_{name}", cache)  # in place, as the runtime binds it
        self.binding.bind_output("output")

    def time(self, iters: int) -> float:
        t0 = time.process_time()
        for _ in range(iters):
            self.sess.run_with_iobinding(self.binding)
        return (time.process_time() - t0) / iters * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lib", action="append", required=True, help="LABEL=PATH of an op library (repeatable)")
    p.add_argument("--rows", default="1,8")
    p.add_argument("--past", type=int, default=300)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--repeats", type=int, default=7)
    args = p.parse_args()
    libs = [tuple(spec.split("=", 1)) for spec in args.lib]
    print(
        f"onnxruntime {ort.__version__}; past {args.past}; {args.threads} thread(s); CPU µs per call (median)"
    )
    print(f"{'shape':8} {'S':>3} " + " ".join(f"{label:>10}" for label, _ in libs) + "  ratios to the first")
    for shape in SHAPES:
        for S in (int(s) for s in args.rows.split(",")):
            contenders = [Contender(path, shape, S, args.past, args.threads) for _, path in libs]
            for c in contenders:
                c.time(5)
            times: list[list[float]] = [[] for _ in contenders]
            for r in range(args.repeats):
                order = list(range(len(contenders)))
                order = order[r % len(order) :] + order[: r % len(order)]
                for i in order:
                    times[i].append(contenders[i].time(args.iters))
            med = [statistics.median(t) for t in times]
            ratios = " ".join(f"{m / med[0]:.2f}" for m in med[1:])
            print(f"{shape[0]:8} {S:>3} " + " ".join(f"{m:10.1f}" for m in med) + f"  {ratios}")


if __name__ == "__main__":
    main()
