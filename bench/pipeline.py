"""Benchmark rows of the pipeline strategy (ort_runtime/decoding/pipeline.py), used by ``loopcast bench``.

- ``cycle_ms``: the cycle step, timed like the other kinds (host pushes and the id pull in).
- ``oracle_rows``: the pipeline with *oracle drafts*: the drafts hook replays plain greedy's
  continuation of each prompt and spoils a chosen fraction of positions (a fixed hash of the
  position, so every run rejects the same ones). This isolates the schedule's cost from the
  model's draft quality: a random-weight checkpoint drafts nothing useful by itself. Tokens are
  still the verifier's and are compared with plain greedy.
"""

from __future__ import annotations

import time

import numpy as np

from loopcast.manifest import CYCLE, PREFILL


def cycle_ms(model, kind: str, past: int, iters: int) -> tuple[float, dict | None]:
    """Median wall time of one cycle with every row active (lanes at past, past-1, ...), and the
    generator's graph-slot counters of the two cycle halves (None: not captured)."""
    from loopcast.bench.harness import _median_ms

    gen = model.new_generator()
    R = gen.cycle.rows
    positions = [past - r for r in range(R)]
    ms = _median_ms(lambda: gen.run_cycle(1, positions), iters, warmup=4)
    slots = [v for k, v in gen.graph_slots().items() if k.startswith(CYCLE)]
    # One slot's counters stand for the kind (both halves capture once and replay alike).
    return ms, (slots[0] if slots else None)


def rejects(position: int, fraction: float) -> bool:
    """The fixed pseudo-random set of positions whose oracle draft is spoiled."""
    return ((position * 0x9E3779B1) & 0xFFFF) / 65536.0 < fraction


def oracle_rows(
    model,
    prompts: list[list[int]],
    plain: dict[int, list[int]],
    new_tokens: int,
    fractions: tuple[float, ...],
) -> dict:
    """Per rejected fraction: ms per committed token, tokens/s, core calls per token, acceptance."""
    from loopcast.ort_runtime.decoding.generation_config import GenerationConfig
    from loopcast.ort_runtime.decoding.pipeline import ExitDrafts
    from loopcast.ort_runtime.decoding.speculate import GenerationStats, stream

    gen = model.new_generator()
    vocab = model.config.vocab_size
    rows = {}
    for fraction in fractions:
        tokens, seconds, divergent, proposed, accepted, cycles, passes = 0, 0.0, 0, 0, 0, 0, 0.0
        exec_s = 0.0  # time inside the cycle runs (the session call: replay and sync on CUDA)
        cycle_wall = 0.0  # the generation's time without its prefill
        for i, prompt in enumerate(prompts):
            sequence = prompt + plain[i]

            def hook(position: int, draft: int, sequence=sequence, fraction=fraction) -> int:
                truth = sequence[position] if position < len(sequence) else draft
                return (truth + 1) % vocab if rejects(position, fraction) else truth

            warm = GenerationConfig.from_options(
                max_new_tokens=8, stop_ids=(), speculative="pipeline", gate="always"
            )
            config = warm.replace(max_new_tokens=new_tokens)
            gen.rewind(0)
            list(stream(gen, prompt, warm, proposer=ExitDrafts(hook)))  # warm both cycle halves
            gen.rewind(0)
            stats = GenerationStats()
            before = gen.clock.seconds(CYCLE)
            prefill = gen.clock.seconds(PREFILL)
            t0 = time.perf_counter()
            out = list(stream(gen, prompt, config, stats=stats, proposer=ExitDrafts(hook)))
            seconds += time.perf_counter() - t0
            exec_s += gen.clock.seconds(CYCLE) - before
            cycle_wall += time.perf_counter() - t0 - (gen.clock.seconds(PREFILL) - prefill)
            tokens += len(out)
            divergent += out != plain[i][: len(out)]
            proposed += stats.proposed
            accepted += stats.accepted
            cycles += stats.cycles
            passes += stats.core_calls_per_token * len(out)
        rows[f"pipeline oracle {100 * (1 - fraction):.0f}%"] = {
            "tokens_per_s": tokens / seconds,
            "ms_per_token": 1e3 * seconds / tokens,
            "tokens": tokens,
            "seconds": seconds,
            "divergent_prompts": divergent,
            "rejected_fraction": fraction,
            "acceptance": accepted / proposed if proposed else None,
            "cycles": cycles,
            "core_calls_per_token": passes / tokens,
            "gate": "always",
            "gate_reasons": [],
            # Host work per cycle (the input push, the id pull, the scheduler, the engine) as a
            # share of the generation's wall time without its prefill.
            "cycle_run_ms": 1e3 * exec_s / cycles if cycles else None,
            "host_share": 1 - exec_s / cycle_wall if cycle_wall else None,
        }
    return rows


def random_prompts(vocab: int, count: int = 4, length: int = 24) -> list[list[int]]:
    rng = np.random.default_rng(0)
    return [rng.integers(3, vocab, length).tolist() for _ in range(count)]
