"""``loopcast bench`` on a recurrent-depth (Huginn) checkpoint: plain steps, the pipeline's cycle
and generation at each r (``--loops``), used by bench/harness.py.

Per (dtype, variant, r) one ``VariantResult``:

- steps: ``decode(1)``, a plain step at r (prelude, r core_step calls, coda) at position
  ``past``; ``recurrent_cycle(r)``, one pipeline cycle with all r rows holding lanes (lanes at
  past, past-1, ...). Both timed like the looped kinds (host pushes and the id pull in).
- rows_identical: each cycle's leaving row (its coda logits) against plain decoding's logits at
  the same position, on the oracle pipeline's first prompt: equal bits, or the largest difference.
- end_to_end: plain greedy, the pipeline with prompt lookup (gate auto), and the pipeline with
  *oracle drafts* per ``--oracle-reject`` fraction (bench/pipeline.py ``rejects``: plain greedy's
  continuation replayed, a fixed hash of the position spoiling the chosen fraction). Tokens are
  the pipeline's and are compared with plain's (``divergent_prompts``).
"""

from __future__ import annotations

import functools
import time
from pathlib import Path

import numpy as np
from loopcast.bench.pipeline import random_prompts, rejects

from loopcast.errors import RequestError
from loopcast.vocab import GraphKind, OpSet

RECURRENT_CYCLE = GraphKind.RECURRENT_CYCLE
# default: the row-addressed attention op, whose graphs include the pipeline's recurrent_cycle
# (fp16/bf16 "auto" would be stock); batch-invariant: every hot op from the loopcast library, so
# the cycle's rows are the decode rows bit for bit on CUDA too (exact_verify["cuda"])
RECURRENT_VARIANTS = {
    "stock": OpSet.STOCK,
    "default": OpSet.LOOPCAST_ATTENTION,
    "batch-invariant": OpSet.LOOPCAST,
}


class OracleDrafts:
    """The pipeline's drafts from a known continuation: position q's token, spoiled (+1 mod V)
    where ``rejects(q, fraction)``."""

    def __init__(self, sequence: list[int], fraction: float, vocab: int) -> None:
        self.sequence, self.fraction, self.vocab = sequence, fraction, vocab

    def propose(self, context, k: int) -> list[int]:
        q = len(context)
        if q >= len(self.sequence):
            return []
        truth = self.sequence[q]
        return [(truth + 1) % self.vocab if rejects(q, self.fraction) else truth]


def _generate(gen, prompt, new_tokens: int, r: int, proposer=None, trace=False, **options):
    from loopcast.ort_runtime.decoding.generation_config import GenerationConfig
    from loopcast.ort_runtime.decoding.recurrent_stream import stream_recurrent
    from loopcast.ort_runtime.decoding.stats import GenerationStats

    config = GenerationConfig.from_options(max_new_tokens=new_tokens, stop_ids=(), loops=r, **options)
    gen.rewind(0)
    stats = GenerationStats()
    t0 = time.perf_counter()
    tokens = list(stream_recurrent(gen, prompt, config, stats=stats, proposer=proposer, trace=trace))
    return tokens, stats, time.perf_counter() - t0


def _rows(label_stats: list, plain_seconds: float, plain_tokens: int) -> dict:
    tokens = sum(len(t) for t, _, _, _ in label_stats)
    seconds = sum(s for _, _, s, _ in label_stats)
    proposed = sum(st.proposed for _, st, _, _ in label_stats)
    accepted = sum(st.accepted for _, st, _, _ in label_stats)
    plain_rate = plain_tokens / plain_seconds
    return {
        "tokens_per_s": tokens / seconds,
        "ms_per_token": 1e3 * seconds / tokens,
        "speedup": (tokens / seconds) / plain_rate,
        "tokens": tokens,
        "seconds": seconds,
        "divergent_prompts": sum(not same for _, _, _, same in label_stats),
        "acceptance": accepted / proposed if proposed else None,
        "cycles": sum(st.cycles for _, st, _, _ in label_stats),
        "core_calls_per_token": sum(st.core_passes for _, st, _, _ in label_stats) / tokens,
    }


def _median_ms(fn, iters: int) -> float:
    from loopcast.bench.harness import _median_ms

    return _median_ms(fn, iters, warmup=4)


def recurrent_runs(
    opts, dtype: str, variant: str, checkpoint: Path, log=print, quantize: str = "none"
) -> list:
    """One VariantResult per r of ``opts.loops`` (default: the checkpoint's default r)."""
    from loopcast.bench.harness import StepTimes, VariantResult
    from loopcast.exporter.export import ExportOptions, export_checkpoint
    from loopcast.ort_runtime.binding.recurrent_generator import RecurrentGenerator
    from loopcast.ort_runtime.loading.artifact import open_artifact

    from loopcast.config import load_config
    from loopcast.quant import quant_scheme_from_options

    config = load_config(checkpoint)
    loops = opts.loops or (config.loops_default,)
    prompts = random_prompts(config.vocab_size)
    max_length = min(config.max_position_embeddings, opts.past + 1 + max(config.num_loops, 8))
    past = max_length - config.num_loops - 1
    new_tokens = min(opts.new_tokens, max_length - max(len(p) for p in prompts) - 1)
    scheme = quant_scheme_from_options(None if quantize == "none" else quantize)
    tag = f"{dtype}/{variant}" + ("" if scheme is None else f"/{quantize}")
    art = opts.work_dir / f"art-{checkpoint.name}-{tag.replace('/', '-')}"
    if variant not in RECURRENT_VARIANTS:
        raise RequestError(
            f"--variant {variant}: a recurrent-depth checkpoint is benched with --variant "
            "stock, default (loopcast-attention, with the pipeline) or batch-invariant (every "
            "loopcast op, with the pipeline)"
        )
    ops = RECURRENT_VARIANTS[variant]
    log(f"[{tag}] exporting {checkpoint} into {art} ...")
    t0 = time.perf_counter()
    export_checkpoint(
        checkpoint, art, ExportOptions(dtype, max_length, ops=ops, quantization=scheme), overwrite=True
    )
    export_s = time.perf_counter() - t0
    loaded = open_artifact(art, opts.device, threads=opts.threads)
    gen = RecurrentGenerator(loaded)
    has_cycle = RECURRENT_CYCLE in loaded.manifest.graphs
    captured = RECURRENT_CYCLE in loaded.graph_kinds
    results = []
    for r in loops:
        result = VariantResult(dtype, variant, past, export_s, quantize, loops=r)
        gen.configure(r, None)
        gen.rewind(0)
        gen.step([3 + i % (config.vocab_size - 3) for i in range(past)])

        def plain_step() -> None:
            gen.rewind(past)
            gen.step([5])

        result.steps.append(StepTimes("decode", 1, None, _median_ms(plain_step, opts.iters)))
        if has_cycle:
            R, binding = gen.cycle.rows, gen.cycle
            positions = [past - k if k < r else -1 for k in range(R)]
            zero = np.zeros(config.hidden_size, np.float32)
            cycle = functools.partial(binding.run, 5, r - 1, positions, zero)
            ms = _median_ms(cycle, opts.iters)
            result.steps.append(
                StepTimes(str(RECURRENT_CYCLE), r, ms if captured else None, None if captured else ms)
            )
        log(
            f"  r={r}: "
            + ", ".join(f"{s.kind}({s.rows}) {s.captured_ms or s.uncaptured_ms:.3f} ms" for s in result.steps)
        )
        plain = [_generate(gen, p, new_tokens, r) for p in prompts]
        plain_tokens = sum(len(t) for t, _, _ in plain)
        plain_seconds = sum(s for _, _, s in plain)
        rows = {"plain": _rows([(t, st, s, True) for t, st, s in plain], plain_seconds, plain_tokens)}
        # an artifact whose rows are not bit-identical on this device runs the pipeline with
        # allow_inexact, and its rows count the divergent prompts
        inexact = {"allow_inexact": not loaded.exact_verify}
        if has_cycle:
            runs = [_generate(gen, p, new_tokens, r, speculative="pipeline", **inexact) for p in prompts]
            rows["pipeline prompt-lookup"] = _rows(
                [(t, st, s, t == plain[i][0]) for i, (t, st, s) in enumerate(runs)],
                plain_seconds,
                plain_tokens,
            )
            for fraction in opts.oracle_rejects:
                runs = []
                for i, p in enumerate(prompts):
                    drafts = OracleDrafts(p + plain[i][0], fraction, config.vocab_size)
                    t, st, s = _generate(
                        gen, p, new_tokens, r, drafts, speculative="pipeline", gate="always", **inexact
                    )
                    runs.append((t, st, s, t == plain[i][0]))
                rows[f"pipeline oracle {100 * (1 - fraction):.0f}%"] = _rows(
                    runs, plain_seconds, plain_tokens
                )
            result.rows_identical = _leaving_rows_identical(
                gen, prompts[0], plain[0][0], new_tokens, r, inexact
            )
        if opts.kl_threshold is not None:
            vocab, baseline = config.vocab_size, (plain_seconds, plain_tokens)
            rows |= _kl_rows(gen, prompts, new_tokens, r, opts, has_cycle, inexact, vocab, baseline)
        for name, entry in rows.items():
            log(
                f"  r={r} {name}: {entry['ms_per_token']:.3f} ms/token (x{entry['speedup']:.2f}), "
                f"divergent prompts {entry['divergent_prompts']}"
            )
        result.end_to_end = rows
        results.append(result)
    return results


def _kl_rows(
    gen, prompts, new_tokens: int, r: int, opts, has_cycle: bool, inexact, vocab: int, baseline
) -> dict:
    """Plain decoding with the KL exit (kv_policy full; its ratio against plain decoding without
    it, ``baseline`` = (seconds, tokens)) and the pipeline's oracle rows at that exit (their
    ratios and divergent prompts against the KL plain row: its tokens and each token's exit)."""
    kl = {"kl_threshold": opts.kl_threshold}
    plain = [_generate(gen, p, new_tokens, r, **kl) for p in prompts]
    tokens, seconds = sum(len(t) for t, _, _ in plain), sum(s for _, _, s in plain)
    rows = {"plain KL": _rows([(t, st, s, True) for t, st, s in plain], *baseline)}
    rows["plain KL"]["mean_loops"] = sum(st.mean_loops * len(t) for t, st, _ in plain) / tokens
    for fraction in opts.oracle_rejects if has_cycle else ():
        runs = []
        for i, p in enumerate(prompts):
            drafts = OracleDrafts(p + plain[i][0], fraction, vocab)
            t, st, s = _generate(
                gen, p, new_tokens, r, drafts, speculative="pipeline", gate="always", **kl, **inexact
            )
            same = t == plain[i][0] and st.exit_histogram == plain[i][1].exit_histogram
            runs.append((t, st, s, same))
        rows[f"pipeline KL oracle {100 * (1 - fraction):.0f}% (x plain KL)"] = _rows(runs, seconds, tokens)
    return rows


def _leaving_rows_identical(
    gen, prompt: list[int], want: list[int], new_tokens: int, r: int, inexact
) -> dict:
    """The pipeline's leaving rows (oracle drafts, full acceptance) against plain decoding's
    one-row coda logits at the same positions."""
    gen.rewind(0)
    gen.configure(r, None)
    _, logits = gen.greedy(prompt, new_tokens)
    _, stats, _ = _generate(
        gen,
        prompt,
        new_tokens,
        r,
        OracleDrafts(prompt + want, 0.0, 1 << 30),
        True,
        speculative="pipeline",
        gate="always",
        **inexact,
    )
    same, rows, worst = 0, 0, 0.0
    for positions, _, _, row_logits in stats.pipeline_trace:
        p = positions[r - 1]
        if p < 0:
            continue
        ref = logits[p + 1 - len(prompt)]
        rows += 1
        same += bool(np.array_equal(row_logits, ref))
        worst = max(worst, float(np.max(np.abs(row_logits - ref))))
    return {"rows": rows, "bit_identical_rows": same, "max_abs_diff": worst}
