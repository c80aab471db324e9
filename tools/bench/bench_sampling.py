"""Host cost per token of sampling (probabilities + sample) against a decode step.

    python -m tools.bench.bench_sampling            # prints a markdown table (docs/sampling.md)

Times ``probabilities`` + ``sample`` on float32 logits rows of V = 32000, 49152 and 128256 for several
settings (median of 200 draws; numpy runs these ops on one thread), and the demo artifact's decode
step on the same machine for scale.
"""

from __future__ import annotations

import statistics
import time

import numpy as np
from loopcast.ort_runtime.decoding.sampling import SamplingParams, make_rng, probabilities, sample

VOCABS = (32000, 49152, 128256)  # Llama 2 / Mistral, Ouro, Llama 3
SETTINGS = {
    "temperature 0.8": SamplingParams(temperature=0.8),
    "top-k 50": SamplingParams(temperature=0.8, top_k=50),
    "top-p 0.9": SamplingParams(temperature=0.8, top_p=0.9),
    "min-p 0.05": SamplingParams(temperature=0.8, min_p=0.05),
    "rep. penalty 1.1 (1024-token context)": SamplingParams(temperature=0.8, repetition_penalty=1.1),
    "all of the above": SamplingParams(
        temperature=0.8, top_k=50, top_p=0.9, min_p=0.05, repetition_penalty=1.1
    ),
}


def time_sampling(vocab: int, params: SamplingParams, repeats: int = 200) -> float:
    rng = np.random.default_rng(0)
    # Gaussian logits (std 3): flatter than a trained model's rows, so top-p often needs more
    # than its first 1024 candidates here — a pessimistic case for top-p.
    rows = (rng.standard_normal((8, vocab)) * 3).astype(np.float32)
    context = rng.integers(0, vocab, 1024)
    draw = make_rng(SamplingParams(seed=0))
    times = []
    for i in range(repeats):
        t0 = time.perf_counter()
        sample(probabilities(rows[i % 8], params, context), draw)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def time_decode(steps: int = 64) -> float:
    from loopcast.exporter.demo_artifact import demo_artifact_dir
    from loopcast.ort_runtime import load

    model = load(demo_artifact_dir())
    gen = model.new_generator()
    token = gen.prefill(model.encode("def main():\n"))
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        token = gen.decode(token)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    decode = time_decode()
    print(f"demo artifact decode step (V = 4096): {decode * 1e3:.2f} ms median\n")
    print("| setting | " + " | ".join(f"V = {v}" for v in VOCABS) + " |")
    print("|---|" + "---|" * len(VOCABS))
    for name, params in SETTINGS.items():
        cells = " | ".join(f"{time_sampling(v, params) * 1e3:.2f} ms" for v in VOCABS)
        print(f"| {name} | {cells} |")


if __name__ == "__main__":
    main()
