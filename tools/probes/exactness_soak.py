"""Exactness soak: every speculative mode, gate and forced-rejection proposer against plain
greedy, sequentially and from several threads sharing one loaded model; counts mismatches.

    python -m tools.probes.exactness_soak [--tokens 96] [--threads 4] [--out soak.json]

Artifacts (ARTIFACTS): the demo model, float and quantized to int4 (stock MatMulNBits and the
loopcast op set), and two random tiny checkpoints (a looped Ouro shape and a Llama shape), each
exported exact on the CPU. A run is one (artifact, prompt,
mode, gate, proposer); it mismatches when its tokens differ from plain greedy of the same
artifact. Exit status 1 on any mismatch. Needs the `test` extra (torch for the random
checkpoints) and the custom-op library (tools/c_generate/fetch_deps.sh).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
from loopcast.bench.harness import BENCH_PROMPTS
from loopcast.exporter.export import ExportOptions, export_checkpoint
from loopcast.exporter.random_checkpoint import write_random_checkpoint
from loopcast.ort_runtime import load
from loopcast.ort_runtime.decoding.proposers import SelfDraftProposer

from loopcast.presets import PRESETS
from loopcast.quant import QuantScheme, WeightFormat

GATES = ("always", "auto", "hit-density", "cost")
# The artifacts soaked: (name, checkpoint, export options); the quantized demo twice, with the
# stock MatMulNBits default (int4 block 32, accuracy level 4: row-invariant) and with the loopcast
# op set's BatchInvariantMatMulNBits (asymmetric int4 block 128, int8 head).
ARTIFACTS = (
    ("demo", "demo", ExportOptions(max_length=512)),
    ("demo-int4", "demo", ExportOptions(max_length=512, quantization=QuantScheme(WeightFormat.INT4))),
    (
        "demo-int4-loopcast-ops",
        "demo",
        ExportOptions(
            max_length=512,
            ops="loopcast",
            quantization=QuantScheme(WeightFormat.INT4, 128, False, WeightFormat.INT8),
        ),
    ),
    ("tiny-ouro", "tiny-ouro", ExportOptions()),
    ("tiny-llama", "tiny-llama", ExportOptions()),
)


class _Spoiling:
    """Knows the plain continuation and spoils every ``period``-th draft (forced rejections)."""

    name = "spoiling"

    def __init__(self, sequence: list[int], vocab: int, period: int) -> None:
        self.sequence, self.vocab, self.period = sequence, vocab, period

    def propose(self, context: list[int], k: int) -> list[int]:
        truth = self.sequence[len(context) : len(context) + k]
        return [
            (t + 1) % self.vocab if (len(context) + i) % self.period == 0 else t for i, t in enumerate(truth)
        ]


def _runs(model, prompt: list[int], plain: list[int]) -> list[tuple[str, dict]]:
    vocab, looped = model.config.vocab_size, model.loaded.has("draft")
    runs = [(f"prompt-lookup/{g}", {"speculative": "prompt-lookup", "gate": g}) for g in GATES]
    runs += [
        (
            f"custom-spoil{p}",
            {"speculative": "custom", "gate": "always", "proposer": _Spoiling(prompt + plain, vocab, p)},
        )
        for p in (1, 2, 5)
    ]
    if looped:
        runs += [(f"self/{g}", {"speculative": "self", "gate": g}) for g in GATES]
        if model.loaded.has("cycle"):
            runs += [(f"pipeline/{g}", {"speculative": "pipeline", "gate": g}) for g in ("always", "auto")]
        runs += [
            (
                "self-perturbed",
                {
                    "speculative": "self",
                    "gate": "always",
                    "proposer": SelfDraftProposer(lambda i, t: t if i % 2 else (t + 3) % vocab),
                },
            )
        ]
    return runs


def soak(name: str, path: Path, prompts: list[list[int]], tokens: int, threads: int) -> dict:
    model = load(path)
    assert model.loaded.exact_verify, f"{name}: the artifact is not exact on the CPU"
    plain = {i: model.generate(p, tokens, stop_ids=()).tokens for i, p in enumerate(prompts)}
    jobs = [(i, label, kwargs) for i, p in enumerate(prompts) for label, kwargs in _runs(model, p, plain[i])]

    def one(job):
        i, label, kwargs = job
        out = model.generate(prompts[i], tokens, stop_ids=(), **kwargs)
        first = next((j for j, (a, b) in enumerate(zip(out.tokens, plain[i])) if a != b), None)
        if first is None and len(out.tokens) != len(plain[i]):
            first = min(len(out.tokens), len(plain[i]))
        return {
            "prompt": i,
            "run": label,
            "mismatch_at": first,
            "rounds": out.stats.rounds,
            "accepted": out.stats.accepted,
            "proposed": out.stats.proposed,
        }

    sequential = [one(job) for job in jobs]
    with ThreadPoolExecutor(threads) as pool:
        threaded = list(pool.map(one, jobs))
    results = sequential + threaded
    bad = [r for r in results if r["mismatch_at"] is not None]
    return {
        "artifact": name,
        "runs": len(results),
        "tokens_per_run": tokens,
        "mismatches": len(bad),
        "first_mismatches": bad[:5],
        "rounds": sum(r["rounds"] for r in results),
        "accepted": sum(r["accepted"] for r in results),
        "proposed": sum(r["proposed"] for r in results),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--threads", type=int, default=4)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="loopcast-soak-"))
    rng = np.random.default_rng(7)
    reports, start = [], time.perf_counter()
    for name, preset, options in ARTIFACTS:
        source = (
            "demo"
            if preset == "demo"
            else write_random_checkpoint(PRESETS[preset], work / f"ckpt-{name}", seed=3, std=0.15)
        )
        art = work / f"art-{name}"
        export_checkpoint(source, art, options)
        if preset == "demo":
            model = load(art)
            prompts = [model.encode(p) for p in BENCH_PROMPTS]
        else:
            vocab = PRESETS[name].vocab_size
            motif = rng.integers(0, vocab, 5).tolist()
            prompts = [rng.integers(0, vocab, n).tolist() for n in (3, 9)] + [motif * 3]
        reports.append(soak(name, art, prompts, args.tokens, args.threads))
        r = reports[-1]
        print(
            f"{name}: {r['runs']} runs x {args.tokens} tokens, mismatches {r['mismatches']}, "
            f"drafts accepted {r['accepted']}/{r['proposed']} in {r['rounds']} rounds",
            flush=True,
        )
    total = sum(r["mismatches"] for r in reports)
    print(
        f"total: {sum(r['runs'] for r in reports)} runs, {total} mismatches, "
        f"{time.perf_counter() - start:.0f} s"
    )
    if args.out:
        args.out.write_text(json.dumps(reports, indent=1) + "\n")
    return 1 if total else 0


if __name__ == "__main__":
    sys.exit(main())
