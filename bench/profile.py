"""``loopcast bench``'s slot and kernel views of one generator: a long run alternating the
speculative kinds with plain decode (the graph-slot counters, the mean steady step), and where
a decode step's GPU time goes by kernel family (the PyTorch profiler over ONNX Runtime's CUDA
kernels)."""

from __future__ import annotations

import contextlib
import os
import time

from loopcast.manifest import DECODE


@contextlib.contextmanager
def kernel_env(name: str, value: str):
    """Set one of the custom-op library's launch switches (LOOPCAST_PDL) meanwhile. The
    library reads it at each launch, and a captured graph keeps what it recorded."""
    previous = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = previous


def pdl_off():
    return kernel_env("LOOPCAST_PDL", "0")


def alternation(model, prompt: list[int], tokens: int, chunk: int = 40) -> dict:
    """One generator alternating self-speculation (draft, verify_tail), prompt lookup (verify,
    decode) and plain decode in chunks for ``tokens`` tokens: after one warm-up chunk of each
    mode every slot has captured once, and from then on it may only replay. When the context
    fills up the generator rewinds to the prompt and goes on (``restarts``), so the run reaches
    ``tokens`` on any context length."""
    gen = model.new_generator()
    # Ungated, so every chunk really runs its kinds; allow_inexact only matters on stock graphs.
    inexact = not model.loaded.exact_verify
    modes = [
        {"speculative": "self", "num_draft_tokens": 4, "gate": "always", "allow_inexact": inexact},
        {"speculative": "prompt-lookup", "num_draft_tokens": 4, "gate": "always", "allow_inexact": inexact},
        {},
    ]
    ids = list(prompt)
    if len(prompt) + 4 * (chunk + 8) > gen.max_length:
        raise ValueError(
            f"alternation needs room for 4 chunks of {chunk} tokens after the prompt; "
            f"max length is {gen.max_length}"
        )

    def run_chunk(mode: dict) -> int:
        nonlocal ids
        if gen.n + chunk + 8 >= gen.max_length:  # rewind = move a length; the slots stay captured
            gen.rewind(0)
            ids = list(prompt)
            restarts.append(gen.n)
        out = list(model.stream_ids(ids, chunk, stop_ids=(), generator=gen, **mode))
        ids = [out[-1]]
        return len(out)

    restarts: list[int] = []
    for mode in modes:
        run_chunk(mode)
    warm = gen.graph_slots()
    before = gen.clock.reading()
    produced, t0 = 0, time.perf_counter()
    while produced < tokens:
        for mode in modes:
            produced += run_chunk(mode)
    end = gen.graph_slots()
    # The slot counters are derived from ORT's capture rule; the measured evidence that no
    # slot re-captured is the mean steady step time (a capture costs many steps).
    ran = gen.clock.since(before)
    return {
        "tokens": produced,
        "seconds": time.perf_counter() - t0,
        "steps": dict(ran.runs),
        "mean_step_ms": {k: round(ran.seconds[k] * 1e3 / max(1, n), 4) for k, n in ran.runs.items()},
        "restarts": len(restarts),
        "slots_after_warmup": warm,
        "slots_at_end": end,
        "fallbacks": {k: end[k]["fallbacks"] for k in end},
    }


def profile_decode(model, past: int, iters: int = 20) -> dict:
    """GPU time per decode step by kernel family (CUPTI through torch.profiler sees every
    kernel in the process, ORT's included). Run uncaptured so that each kernel is a record, and
    without PDL: a kernel launched early would count its wait for the previous one as its own."""
    with pdl_off():
        return _profile_decode(model, past, iters)


def _profile_decode(model, past: int, iters: int) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile

    gen = model.new_generator()
    for _ in range(3):
        gen.run(DECODE, past, tokens=[1], want_logits=False)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            gen.run(DECODE, past, tokens=[1], want_logits=False)
        torch.cuda.synchronize()
    families: dict[str, float] = {}
    kernels: dict[str, float] = {}
    for event in prof.events():
        if event.device_type != torch.autograd.DeviceType.CUDA:
            continue
        families[kernel_family(event.name)] = families.get(kernel_family(event.name), 0.0) + event.device_time
        kernels[event.name[:90]] = kernels.get(event.name[:90], 0.0) + event.device_time
    top = sorted(kernels.items(), key=lambda kv: -kv[1])[:12]
    return (
        {k: v / iters / 1e3 for k, v in sorted(families.items(), key=lambda kv: -kv[1])},
        [(name, t / iters / 1e3) for name, t in top],
    )


def kernel_family(name: str) -> str:
    low = name.lower()
    rules = [
        ("loopcast", "loopcast custom ops"),
        ("batch_invariant", "loopcast custom ops"),
        ("flash", "attention"),
        ("gemm", "matmul"),
        ("gemv", "matmul"),
        ("xmma", "matmul"),
        ("cutlass", "matmul"),
        ("sm90_", "matmul"),
        ("cublas", "matmul"),
        ("splitk", "matmul"),
        ("norm", "rmsnorm"),
        ("flash", "attention"),
        ("attention", "attention"),
        ("rotary", "attention"),
        ("kv", "attention"),
        ("concat", "attention"),
        ("argmax", "sampling"),
        ("topk", "sampling"),
        ("memcpy", "memcpy"),
    ]
    for key, family in rules:
        if key in low:
            return family
    return "elementwise/other"


# -- orchestration --------------------------------------------------------------------------
