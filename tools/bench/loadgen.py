"""Load generator for the serving path (docs/serving.md, docs/perf.md "Serving").

Closed loop, bounded, loopback only: C clients each send a request, wait for its last token, and
send the next, until the level's request budget (``--requests``, at least 2 per client, or
``--requests-per-client``: the same work in every mode) or its time limit is spent. Each level
runs the batched engine (continuous batching over decode_batch) and the one-sequence-at-a-time
engine (one Generator, the captured single-sequence decode on CUDA) on the same prompts, and
reports aggregate tokens/s, per-token latency (the gaps between a request's consecutive tokens)
p50/p99, time to first token p50/p99, and whether the two modes
produced the same greedy tokens for every request.

    python -m tools.bench.loadgen ART --concurrency 1,4,16,64        # an artifact with --max-batch
    python -m tools.bench.loadgen preset:ouro-1.4b --device cuda --dtype fp16 --max-batch 64 --out r.json
    python -m tools.bench.loadgen ART --via http                     # through loopcast serve's app

``--via engine`` (default) drives the engines in-process; ``--via http`` starts the FastAPI app
on 127.0.0.1 (a free port, nothing else is ever contacted) and streams through it, timing SSE
chunks (a chunk is about one token). Prompts are random token ids (seeded); EOS is ignored so
every request generates ``--max-tokens``.

The batching engine's prompt handling: ``--prefill-chunk N`` (0: whole prompts) and
``--no-prefix-caching``; ``--shared-prefix N`` starts every prompt with the same N tokens (a
system prompt), and ``--multi-turn`` sends each request's second turn (its prompt, its answer and
``--prompt-len`` new tokens) after the first and reports both turns' TTFT and the cached tokens:

    python -m tools.bench.loadgen ART --modes batched --concurrency 4 --multi-turn --shared-prefix 64

``--speculative none,self,prompt-lookup`` runs every engine once per speculative mode (the
request's ``speculative`` field; a mode the engine does not serve is skipped with a line); each
run is reported as ENGINE+MODE and every run's greedy tokens are checked against the others
(sequential+none is ``loopcast generate`` of each prompt alone):

    python -m tools.bench.loadgen ART --modes batched,sequential --speculative none,self --concurrency 16

``--oracle-reject F`` feeds the batching engine's self and pipeline drafts from each prompt's
plain greedy continuation (computed first, alone), spoiling the fixed pseudo-random fraction F
of positions (bench/pipeline.py ``rejects``; 0.08: 92 % of drafts right): a random-weight
checkpoint drafts nothing useful by itself, so this prices the schedule alone. Tokens are still
the verifier's and are cross-checked. ``--gate always`` engages every speculative step instead
of the cost gate (``BatchCostGate``):

    python -m tools.bench.loadgen preset:ouro-1.4b --device cuda --dtype fp16 --modes batched \
        --speculative none,pipeline --oracle-reject 0.08 --concurrency 1,4,8,32
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import threading
import time
from datetime import UTC, datetime
from pathlib import Path

import numpy as np

from tools.bench.loadgen_report import GcPauses, stall_line, stalls, timing_line

# R=1 Llama of Ouro-1.4B's shape: 1.43B parameters (untied head), the comparison model.
LLAMA_143B = dict(model_type="llama", num_loops=1)


def prepare(source: str, device: str, dtype: str, max_batch: int, max_length: int, work: Path) -> Path:
    """An artifact with batched graphs: ``source`` itself, or a random checkpoint of a preset exported."""
    if not source.startswith("preset:"):
        return Path(source)
    from loopcast.exporter.checkpoint import DTYPES
    from loopcast.exporter.export import ExportOptions, export_checkpoint
    from loopcast.exporter.random_checkpoint import write_random_checkpoint

    from loopcast.presets import PRESETS

    name = source.split(":", 1)[1]
    config = PRESETS["ouro-1.4b"].replace(**LLAMA_143B) if name == "llama-1.43b" else PRESETS[name]
    ckpt = work / f"ckpt-{name}-{dtype}"
    if not (ckpt / "config.json").is_file():
        write_random_checkpoint(config, ckpt, seed=0, dtype=DTYPES[dtype])
    art = work / f"art-{name}-{dtype}-{device}-b{max_batch}-L{max_length}"
    if not (art / "manifest.json").is_file():
        export_checkpoint(
            ckpt,
            art,
            ExportOptions(dtype, max_length, batch_invariant=device == "cuda", max_batch=max_batch),
            overwrite=True,
        )
    return art


def prompts(n: int, length: int, vocab: int, seed: int = 0, shared: int = 0) -> list[list[int]]:
    """``n`` random prompts of ``shared`` common tokens (the same for every seed) and ``length`` own."""
    stem = np.random.default_rng(12345).integers(3, vocab, shared).tolist()
    rng = np.random.default_rng(seed)
    return [stem + rng.integers(3, vocab, length).tolist() for _ in range(n)]


def _percentiles(values: list[float]) -> tuple[float | None, float | None]:
    if not values:
        return None, None
    return float(np.percentile(values, 50)), float(np.percentile(values, 99))


def level_requests(args, clients: int) -> int:
    """A level's request count: --requests-per-client times the clients, else --requests, else
    two a client (at least 8)."""
    if args.requests_per_client:
        return args.requests_per_client * clients
    return args.requests or max(8, 2 * clients)


def run_level(
    submit,
    work: list[list[int]],
    clients: int,
    max_tokens: int,
    time_limit: float,
    second_turn: list[list[int]] | None = None,
) -> dict:
    """C closed-loop clients over ``work``;
    ``submit(ids, max_tokens) -> (tokens, submit_time, token_times, cached_tokens)``. With
    ``second_turn`` each request is followed by its second turn: its prompt, its answer and
    ``second_turn[i]``; the level then reports both turns' TTFT and the second turns' cached tokens."""
    lock, next_index = threading.Lock(), [0]
    results: dict[int, tuple] = {}
    turns: dict[int, tuple] = {}
    start = time.perf_counter()

    def client() -> None:
        while True:
            with lock:
                i = next_index[0]
                if i >= len(work) or time.perf_counter() - start > time_limit:
                    return
                next_index[0] += 1
            results[i] = submit(work[i], max_tokens)
            if second_turn is not None:
                turns[i] = submit(work[i] + list(results[i][0]) + second_turn[i], max_tokens)

    threads = [threading.Thread(target=client) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    done = list(results.values()) + list(turns.values())
    gaps = [b - a for _, _, times, _ in done for a, b in zip(times, times[1:])]
    ttft = [times[0] - t0 for _, t0, times, _ in results.values() if times]
    tokens = sum(len(toks) for toks, _, _, _ in done)
    p50, p99 = _percentiles(gaps)
    f50, f99 = _percentiles(ttft)
    extra = {}
    if second_turn is not None:
        t50, t99 = _percentiles([times[0] - t0 for _, t0, times, _ in turns.values() if times])
        extra = {
            "second_turn_ttft_ms_p50": t50 and t50 * 1e3,
            "second_turn_ttft_ms_p99": t99 and t99 * 1e3,
            "second_turn_cached_tokens_mean": float(np.mean([c for *_, c in turns.values()] or [0])),
            "second_turn_prompt_tokens_mean": float(
                np.mean([len(work[i]) + len(results[i][0]) + len(second_turn[i]) for i in turns] or [0])
            ),
        }
    return {
        "clients": clients,
        "requests": len(results),
        "tokens": tokens,
        "seconds": wall,
        "tokens_per_s": tokens / wall if wall > 0 else 0.0,
        "token_latency_ms_p50": p50 and p50 * 1e3,
        "token_latency_ms_p99": p99 and p99 * 1e3,
        # the tail's shape: a stall of a few steps shows as p95 ~ p50 with p99 and max far above
        "token_latency_ms_p90": float(np.percentile(gaps, 90)) * 1e3 if gaps else None,
        "token_latency_ms_p95": float(np.percentile(gaps, 95)) * 1e3 if gaps else None,
        "token_latency_ms_max": max(gaps) * 1e3 if gaps else None,
        "ttft_ms_p50": f50 and f50 * 1e3,
        "ttft_ms_p99": f99 and f99 * 1e3,
        "outputs": {i: toks for i, (toks, _, _, _) in results.items()},
        "second_outputs": {i: toks for i, (toks, _, _, _) in turns.items()},
        **extra,
    }


class OracleDrafts:
    """``self_perturb`` for the batching engine: the draft after ``sequence`` is plain greedy's
    token there (spoiled at the positions ``rejects`` picks), for the prompts it was given.
    ``engine``: a plain batching engine that decodes the continuations all at once (its greedy
    tokens are plain greedy's; the runs' cross-check compares them anyway), else one at a time."""

    def __init__(
        self, model, prompt_lists: list[list[int]], max_tokens: int, fraction: float, engine=None
    ) -> None:
        from loopcast.ort_runtime.batching.engine import BatchRequest

        self.fraction, self.vocab = fraction, model.config.vocab_size
        unique = [list(ids) for ids in dict.fromkeys(tuple(ids) for ids in prompt_lists)]
        if engine is None:
            tails = [list(model.stream_ids(ids, max_tokens + 4, stop_ids=())) for ids in unique]
        else:
            done = [engine.submit(BatchRequest(ids, max_tokens + 4, ())) for ids in unique]
            tails = [c.result(1800) for c in done]
        self.full = {tuple(ids): ids + tail for ids, tail in zip(unique, tails)}
        self.prompt_len = {len(k) for k in self.full}

    def __call__(self, sequence: list[int], token: int) -> int:
        from loopcast.bench.pipeline import rejects

        for n in self.prompt_len:
            full = self.full.get(tuple(sequence[:n]))
            if full is not None and len(sequence) < len(full):
                truth = full[len(sequence)]
                return (truth + 1) % self.vocab if rejects(len(sequence), self.fraction) else truth
        return token


def engine_submitter(engine, speculative: str = "none", counts: dict | None = None):
    """``counts``: drafts proposed and accepted over the requests, added up."""
    from loopcast.ort_runtime.batching.engine import BatchRequest
    from loopcast.ort_runtime.decoding.generation_config import GenerationConfig, SpeculationConfig

    config = GenerationConfig(speculation=SpeculationConfig(speculative))

    def submit(ids: list[int], max_tokens: int):
        c = engine.submit(BatchRequest(ids, max_tokens, (), speculative=speculative, config=config))
        tokens = c.result(timeout=600)
        if counts is not None:
            counts["proposed"] = counts.get("proposed", 0) + c.proposed
            counts["accepted"] = counts.get("accepted", 0) + c.accepted
            counts.setdefault("served_by", set()).add(c.speculative)
        return tokens, c.submitted, c.token_times, c.cached_tokens

    return submit


def http_submitter(url: str, model: str, speculative: str = "none"):
    import httpx

    client = httpx.Client(timeout=600, limits=httpx.Limits(max_connections=256))

    def submit(ids: list[int], max_tokens: int):
        body = {
            "model": model,
            "prompt": ids,
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": True,
            "ignore_eos": True,
            "return_token_ids": True,
            "speculative": speculative,
        }
        t0, times, tokens, cached = time.perf_counter(), [], [], 0
        with client.stream("POST", f"{url}/v1/completions", json=body) as r:
            r.raise_for_status()
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                choice = json.loads(line[6:])["choices"][0]
                if choice.get("finish_reason") is None:
                    times.append(time.perf_counter())
                else:
                    tokens = choice.get("token_ids", [])
        return tokens, t0, times, cached  # a stream carries no usage: cached tokens are in /metrics

    return submit


def make_engine(
    model,
    mode: str,
    max_batch: int,
    cuda_graphs: bool = False,
    prefill_chunk: int | None = None,
    prefix_caching: bool = True,
    gate: str = "auto",
    oracle: OracleDrafts | None = None,
    prefill_rows: int | None = None,
):
    from loopcast.ort_runtime.batching.batch_gate import AlwaysBatchGate, BatchCostGate
    from loopcast.ort_runtime.batching.engine import BatchingEngine
    from loopcast.ort_runtime.batching.sequential import SequentialEngine
    from loopcast.ort_runtime.binding.slots import open_batch_slots

    if mode == "batched":
        generator = open_batch_slots(
            model.loaded, max_batch, cuda_graphs=cuda_graphs, prefill_rows=prefill_rows
        )
        options = {} if prefill_chunk is None else {"prefill_chunk": prefill_chunk}
        return BatchingEngine(
            generator,
            gate=AlwaysBatchGate() if gate == "always" else BatchCostGate(),
            max_waiting=4096,
            prefix_caching=prefix_caching,
            self_perturb=oracle,
            **options,
        ).start()
    return SequentialEngine(model, max_waiting=4096).start()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "source", help="an artifact exported with --max-batch, or preset:NAME (ouro-1.4b, llama-1.43b, ...)"
    )
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "fp16", "bf16"])
    ap.add_argument("--max-batch", type=int, default=64, help="slots (presets: exported with it)")
    ap.add_argument("--max-length", type=int, default=512, help="presets: KV capacity")
    ap.add_argument("--concurrency", default="1,4,16,64")
    ap.add_argument("--modes", default="batched,sequential")
    ap.add_argument(
        "--speculative", default="none", help="speculative modes per request, e.g. none,self,prompt-lookup"
    )
    ap.add_argument(
        "--requests", type=int, default=0, help="requests per level (default: 2 per client, >= 8)"
    )
    ap.add_argument(
        "--requests-per-client",
        type=int,
        default=0,
        help="requests per level = this times the level's clients (overrides --requests): every "
        "mode does the same work at each level, so tok/s compare whole levels, not time-limited cuts",
    )
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument(
        "--time-limit", type=float, default=120.0, help="seconds per level before clients stop sending"
    )
    ap.add_argument("--via", default="engine", choices=["engine", "http"])
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--cuda-graphs", action="store_true", help="capture the batched graphs per width (CUDA)")
    ap.add_argument("--prefill-chunk", type=int, default=None, help="batched: prompt tokens per step")
    ap.add_argument(
        "--prefill-rows",
        type=int,
        default=None,
        help="with --cuda-graphs: captured prefill chunks of N tokens",
    )
    ap.add_argument("--no-prefix-caching", action="store_true", help="batched: turn the prefix cache off")
    ap.add_argument("--shared-prefix", type=int, default=0, help="tokens every prompt starts with")
    ap.add_argument("--multi-turn", action="store_true", help="send each request's second turn after it")
    ap.add_argument(
        "--oracle-reject",
        type=float,
        default=None,
        help="batched self/pipeline drafts from plain greedy, this fraction spoiled (0.08: 92%% right)",
    )
    ap.add_argument("--gate", default="auto", choices=["auto", "always"], help="batched speculative steps")
    ap.add_argument("--work-dir", type=Path, default=Path("/tmp/loopcast-loadgen"))
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    if args.oracle_reject is not None and not 0.0 <= args.oracle_reject <= 1.0:
        ap.error("--oracle-reject must be a fraction in [0, 1]")
    if args.prefill_rows is not None and not args.cuda_graphs:
        ap.error("--prefill-rows needs --cuda-graphs (it sizes captured prefill calls)")
    if args.oracle_reject is not None and args.multi_turn:
        ap.error("--oracle-reject covers first turns only: leave out --multi-turn")

    from loopcast.ort_runtime import load

    args.work_dir.mkdir(parents=True, exist_ok=True)
    levels = [int(c) for c in args.concurrency.split(",")]
    art = prepare(args.source, args.device, args.dtype, args.max_batch, args.max_length, args.work_dir)
    model = load(art, args.device, threads=args.threads, spin=False)  # as the server loads it
    max_batch = min(args.max_batch, model.loaded.manifest.max_batch or 1)
    vocab = model.config.vocab_size
    report = {
        "source": args.source,
        "artifact": str(art),
        "device": args.device,
        "dtype": model.loaded.manifest.dtype,
        "op_set": model.loaded.manifest.op_set,
        "max_batch": max_batch,
        "prompt_len": args.prompt_len,
        "shared_prefix": args.shared_prefix,
        "multi_turn": args.multi_turn,
        "max_tokens": args.max_tokens,
        "via": args.via,
        "host": platform.node(),
        "cuda_graphs": args.cuda_graphs,
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "gate": args.gate,
        "oracle_reject": args.oracle_reject,
        "levels": [],
    }
    oracle = None
    if args.oracle_reject is not None:
        everything = [
            p
            for clients in levels
            for p in prompts(level_requests(args, clients), args.prompt_len, vocab, shared=args.shared_prefix)
        ]
        t0 = time.perf_counter()
        plain = (
            make_engine(model, "batched", max_batch, prefix_caching=False)
            if "batched" in args.modes
            else None
        )
        try:
            oracle = OracleDrafts(model, everything, args.max_tokens, args.oracle_reject, plain)
        finally:
            if plain is not None:
                plain.shutdown()
        print(
            f"oracle drafts: plain greedy of {len(oracle.full)} prompts in {time.perf_counter() - t0:.1f} s"
        )
    outputs: dict[tuple[int, int, str], dict[str, list[int]]] = {}  # (level, request, turn)
    caching = not args.no_prefix_caching
    runs = [(mode, spec, caching) for mode in args.modes.split(",") for spec in args.speculative.split(",")]
    if args.multi_turn and caching:
        # the same turns without the cache: the cold TTFT the cached second turns are priced against
        runs += [(mode, spec, False) for mode, spec, _ in runs if mode == "batched"]
    for mode, spec, cached in runs:
        engine = make_engine(
            model,
            mode,
            max_batch,
            args.cuda_graphs,
            args.prefill_chunk,
            cached,
            args.gate,
            oracle,
            args.prefill_rows,
        )
        name = mode if spec == "none" else f"{mode}+{spec}"
        name += "" if cached or mode != "batched" else "-cold"
        if spec not in engine.speculative_modes:
            print(f"{name}: skipped (the {engine.kind} serves {', '.join(engine.speculative_modes)})")
            engine.shutdown()
            continue
        server = None
        counts: dict = {}
        try:
            if args.via == "http":
                from loopcast.serve.launch import background_server
                from loopcast.serve.state import ServingState

                server = background_server(ServingState(model, engine, "loadgen", mode))
                submit = http_submitter(server.__enter__(), "loadgen", spec)
            else:
                submit = engine_submitter(engine, spec, counts)
            submit(prompts(1, args.prompt_len, vocab, seed=99)[0], 4)  # warm-up: first runs stay out
            noted: set[tuple[str, str]] = set()
            gc_pauses = GcPauses()
            for clients in levels:
                n = level_requests(args, clients)
                work = prompts(n, args.prompt_len, vocab, shared=args.shared_prefix)
                second = prompts(n, args.prompt_len, vocab, seed=7) if args.multi_turn else None
                counts.clear()
                before = engine.gen.clock.reading() if mode == "batched" else None
                if mode == "batched":  # this level's worst calls and loop phases only
                    engine.gen.clock.worst.clear()
                    engine.reset_phase_timer()
                gc_pauses.pauses.clear()
                level_start = time.perf_counter()
                level = run_level(submit, work, clients, args.max_tokens, args.time_limit, second)
                for turn in ("outputs", "second_outputs"):
                    for i, toks in level.pop(turn).items():
                        outputs.setdefault((clients, i, turn), {})[name] = toks
                level["mode"], level["speculative"] = name, spec
                level.update(gc_pauses.summary())
                if counts:
                    level["drafts_proposed"] = counts["proposed"]
                    level["drafts_accepted"] = counts["accepted"]
                    level["served_by"] = sorted(counts["served_by"])
                report["levels"].append(level)
                if mode == "batched":
                    cycle = engine.pipeline.cycle if engine.pipeline is not None else None
                    level["captured"] = sorted(engine.gen.captured) + (
                        ["cycle_batch"] if cycle is not None and cycle.captured else []
                    )
                    level["graph_fallbacks"] = dict(engine.gen.graph_fallbacks)
                    level["prefix_caching"] = engine.prefix_caching
                    level["prefill_chunk"] = engine.prefill_chunk
                    level["prefill_rows"] = engine.gen.prefill_rows
                    level["engine_stats"] = dict(engine.stats)
                    level["gate_report"] = engine.gate.report()
                    level["engine_phase_ms"] = {k: round(v, 2) for k, v in engine.phase_ms.items()}
                    level["stalls"] = stalls(engine, level_start, time.perf_counter())
                    ran = engine.gen.clock.since(before)
                    level["graph_runs"] = {k: n for k, n in ran.runs.items() if n}
                    slowest = engine.gen.clock.worst
                    level["graph_ms_worst"] = {k: round(1e3 * v, 2) for k, v in slowest.items()}
                    level["graph_ms_mean"] = {
                        k: round(1e3 * ran.seconds[k] / n, 3) for k, n in ran.runs.items() if n
                    }
                print(
                    f"{name:<22} C={clients:<3} {level['requests']:>4} req "
                    f"{level['tokens_per_s']:8.1f} tok/s  "
                    f"token p50 {level['token_latency_ms_p50'] or 0:7.1f} ms "
                    f"p99 {level['token_latency_ms_p99'] or 0:7.1f} ms  "
                    f"ttft p50 {level['ttft_ms_p50'] or 0:7.1f} ms"
                    + (
                        f"  drafts {counts['accepted']}/{counts['proposed']} accepted"
                        if counts.get("proposed")
                        else ""
                    )
                    + (
                        f"  2nd turn ttft p50 {level['second_turn_ttft_ms_p50'] or 0:7.1f} ms, "
                        f"cached {level['second_turn_cached_tokens_mean']:.0f}/"
                        f"{level['second_turn_prompt_tokens_mean']:.0f} tokens"
                        if args.multi_turn
                        else ""
                    ),
                    flush=True,
                )
                if level.get("graph_runs"):
                    print(timing_line(level), flush=True)
                    print(stall_line(level["stalls"]), flush=True)
                for kind, why in level.get("graph_fallbacks", {}).items():
                    if (name, kind) not in noted:  # once a run: a kind that runs uncaptured
                        noted.add((name, kind))
                        print(f"  {kind} runs uncaptured: {str(why).splitlines()[0][:200]}", flush=True)
        finally:
            if server is not None:
                server.__exit__(None, None, None)
            engine.shutdown()
    if args.multi_turn:
        for clients in levels:
            at = [lv for lv in report["levels"] if lv["clients"] == clients]
            ttft = {lv["mode"]: lv["second_turn_ttft_ms_p50"] for lv in at}
            for name, value in ttft.items():
                cold = ttft.get(f"{name}-cold")
                if cold and value is not None:
                    ratios = report.setdefault("second_turn_ttft_cached_over_cold", {})
                    ratios[f"{name} C={clients}"] = value / cold
                    print(f"C={clients}: {name} 2nd turn ttft p50 cached / cold = {value / cold:.2f}x")
    both = [v for v in outputs.values() if len(v) > 1]
    report["compared_requests"] = len(both)
    report["mismatched_requests"] = sum(len({tuple(t) for t in v.values()}) > 1 for v in both)
    for clients in levels:
        rate = {lv["mode"]: lv["tokens_per_s"] for lv in report["levels"] if lv["clients"] == clients}
        base = rate.get("sequential")
        for name, value in rate.items():
            if name != "sequential" and base:
                print(f"C={clients}: {name} / sequential = {value / base:.2f}x")
    print(
        f"greedy tokens equal across modes: {len(both) - report['mismatched_requests']}/{len(both)} requests"
    )
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
