"""Measure whether an artifact's verify rows are its decode rows, bit for bit, on the CPU.

The exporter runs this on every fp32 artifact it writes and records the answer in the
manifest (``exact_verify["cpu"]``), so the runtime knows, rather than hopes, that speculation
returns plain greedy's tokens there. For CUDA the answer is declared by the op set (the
loopcast kernels are row-invariant by construction and tested on the GPU; cuBLAS and
GroupQueryAttention are not).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from loopcast.manifest import (
    CYCLE,
    DECODE,
    DRAFT,
    PREFILL,
    TREE_DRAFT,
    TREE_KINDS,
    TREE_TAIL,
    VERIFY,
    VERIFY_TAIL,
)


def decode_rows(gen, prompt: list[int], steps: int) -> tuple[list[int], list[np.ndarray]]:
    """Prefill ``prompt`` on ``gen``, then plain M=1 greedy decode for ``steps`` steps: the fed
    tokens and a copy of each step's logits row (the rows a verify step must reproduce)."""
    pending = gen.prefill(prompt)
    fed, rows = [], []
    for _ in range(steps):
        out = gen.run(DECODE, gen.n, tokens=[pending])
        fed.append(pending)
        rows.append(out.logits[0].copy())
        gen.commit([pending])
        pending = int(out.next_ids[0])
    return fed, rows


def rows_match_on_cpu(
    artifact_dir: str | Path, *, prompt_lengths: tuple[int, ...] = (1, 11), seed: int = 0
) -> bool:
    """Run ``verify`` (and ``draft`` + ``verify_tail``) over tokens that plain decode fed, and
    compare every row's logits with decode's bit for bit, on random prompts of a few lengths."""
    from loopcast.ort_runtime.binding.generator import Generator
    from loopcast.ort_runtime.loading.artifact import open_artifact

    from loopcast.manifest import Manifest

    if Manifest.read(Path(artifact_dir)).config.recurrent_depth:
        return _recurrent_rows_match(artifact_dir, prompt_lengths, seed)
    model = open_artifact(
        artifact_dir,
        "cpu",
        kinds=tuple(
            k
            for k in (PREFILL, DECODE, VERIFY, DRAFT, VERIFY_TAIL, CYCLE, *TREE_KINDS)
            if k in _kinds(artifact_dir)
        ),
    )
    if VERIFY not in model.sessions:
        return True  # nothing to verify with: speculation is not offered
    width = model.manifest.graphs[VERIFY].rows
    rng = np.random.default_rng(seed)
    # One generator for every check: each check rewinds to the prompt and rewrites the KV past
    # it before any row reads it (docs/architecture.md §2), as speculation itself does, and a
    # generator's KV buffers (94 MiB at 135M / 2048 positions) are made once, not per check.
    gen = Generator(model)
    for length in prompt_lengths:
        if length + width + 1 > model.manifest.max_length:
            continue
        prompt = rng.integers(0, model.config.vocab_size, length).tolist()
        gen.rewind(0)
        fed, rows = decode_rows(gen, prompt, width)
        gen.rewind(length)
        out = gen.run(VERIFY, gen.n, tokens=fed)
        if any(not np.array_equal(out.logits[i], rows[i]) for i in range(width)):
            return False
        # A variable-rows verify (the CPU) runs rounds of any row count: each must give them too.
        counts = range(2, width) if gen.variable_rows(VERIFY) else ()
        for m in counts:
            out = gen.run(VERIFY, gen.n, tokens=fed[:m])
            if any(not np.array_equal(out.logits[i], rows[i]) for i in range(m)):
                return False
        if DRAFT in model.sessions and VERIFY_TAIL in model.sessions:
            tail_rows = model.manifest.graphs[VERIFY_TAIL].rows
            hidden = [
                gen.run(DRAFT, gen.n + i, tokens=[t], want_logits=False).hidden[0]
                for i, t in enumerate(fed[:tail_rows])
            ]
            out = gen.run(VERIFY_TAIL, gen.n, hidden=np.stack(hidden))
            if any(not np.array_equal(out.logits[i], rows[i]) for i in range(len(hidden))):
                return False
        if CYCLE in model.sessions and not cycle_rows_match(Generator(model), prompt, fed, rows):
            return False
        if TREE_TAIL in model.sessions and not tree_rows_match(gen, fed, rows):
            return False
    return True


def tree_rows_match(gen, fed: list[int], rows: list[np.ndarray]) -> bool:
    """Tree verify after the prompt (``gen.n``): a primary chain that agrees with ``fed`` only
    at its first token, and a branch carrying ``fed[1:]`` at scratch positions past it with the
    primary's other rows masked. The primary's first row and every branch row must be decode's
    rows bit for bit (each branch row at its logical position)."""
    n, width, vocab = gen.n, gen.rows(TREE_TAIL), gen.model.config.vocab_size
    primary = width // 2 + 1  # rows n..n+primary-1; the branch takes the rest
    branch = min(width - primary, primary - 1, len(fed) - 1)
    tokens = [fed[0]] + [(t + 1) % vocab for t in fed[1:primary]]
    addresses = [(n + i, 0, 0) for i in range(primary)]
    addresses += [(n + primary + j, n + 1, n + primary) for j in range(branch)]
    hidden = [
        gen.run_rows(TREE_DRAFT, [a], tokens=[t]).hidden[0]
        for a, t in zip(addresses, tokens + fed[1 : 1 + branch])
    ]
    out = gen.run_rows(TREE_TAIL, addresses, hidden=np.stack(hidden), want_logits=True)
    return np.array_equal(out.logits[0], rows[0]) and all(
        np.array_equal(out.logits[primary + j], rows[1 + j]) for j in range(branch)
    )


def cycle_rows_match(gen, prompt: list[int], fed: list[int], rows: list[np.ndarray]) -> bool:
    """Teacher-forced lanes through the cycle graph: the lane of ``fed[i]`` enters at cycle i
    and finishes loop R at cycle i + R - 1, where its row must be decode's row bit for bit."""
    R = gen.cycle.rows
    gen.prefill(prompt)
    n0 = gen.n
    for c in range(len(fed) + R - 1):
        positions = [n0 + c - r if 0 <= c - r < len(fed) else -1 for r in range(R)]
        gen.run_cycle(fed[c] if c < len(fed) else 0, positions)
        i = c - R + 1
        if i >= 0 and not np.array_equal(gen.cycle.logits.pull()[0, R - 1], rows[i]):
            return False
    return True


def _kinds(artifact_dir: str | Path) -> set[str]:
    from loopcast.manifest import Manifest

    return set(Manifest.read(Path(artifact_dir)).graphs)


def _recurrent_rows_match(artifact_dir, prompt_lengths: tuple[int, ...], seed: int, width: int = 5) -> bool:
    """A recurrent-depth artifact's M-row call (what self-speculation verifies with) against its
    one-row calls (plain decoding), bit for bit, at two core steps (every kernel of every step)."""
    from loopcast.ort_runtime.binding.recurrent_generator import RecurrentGenerator
    from loopcast.ort_runtime.loading.artifact import open_artifact

    loaded = open_artifact(artifact_dir, "cpu")
    steps = min(2, loaded.config.num_loops)
    gen = RecurrentGenerator(loaded, loops=steps, max_loops=steps, state_seed=seed)  # KV for 2 steps
    rng = np.random.default_rng(seed)
    for length in prompt_lengths:
        if length + width + 1 > loaded.manifest.max_length:
            continue
        prompt = rng.integers(0, loaded.config.vocab_size, length).tolist()
        fed = rng.integers(0, loaded.config.vocab_size, width).tolist()
        gen.rewind(0)
        gen.step(prompt)
        rows = [gen.step([t]).logits[0] for t in fed]
        gen.rewind(length)
        out = gen.step(fed)
        if any(not np.array_equal(out.logits[i], rows[i]) for i in range(width)):
            return False
    return True
