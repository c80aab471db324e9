"""PyTorch baseline for the decode benchmark: one full-depth M=1 step of the torch reference.

The step is the decode graph kind written with the reference's entry points,

    ids_B1 ─ embed ─ prelude ─ core_loop(0..R-1) ─ coda ─ head ─ argmax ─▶ next_B

over a static per-slot ``KVCache``, timed eagerly or as a replayed ``torch.cuda.CUDAGraph``.
Beside the timings sit the memory-traffic model of one step (weights + KV read) and the
measured device bandwidth, whose ratio is the bandwidth floor a decode step cannot beat.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable

import torch
from loopcast.exporter.checkpoint import load_checkpoint
from loopcast.exporter.reference import KVCache, LoopedLM

from loopcast.config import ModelConfig
from loopcast.errors import RequestError

DecodeStep = Callable[[torch.Tensor], torch.Tensor]  # ids_B1 (int64) -> next_B (int64)

# On CPU a 1 GiB copy would only time the allocator; 64 MiB is still far beyond the LLC.
_CPU_BANDWIDTH_BYTES = 2**26


def load_reference(
    checkpoint_dir: str | os.PathLike, dtype: torch.dtype, device: torch.device | str
) -> LoopedLM:
    """The reference model from a checkpoint directory (or ``demo``), in eval mode, frozen."""
    model = load_checkpoint(checkpoint_dir, dtype=dtype).to(device)
    model.requires_grad_(False)
    return model.eval()


def decode_step_fn(model: LoopedLM, cache: KVCache, past: int) -> DecodeStep:
    """A callable running one M=1 full-depth step at position ``past``; returns argmax ids.

    The StepContext (rotary tables) is built once here, not per call, so the step launches
    only device work: no host syncs, no tensors made from Python values, which keeps it
    capturable by a CUDA graph. The position is baked in: every call writes KV row ``past``
    of every slot and attends over rows ``0..past`` (the cache is overwritten, not grown).
    The exit gate is skipped, as in the exported decode graph: greedy full-depth decoding
    never reads it.
    """
    if not 0 <= past < cache.max_length:
        raise RequestError(f"past {past} is outside 0..{cache.max_length - 1} (the cache's max_length)")
    device = cache.key.device
    ctx = model.context(past, 1, cache, device)

    @torch.no_grad()
    def step(ids_B1: torch.Tensor) -> torch.Tensor:
        x_B1H = model.prelude(model.embed(ids_B1), ctx)
        for loop in range(model.config.num_loops):
            x_B1H = model.core_loop(x_B1H, loop, ctx)
        logits_B1V = model.head(model.coda(x_B1H, ctx))
        return logits_B1V[:, -1].argmax(dim=-1)  # next_B

    return step


def random_cache(model: LoopedLM, *, past: int, max_length: int, seed: int = 0) -> KVCache:
    """A static cache for ``max_length`` positions whose rows ``0..past-1`` hold random values."""
    if not 0 <= past < max_length:
        raise RequestError(f"past {past} must be in 0..{max_length - 1} (max_length {max_length})")
    weight = model.model.embed_tokens.weight
    cache = KVCache(model.config, max_length, dtype=weight.dtype, device=weight.device)
    generator = torch.Generator(device=weight.device).manual_seed(seed)
    for buffer in (cache.key, cache.value):
        buffer[:, :, :, :past].normal_(generator=generator)  # in place: no full-size temporary
    return cache


def decode_step_ms(
    model: LoopedLM, *, past: int, max_length: int, cuda_graph: bool, iters: int = 50, warmup: int = 5
) -> float:
    """Median milliseconds of one M=1 full-depth decode step at position ``past``.

    Each step feeds its argmax back as the next input on the device (a real autoregressive
    chain, no host round trip). On CUDA the steps are bracketed by CUDA events; on CPU by
    ``time.perf_counter``. ``cuda_graph=True`` (CUDA only) captures one step after warm-up
    and times graph replays; the captured step is replayed at the same position ``past``
    (the reference writes the cache and builds the mask from Python ints), which costs the
    same as stepping forward: the work depends on ``past`` only.
    """
    device = model.model.embed_tokens.weight.device
    if cuda_graph and device.type != "cuda":
        raise ValueError(f"cuda_graph=True needs a model on a CUDA device, the model is on {device}")
    if iters < 1 or warmup < 0:
        raise ValueError(f"iters must be >= 1 and warmup >= 0, got iters={iters} warmup={warmup}")
    cache = random_cache(model, past=past, max_length=max_length)
    step = decode_step_fn(model, cache, past)
    ids_B1 = torch.zeros((1, 1), dtype=torch.long, device=device)

    def chained() -> None:
        ids_B1.copy_(step(ids_B1).view(1, 1))

    if device.type != "cuda":
        for _ in range(warmup):
            chained()
        times = []
        for _ in range(iters):
            begin = time.perf_counter()
            chained()
            times.append((time.perf_counter() - begin) * 1e3)
        return statistics.median(times)

    # Warm up on a side stream: cuBLAS handles/workspaces and the caching allocator settle
    # before capture (the recipe torch.cuda.graphs documents).
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(max(warmup, 1 if cuda_graph else 0)):
            chained()
    torch.cuda.current_stream(device).wait_stream(side)
    run = chained
    if cuda_graph:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            chained()
        run = graph.replay
        for _ in range(max(warmup, 1)):
            run()
    torch.cuda.synchronize(device)
    events = [torch.cuda.Event(enable_timing=True) for _ in range(iters + 1)]
    events[0].record()
    for i in range(iters):
        run()
        events[i + 1].record()
    torch.cuda.synchronize(device)
    return statistics.median(events[i].elapsed_time(events[i + 1]) for i in range(iters))


def device_bandwidth_gbs(device: torch.device | str, nbytes: int | None = None, iters: int = 20) -> float:
    """Measured copy bandwidth in GB/s (1e9 B/s): each copy reads and writes ``nbytes``.

    ``nbytes`` defaults to 1 GiB on CUDA (HBM, far beyond L2) and 64 MiB on CPU.
    """
    device = torch.device(device)
    if nbytes is None:
        nbytes = 2**30 if device.type == "cuda" else _CPU_BANDWIDTH_BYTES
    if nbytes < 1 or iters < 1:
        raise ValueError(f"nbytes and iters must be positive, got nbytes={nbytes} iters={iters}")
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)  # first touch: page faults / lazy allocation stay out of the timing
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        for _ in range(iters):
            dst.copy_(src)
        end.record()
        torch.cuda.synchronize(device)
        seconds = begin.elapsed_time(end) / 1e3
    else:
        begin_s = time.perf_counter()
        for _ in range(iters):
            dst.copy_(src)
        seconds = time.perf_counter() - begin_s
    return 2 * nbytes * iters / seconds / 1e9


def _layer_params(config: ModelConfig) -> int:
    h, d, inter = config.hidden_size, config.head_dim, config.intermediate_size
    attention = h * config.num_heads * d * 2 + h * config.num_kv_heads * d * 2  # q, o; k, v
    mlp = 3 * h * inter  # gate, up, down
    norms = (4 if config.sandwich_norm else 2) * h
    biases = (
        ((config.num_heads + 2 * config.num_kv_heads) * d if config.qkv_bias else 0)
        + (h if config.o_bias else 0)
        + (2 * inter + h if config.mlp_bias else 0)
    )
    return attention + mlp + norms + biases


def bytes_per_decode_step(config: ModelConfig, dtype_bytes: int, past: int) -> dict[str, int]:
    """Bytes one M=1 full-depth decode step at position ``past`` must read from memory.

    ``weights`` = prelude + R × core + coda + head. The core stack (its layers and the
    loop-norm) is applied once per loop, so a step streams its weights R times: at 1.4B
    parameters (~2.8 GB in fp16) they do not stay in cache (H200 L2: 60 MB) between loops.
    The head reads the whole V×H matrix (tied or not); the embedding gathers one row. The exit
    gate is left out (greedy full-depth decoding does not compute it).

    ``kv`` = every KV slot the step runs (R×L + P + C) reads K and V over ``past + 1`` rows:
    ``2 · H_kv · (past+1) · D · dtype_bytes`` each.
    """
    if past < 0:
        raise ValueError(f"past must be >= 0, got {past}")
    h = config.hidden_size
    layer = _layer_params(config)
    core = config.num_layers * layer + h  # + the loop-norm
    edges = (config.num_prelude_layers + config.num_coda_layers) * layer
    head = config.vocab_size * h + h  # lm_head (or the tied embedding) + one embedding row
    weights = (edges + config.num_loops * core + head) * dtype_bytes
    kv = config.num_kv_slots * 2 * config.num_kv_heads * (past + 1) * config.head_dim * dtype_bytes
    return {"weights": weights, "kv": kv, "total": weights + kv}


def floor_ms(bytes_total: int, bandwidth_gbs: float) -> float:
    """The bandwidth floor: milliseconds to move ``bytes_total`` at ``bandwidth_gbs`` GB/s."""
    if bandwidth_gbs <= 0:
        raise ValueError(f"bandwidth_gbs must be positive, got {bandwidth_gbs}")
    return bytes_total / (bandwidth_gbs * 1e9) * 1e3
