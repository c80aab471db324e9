"""Shared by the ctypes kernel microbenchmarks (bench_matmul_cuda.py, bench_attention_cuda.py):
loading the custom-op library and timing a captured CUDA graph of many calls."""

from __future__ import annotations

import ctypes

import torch


def load_library(path: str) -> ctypes.CDLL:
    lib = ctypes.CDLL(path)
    lib.loopcast_cuda_error_string.restype = ctypes.c_char_p
    return lib


def graph_time_us(fn_list, reps: int = 3) -> float:
    """Best mean µs per call of a captured graph that runs every fn in fn_list once."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm-up outside the capture (lazy init, attribute setup)
        for fn in fn_list[:4]:
            fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for fn in fn_list:
            fn()
    g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(reps):
        start.record()
        g.replay()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) * 1e3 / len(fn_list))
    del g
    return best
