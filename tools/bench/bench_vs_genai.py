"""loopcast artifacts against ONNX Runtime GenAI models on the CPU, in one run, interleaved
(docs/quantization.md, "Against ORT-GenAI int4").

    python -m tools.bench.gguf_to_hf SmolLM2-135M-Instruct.Q4_1.gguf hf
    loopcast export hf -o ours-int4 --quantize int4 --max-length 1024 --verify-width 8 --exit-depths none
    python -m onnxruntime_genai.models.builder -i hf -o genai-int4 -p int4 -e cpu
    python -m tools.bench.bench_vs_genai --ours int4=ours-int4 --genai genai-int4=genai-int4 \\
        [--passes 5] [--new-tokens 128] [--lookup int4] [--windows 8 --seq 512] [--json r.json]

Each contender runs in its own child process (ours through loopcast's Python API, GenAI
through ``onnxruntime_genai``'s greedy generator), loaded once; the parent sends each pass's
prompts (code, prose, an edit prompt whose answer copies the prompt, and the same edit as a chat
request through the first artifact's chat template) to every contender in
turn, the order rotated pass by pass, so one child computes at a time. Every contender gets the
same token ids (the first ``--ours`` artifact's tokenizer) and stops at EOS or ``--new-tokens``.
Decode tok/s = (tokens - 1) / (time from the first token to the last), end to end = tokens /
(time from the call to the last token); CPU ms/token = the child's CPU time over the call (all
its threads, spinning included) per token, the figure a shared machine's load disturbs least.
Peak RSS is the child's own ``ru_maxrss``. Ratios are taken in the same pass against the
reference (``--against``, default the first ``--genai``) and the median over passes is
reported. ``--lookup LABEL`` also runs that artifact with prompt lookup on the two edit prompts
and checks its tokens equal its plain greedy tokens (exit status 1 if not). Held-out bits/byte:
every artifact scores the same windows of this interpreter's stdlib held-out split
(tools/demo_model/demo_corpus.py) tokenized with that tokenizer, teacher-forced (ours through
the verify graph, W rows a call; GenAI's through onnxruntime_genai, each window one prompt
whose logits output holds every position).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from tools.bench.bench_quantized_cpu import parse_artifacts
from tools.quality.quant_quality import bits_per_byte, genai_window_logits, stdlib_windows, window_logits

REPLY = "@@"  # prefix of a worker's reply lines (anything else on its stdout is ignored)

PROMPTS = {
    "code": 'def merge_sorted(a, b):\n    """Merge two sorted lists into one sorted list."""\n',
    "prose": "The history of the printing press begins in the fifteenth century, when",
}
EDIT_SOURCE = """def load_config(path):
    with open(path) as f:
        lines = f.read().splitlines()
    config = {}
    for line in lines:
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        key, _, value = line.partition("=")
        config[key.strip()] = value.strip()
    return config
"""
# The answer copies the source with one name changed: what prompt lookup is for.
PROMPTS["edit"] = (
    "Here is a Python function:\n\n```python\n" + EDIT_SOURCE + "```\n\n"
    "The same function with the variable `config` renamed to `settings`:\n\n```python\n"
)
EDIT = "edit"
# The same edit asked of an instruct model as its users ask it: one user turn through the first
# artifact's chat template (skipped when that artifact has none).
CHAT_EDIT = "chat-edit"
CHAT_EDIT_REQUEST = (
    "Rename the variable `config` to `settings` in this Python function. Reply with the whole function "
    "only.\n\n```python\n" + EDIT_SOURCE + "```"
)
EDITS = (EDIT, CHAT_EDIT)


# ---------------------------------------------------------------------------------------------
# workers: one contender each, JSON lines in and out


def _ours_worker(path: str, threads: int | None):
    from loopcast.ort_runtime import load

    model = load(path, threads=threads)

    def run(ids: list[int], new_tokens: int, mode: str):
        return model.stream_ids(ids, max_new_tokens=new_tokens, speculative=mode)

    return run


def _genai_worker(path: str, threads: int | None):
    import onnxruntime_genai as og

    model = og.Model(path)  # its genai_config.json's session options, as its builder wrote them

    def run(ids: list[int], new_tokens: int, mode: str):
        if mode != "none":
            raise SystemExit(f"error: GenAI contender: mode {mode!r} is not run")
        params = og.GeneratorParams(model)
        params.set_search_options(max_length=len(ids) + new_tokens, do_sample=False)
        generator = og.Generator(model, params)
        generator.append_tokens([ids])
        while not generator.is_done():
            generator.generate_next_token()
            yield int(generator.get_next_tokens()[0])

    return run


def worker_main(kind: str, path: str, threads: int | None) -> None:
    run = (_ours_worker if kind == "ours" else _genai_worker)(path, threads)
    print(REPLY + json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        t0, cpu0 = time.perf_counter(), time.process_time()
        tokens, first = [], t0
        for token in run(request["ids"], request["new_tokens"], request["mode"]):
            if not tokens:
                first = time.perf_counter()
            tokens.append(int(token))
        end, cpu = time.perf_counter(), time.process_time() - cpu0
        peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        reply = {"tokens": tokens, "first_s": first - t0, "end_s": end - t0, "cpu_s": cpu}
        reply["peak_rss_mib"] = peak_kib / 1024
        print(REPLY + json.dumps(reply), flush=True)


@dataclass
class Contender:
    label: str
    kind: str  # "ours" | "genai"
    path: Path
    proc: subprocess.Popen | None = None
    runs: list[dict] = field(default_factory=list)

    def start(self, threads: int | None) -> None:
        cmd = [sys.executable, "-m", "tools.bench.bench_vs_genai", "--worker", self.kind, str(self.path)]
        if threads:
            cmd += ["--threads", str(threads)]
        env = os.environ | {"PYTHONPATH": str(Path(__file__).resolve().parents[2])}
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        self._read()

    def _read(self) -> dict:
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(REPLY):
                return json.loads(line[len(REPLY) :])
        raise SystemExit(f"error: contender {self.label}: worker exited ({self.proc.wait()})")

    def generate(self, ids: list[int], new_tokens: int, mode: str = "none") -> dict:
        assert self.proc is not None and self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"ids": ids, "new_tokens": new_tokens, "mode": mode}) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def stop(self) -> None:
        if self.proc is not None and self.proc.stdin is not None:
            self.proc.stdin.close()
            self.proc.wait()


def rates(reply: dict) -> tuple[float, float, float]:
    """(decode tok/s, end-to-end tok/s, CPU ms per token: every thread of the child, the whole
    call) of one reply."""
    n = len(reply["tokens"])
    decode = (n - 1) / max(reply["end_s"] - reply["first_s"], 1e-9)
    return decode, n / max(reply["end_s"], 1e-9), 1e3 * reply["cpu_s"] / max(n, 1)


def dir_mib(path: Path) -> float:
    return sum(f.stat().st_size for f in path.iterdir() if f.is_file()) / 2**20


# ---------------------------------------------------------------------------------------------


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ours", action="append", default=[], help="LABEL=ARTIFACT (loopcast)")
    p.add_argument("--genai", action="append", default=[], help="LABEL=DIR (ORT-GenAI model folder)")
    p.add_argument("--against", default=None, help="ratios against (default: first --genai)")
    p.add_argument("--passes", type=int, default=5)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=None, help="our sessions' intra-op threads")
    p.add_argument("--lookup", default=None, help="--ours label: also prompt lookup on the edit prompts")
    p.add_argument("--windows", type=int, default=8, help="held-out windows for bits/byte (0: skip)")
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--worker", nargs=2, metavar=("KIND", "PATH"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker_main(args.worker[0], args.worker[1], args.threads)
        return 0
    ours, genai = parse_artifacts(args.ours), parse_artifacts(args.genai)
    if not ours:
        raise SystemExit("error: --ours: at least one loopcast artifact")
    contenders = [Contender(k, "ours", v) for k, v in ours.items()]
    contenders += [Contender(k, "genai", v) for k, v in genai.items()]
    labels = [c.label for c in contenders]
    against = args.against or (next(iter(genai)) if genai else labels[0])
    if against not in labels:
        raise SystemExit(f"error: --against: {against!r} is not a contender label")
    if args.lookup is not None and args.lookup not in ours:
        raise SystemExit(f"error: --lookup: {args.lookup!r} is not an --ours label")
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(next(iter(ours.values())) / "tokenizer.json"))
    prompts = {name: tokenizer.encode(text).ids for name, text in PROMPTS.items()}
    from loopcast.ort_runtime.text.chat import load_chat_template

    template = load_chat_template(next(iter(ours.values())))
    if template is not None:
        text = template.render([{"role": "user", "content": CHAT_EDIT_REQUEST}], add_generation_prompt=True)
        prompts[CHAT_EDIT] = tokenizer.encode(text, add_special_tokens=False).ids
    runners = {c.label: c for c in contenders}
    if args.lookup is not None:
        lookup = Contender(args.lookup + "+lookup", "ours", ours[args.lookup])
        runners[lookup.label] = lookup
    for c in runners.values():
        t0 = time.perf_counter()
        c.start(args.threads)
        print(f"started {c.label} ({c.path}) in {time.perf_counter() - t0:.1f}s", flush=True)
    order = list(runners)
    # results[prompt][label] = list over passes of (decode, e2e); ratio lists alike
    results: dict[str, dict[str, list]] = {name: {label: [] for label in order} for name in prompts}
    tokens: dict[tuple[str, str], list[list[int]]] = {}
    peak: dict[str, float] = {}
    load_seen = [os.getloadavg()[0]]
    for i in range(args.passes):
        for name, ids in prompts.items():
            turn = order[i % len(order) :] + order[: i % len(order)]
            for label in turn:
                c = runners[label]
                if c.label.endswith("+lookup") and name not in EDITS:
                    continue
                mode = "prompt-lookup" if c.label.endswith("+lookup") else "none"
                reply = c.generate(ids, args.new_tokens, mode)
                results[name][label].append(rates(reply))
                tokens.setdefault((name, label), []).append(reply["tokens"])
                peak[label] = reply["peak_rss_mib"]
                print(
                    f"pass {i} {name:5s} {label:14s} {len(reply['tokens']):4d} tokens  decode "
                    f"{results[name][label][-1][0]:7.1f} tok/s  e2e {results[name][label][-1][1]:7.1f}",
                    flush=True,
                )
        load_seen.append(os.getloadavg()[0])
    for c in runners.values():
        c.stop()
    report: dict = {"passes": args.passes, "new_tokens": args.new_tokens, "against": against}
    report |= {"load_1min": [min(load_seen), max(load_seen)], "prompts": {}, "contenders": {}}
    print(f"\nmedian of {args.passes} passes; x {against} = same-pass ratio of decode tok/s, median")
    print(
        "| prompt | contender | tokens | decode tok/s | end-to-end tok/s | CPU ms/token | x " + against + " |"
    )
    print("|---|---|---:|---:|---:|---:|---:|")
    for name in prompts:
        report["prompts"][name] = {}
        for label in order:
            got = results[name][label]
            if not got:
                continue
            ref = results[name][against]
            ratio = statistics.median(g[0] / r[0] for g, r in zip(got, ref, strict=True))
            row = {
                "decode_tok_s": [g[0] for g in got],
                "e2e_tok_s": [g[1] for g in got],
                "cpu_ms_per_token": [g[2] for g in got],
                "tokens": len(tokens[(name, label)][-1]),
                "ratio_decode": ratio,
            }
            report["prompts"][name][label] = row
            print(
                f"| {name} | {label} | {row['tokens']} | {statistics.median(row['decode_tok_s']):.1f} | "
                f"{statistics.median(row['e2e_tok_s']):.1f} | "
                f"{statistics.median(row['cpu_ms_per_token']):.1f} | {ratio:.2f} |"
            )
    bad = 0
    if args.lookup is not None:
        report["lookup"] = {}
        print()
        for name in (e for e in EDITS if e in prompts):
            plain, spec = tokens[(name, args.lookup)], tokens[(name, args.lookup + "+lookup")]
            same = all(s == plain[0] for s in spec + plain)
            bad += not same
            pairs = zip(results[name][args.lookup + "+lookup"], results[name][args.lookup], strict=True)
            speedup = statistics.median(s[0] / p[0] for s, p in pairs)
            report["lookup"][name] = {"identical_to_plain": same, "speedup_decode": speedup}
            print(
                f"prompt lookup on {name}: x{speedup:.2f} decode over "
                f"{args.lookup} plain; tokens {'identical to' if same else 'DIFFER from'} plain greedy"
            )
    tokenizer_json = next(iter(ours.values())) / "tokenizer.json"
    windows, tpb = stdlib_windows(tokenizer_json, args.windows, args.seq) if args.windows else ([], 0.0)
    print("\n| contender | bits/byte | peak RSS MiB | artifact MiB |")
    print("|---|---:|---:|---:|")
    for c in contenders:
        bpb = None
        if windows:
            if c.kind == "ours":
                logits = window_logits(c.path, [w[:-1] for w in windows])
            else:
                logits = genai_window_logits(c.path, [w[:-1] for w in windows])
            bpb = bits_per_byte(logits, windows, tpb)
        row = {"bits_per_byte": bpb, "peak_rss_mib": peak[c.label], "artifact_mib": dir_mib(c.path)}
        report["contenders"][c.label] = row
        bpb_text = f"{bpb:.4f}" if bpb is not None else "-"
        print(
            f"| {c.label} | {bpb_text} | {row['peak_rss_mib']:.0f} | {row['artifact_mib']:.1f} |", flush=True
        )
    if windows:
        report["heldout"] = {"windows": args.windows, "seq": args.seq, "tokens_per_byte": tpb}
    print(f"load average (1 min) during the passes: {min(load_seen):.2f}-{max(load_seen):.2f}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
