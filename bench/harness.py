"""``loopcast bench``: ONNX Runtime step and end-to-end timings against PyTorch, in one run.

For one checkpoint and each (dtype, graph variant) it exports an artifact and measures, on one
device: per-step time of decode, verify(W) for several W, draft and verify_tail, captured
(CUDA graphs) and uncaptured; whether verify rows equal the M=1 decode rows bit for bit;
end-to-end tokens/s of plain greedy, prompt lookup and self-speculation with the tokens
compared against plain greedy; a long run alternating draft, verify and decode with the
graph-slot counters; where a decode step's GPU time goes by kernel family; and, as baselines
measured in the same run, the same model's PyTorch decode step (eager and under a CUDA graph)
and the memory-bandwidth floor (bytes read per step / measured device bandwidth).

Variants: ``stock`` (MatMul / GroupQueryAttention) and ``batch-invariant`` (the loopcast
custom ops). The result is one JSON document; ``bench/report.py`` renders and writes it.
"""

from __future__ import annotations

import datetime
import platform
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
from loopcast.bench.end_to_end import end_to_end, rows_identical
from loopcast.bench.pipeline import cycle_ms
from loopcast.bench.profile import alternation, kernel_env, profile_decode
from loopcast.bench.recurrent import recurrent_runs

from loopcast.errors import RequestError
from loopcast.manifest import CYCLE, DECODE, DRAFT, VERIFY, VERIFY_TAIL
from loopcast.vocab import OpSet

BENCH_PROMPTS = [
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "class Stack:\n    def __init__(self):\n",
    "import os\nimport sys\n\n\ndef main():\n",
    "    def __repr__(self):\n        return ",
    "def merge(left, right):\n    result = []\n",
    "class Queue:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n",
    # edit workload: the answer repeats the prompt, as in code edits
    "def area(width, height):\n    return width * height\n\n\n" * 3 + "def area(",
]
# The edit workload, reported apart: a function, then its first line again, so that the answer
# re-emits (an edited copy of) text already in the prompt: the case prompt lookup is for.
_EDIT_SOURCES = [
    "def merge(left, right):\n    result = []\n    i = j = 0\n    while i < len(left) and j < len(right):\n"
    "        if left[i] <= right[j]:\n            result.append(left[i])\n            i += 1\n"
    "        else:\n            result.append(right[j])\n            j += 1\n"
    "    result.extend(left[i:])\n    result.extend(right[j:])\n    return result\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n"
    "        self.items.append(item)\n\n    def pop(self):\n        return self.items.pop()\n\n"
    "    def __len__(self):\n        return len(self.items)\n",
    "def read_config(path):\n    values = {}\n    with open(path) as f:\n        for line in f:\n"
    "            line = line.strip()\n            if not line or line.startswith('#'):\n                continue\n"  # noqa: E501 (a prompt's source lines)
    "            key, _, value = line.partition('=')\n            values[key.strip()] = value.strip()\n"
    "    return values\n",
    "def binary_search(items, target):\n    lo, hi = 0, len(items) - 1\n    while lo <= hi:\n"
    "        mid = (lo + hi) // 2\n        if items[mid] == target:\n            return mid\n"
    "        if items[mid] < target:\n            lo = mid + 1\n        else:\n            hi = mid - 1\n"
    "    return -1\n",
]
EDIT_PROMPTS = [src + "\n\n" + src.split("\n", 1)[0] + "\n" for src in _EDIT_SOURCES]
VARIANTS = ("stock", "batch-invariant")


@dataclass
class BenchOptions:
    checkpoint: str  # a checkpoint dir, `demo`, or `preset:NAME` (random weights)
    work_dir: Path
    device: str = "cuda"
    dtypes: tuple[str, ...] = ("fp16", "bf16")
    variants: tuple[str, ...] = VARIANTS
    past: int = 1024
    widths: tuple[int, ...] = (2, 5, 8)
    iters: int = 50
    new_tokens: int = 128  # per prompt, end-to-end rows
    end_to_end: bool = True
    alternate_tokens: int = 1000
    torch_baseline: bool = True
    profile: bool = True
    oracle_rejects: tuple[float, ...] = (0.0, 0.08)  # pipeline rows with oracle drafts (rejected fractions)
    passes: int = 1  # end-to-end passes, modes interleaved (median ratio)
    threads: int | None = None  # ONNX Runtime intra-op threads (None: its default)
    # weight formats to export each (dtype, variant) with: "none" (float weights), "int4", "int8"
    # (loopcast export --quantize, block 32, symmetric, head in the layers' format)
    quantize: tuple[str, ...] = ("none",)
    # recurrent-depth checkpoints (bench/recurrent.py): the r values timed (default: its default r)
    loops: tuple[int, ...] = ()
    # recurrent-depth: KL-exit rows too (plain and the pipeline's oracle rows at this threshold)
    kl_threshold: float | None = None


@dataclass
class StepTimes:
    kind: str
    rows: int
    captured_ms: float | None  # None: not captured (CPU, or the slot fell back to eager)
    uncaptured_ms: float | None  # None: not measured (extra verify widths on CUDA)
    slot: dict | None = None  # the timed generator's graph-slot counters for this kind


@dataclass
class VariantResult:
    dtype: str
    variant: str
    past: int
    export_s: float
    quantize: str = "none"
    steps: list[StepTimes] = field(default_factory=list)
    rows_identical: dict = field(default_factory=dict)
    end_to_end: dict = field(default_factory=dict)
    end_to_end_edit: dict = field(default_factory=dict)  # EDIT_PROMPTS: plain and prompt lookup
    alternation: dict = field(default_factory=dict)
    # Captured decode of the same artifact with one of the custom-op library's launch switches
    # off, measured in the same run: LOOPCAST_PDL=0 (no programmatic dependent launch: what PDL
    # buys) and LOOPCAST_SWIGLU_STAGE=0 (SwiGLU per chunk in the down projection, not staged).
    decode_without_pdl_ms: float | None = None
    decode_without_swiglu_stage_ms: float | None = None
    profile_ms: dict = field(default_factory=dict)
    top_kernels: list = field(default_factory=list)
    graph_fallbacks: dict = field(default_factory=dict)
    captured_fixed_position_only: bool = False  # stock graphs: captured timing at one position only
    loops: int | None = None  # a recurrent-depth run's r (bench/recurrent.py)


# -- measuring ------------------------------------------------------------------------------


def _median_ms(fn, iters: int, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def step_ms(model, kind: str, past: int, iters: int) -> tuple[float, dict | None]:
    """Median wall time of one ``kind`` step at positions past.. (host pushes and id pull
    included), and the generator's graph-slot counters for the kind (None: not captured)."""
    gen = model.new_generator()
    rows = gen.rows(kind)
    if kind == VERIFY_TAIL:
        hidden = np.zeros((rows, model.config.hidden_size), np.float32)
        ms = _median_ms(lambda: gen.run(kind, past, hidden=hidden, want_logits=False), iters)
    else:
        tokens = [1] * rows
        ms = _median_ms(lambda: gen.run(kind, past, tokens=tokens, want_logits=False), iters)
    return ms, gen.graph_slots().get(kind)


def decode_with_env(art: Path, device: str, past: int, iters: int, name: str, value: str) -> float | None:
    """Captured decode step with one launch switch changed (the variable only has to be set
    while this session warms up and captures)."""
    from loopcast.ort_runtime import load

    with kernel_env(name, value):
        model = load(art, device, kinds=(DECODE,))
        ms, slot = step_ms(model, DECODE, past, iters)
    return _captured(ms, slot)


def _captured(ms: float, slot: dict | None) -> float | None:
    """A time counts as captured only if the slot captured and never fell back."""
    return ms if slot is not None and slot["captures"] and slot["failure"] is None else None


def _checkpoint(opts: BenchOptions, dtype: str) -> Path:
    if not opts.checkpoint.startswith("preset:"):
        from loopcast.exporter.checkpoint import resolve_checkpoint

        return resolve_checkpoint(opts.checkpoint)
    from loopcast.exporter.checkpoint import DTYPES
    from loopcast.exporter.random_checkpoint import write_random_checkpoint

    from loopcast.presets import PRESETS

    preset = opts.checkpoint.split(":", 1)[1]
    out = opts.work_dir / f"ckpt-{preset}-{dtype}"
    if not (out / "config.json").is_file():
        write_random_checkpoint(PRESETS[preset], out, seed=0, dtype=DTYPES[dtype])
    return out


def bench_variant(
    opts: BenchOptions, dtype: str, variant: str, log=print, quantize: str = "none"
) -> VariantResult:
    from loopcast.exporter.export import ExportOptions, export_checkpoint, with_verify_width
    from loopcast.ort_runtime import load

    from loopcast.config import load_config
    from loopcast.quant import quant_scheme_from_options

    checkpoint = _checkpoint(opts, dtype)
    config = load_config(checkpoint)
    if config.recurrent_depth:  # its graphs are prelude/core_step/coda/recurrent_cycle: variant_results
        raise RequestError(f"{checkpoint}: a recurrent-depth checkpoint is benched per r (variant_results)")
    widths = sorted(set(opts.widths) | {5})
    max_length = min(config.max_position_embeddings, opts.past + max(widths) + 1)
    past = max_length - max(widths) - 1
    scheme = quant_scheme_from_options(None if quantize == "none" else quantize)
    tag = f"{dtype}/{variant}" + ("" if scheme is None else f"/{quantize}")
    art = opts.work_dir / f"art-{Path(str(checkpoint)).name}-{tag.replace('/', '-')}"
    log(f"[{tag}] exporting {checkpoint} into {art} ...")
    t0 = time.perf_counter()
    # variants: stock ops, every loopcast op, or the exporter's default op set for this dtype
    ops = {"stock": OpSet.STOCK, "batch-invariant": OpSet.LOOPCAST, "default": "auto"}[variant]
    export_checkpoint(
        checkpoint,
        art,
        ExportOptions(
            dtype, max_length, 5, 1 if config.num_loops > 1 else None, ops=ops, quantization=scheme
        ),
        overwrite=True,
    )
    result = VariantResult(dtype, variant, past, time.perf_counter() - t0, quantize)
    log(f"[{tag}] exported in {result.export_s:.1f}s; past {past}")
    cuda = opts.device == "cuda"
    from loopcast.manifest import Manifest

    hot = tuple(k for k in (DECODE, VERIFY, DRAFT, VERIFY_TAIL, CYCLE) if k in Manifest.read(art).graphs)
    # One model with every kind (captured where possible) serves the captured steps, the row
    # check and generation; an uncaptured one (hot kinds only) the eager steps and the profile.
    # Sessions are few on purpose: each CUDA session holds its own copy of the weights.
    full = load(art, opts.device, threads=opts.threads)
    eager = load(art, opts.device, threads=opts.threads, cuda_graphs=False, kinds=hot) if cuda else full
    result.graph_fallbacks = dict(full.loaded.graph_fallbacks)
    # Stock graphs are not captured for generation (GroupQueryAttention's host-side length would
    # be frozen); their captured time is measured at one fixed position, for comparison only.
    result.captured_fixed_position_only = cuda and not full.loaded.manifest.device_lengths
    capt = (
        load(art, opts.device, threads=opts.threads, cuda_graphs="always", kinds=hot)
        if result.captured_fixed_position_only
        else full
    )
    log(f"  timing steps at past {past}, {opts.iters} runs each ...")
    for kind in hot:
        if not full.loaded.has(kind):
            continue
        rows = full.new_generator().rows(kind)
        timer = cycle_ms if kind == CYCLE else step_ms
        cap, slot = timer(capt, kind, past, opts.iters) if cuda else (None, None)
        result.steps.append(
            StepTimes(
                kind,
                rows,
                _captured(cap, slot) if cuda else None,
                timer(eager, kind, past, opts.iters)[0],
                slot,
            )
        )
        captured = f"captured {cap:.3f} ms, " if cap is not None else ""
        log(f"  {kind}({rows}) {captured}uncaptured {result.steps[-1].uncaptured_ms:.3f} ms")
    if opts.profile and cuda:
        result.profile_ms, result.top_kernels = profile_decode(eager, past)
    del eager, capt
    if cuda and not result.captured_fixed_position_only:
        result.decode_without_pdl_ms = decode_with_env(
            art, opts.device, past, opts.iters, "LOOPCAST_PDL", "0"
        )
        log(f"  decode captured without PDL {result.decode_without_pdl_ms} ms")
        result.decode_without_swiglu_stage_ms = decode_with_env(
            art, opts.device, past, opts.iters, "LOOPCAST_SWIGLU_STAGE", "0"
        )
        log(f"  decode captured without SwiGLU staging {result.decode_without_swiglu_stage_ms} ms")
    for width in widths:
        if width == 5:
            continue
        with_verify_width(art, opts.work_dir / f"{art.name}-w{width}", width, overwrite=True)
        model = load(
            opts.work_dir / f"{art.name}-w{width}",
            opts.device,
            threads=opts.threads,
            kinds=(VERIFY,),
            cuda_graphs="always" if result.captured_fixed_position_only else True,
        )
        ms, slot = step_ms(model, VERIFY, past, opts.iters)
        captured = _captured(ms, slot) if cuda else None
        result.steps.append(StepTimes(VERIFY, width, captured, None if captured is not None else ms, slot))
        del model
        log(f"  verify({width}) {ms:.3f} ms ({'captured' if captured is not None else 'uncaptured'})")
    if full.tokenizer is not None:
        prompts = [full.encode(p) for p in BENCH_PROMPTS]
    else:
        rng = np.random.default_rng(0)
        prompts = [rng.integers(3, config.vocab_size, 24).tolist() for _ in range(4)]
    log(f"  comparing verify rows with decode rows on {len(prompts)} prompts ...")
    result.rows_identical = rows_identical(full, prompts)
    same = result.rows_identical
    log(
        f"  verify rows bit-identical to decode rows: {same['bit_identical_rows']}/{same['rows']} "
        f"(max |diff| {same['max_abs_diff']:g})"
    )
    new_tokens = min(opts.new_tokens, max_length - max(len(p) for p in prompts) - 8)
    if opts.end_to_end and new_tokens < 8:
        log(f"  end-to-end skipped: --past {opts.past} leaves no room after the prompts")
    elif opts.end_to_end:
        log(
            f"  end-to-end: {len(prompts)} prompts x {new_tokens} tokens x {opts.passes} pass(es), plain and "
            "speculative ..."
        )
        result.end_to_end = end_to_end(full, prompts, new_tokens, opts.oracle_rejects, passes=opts.passes)
        for name, entry in result.end_to_end.items():
            log(
                f"  {name}: {entry['tokens_per_s']:.1f} tok/s (x{entry['speedup']:.2f}), "
                f"divergent prompts {entry['divergent_prompts']}"
            )
        if full.tokenizer is not None:
            edits = [full.encode(p) for p in EDIT_PROMPTS]
            edit_tokens = min(opts.new_tokens, max_length - max(len(p) for p in edits) - 8)
            if edit_tokens >= 8:
                log(f"  end-to-end, edit workload: {len(edits)} prompts x {edit_tokens} tokens ...")
                result.end_to_end_edit = end_to_end(
                    full, edits, edit_tokens, speculative=("prompt-lookup",), passes=opts.passes
                )
                for name, entry in result.end_to_end_edit.items():
                    log(
                        f"  edit, {name}: {entry['tokens_per_s']:.1f} tok/s (x{entry['speedup']:.2f}), "
                        f"divergent prompts {entry['divergent_prompts']}"
                    )
    if opts.alternate_tokens and full.loaded.has(DRAFT) and cuda:
        log(f"  alternating modes for {opts.alternate_tokens} tokens ...")
        result.alternation = alternation(full, prompts[0], opts.alternate_tokens)
        log(
            f"  alternation: {result.alternation['tokens']} tokens, steady mean ms per kind "
            f"{result.alternation['mean_step_ms']}"
        )
    return result


def torch_baseline(opts: BenchOptions, dtype: str, past: int) -> dict:
    import torch
    from loopcast.exporter import torch_bench

    checkpoint = _checkpoint(opts, dtype)
    torch_dtype = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[dtype]
    model = torch_bench.load_reference(checkpoint, torch_dtype, opts.device)
    max_length = past + 8
    out = {
        "eager_ms": torch_bench.decode_step_ms(
            model, past=past, max_length=max_length, cuda_graph=False, iters=min(opts.iters, 20)
        )
    }
    if opts.device == "cuda":
        out["cuda_graph_ms"] = torch_bench.decode_step_ms(
            model, past=past, max_length=max_length, cuda_graph=True, iters=opts.iters
        )
    del model
    if opts.device == "cuda":
        torch.cuda.empty_cache()
    return out


def variant_results(opts: BenchOptions, dtype: str, variant: str, log=print, quantize: str = "none") -> list:
    """A looped checkpoint's one VariantResult, or a recurrent-depth one's per r (bench/recurrent.py)."""
    from loopcast.config import load_config

    checkpoint = _checkpoint(opts, dtype)
    if load_config(checkpoint).recurrent_depth:
        return recurrent_runs(opts, dtype, variant, checkpoint, log, quantize)
    if opts.loops or opts.kl_threshold is not None:
        raise RequestError(
            "--loops and --kl-threshold are for a recurrent-depth (Huginn) checkpoint; this one is looped"
        )
    return [bench_variant(opts, dtype, variant, log, quantize)]


def run_bench(opts: BenchOptions, log=print, on_progress=None) -> dict:
    """Every (dtype, variant) in turn; ``on_progress(report)`` after each, so a run cut short
    still leaves what it measured."""
    import onnxruntime as ort

    from loopcast.config import load_config
    from loopcast.devices import check_device

    check_device(opts.device)  # before anything is exported
    opts.work_dir.mkdir(parents=True, exist_ok=True)
    report = {
        "options": {k: str(v) if isinstance(v, Path) else v for k, v in asdict(opts).items()},
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": _machine(opts.device),
        "onnxruntime": ort.__version__,
        "runs": [],
        "baselines": {},
    }
    for dtype in opts.dtypes:
        for variant in opts.variants:
            for quantize in opts.quantize:
                for result in variant_results(opts, dtype, variant, log, quantize):
                    report["runs"].append(asdict(result))
                if on_progress is not None:
                    on_progress(report)
        past = report["runs"][-1]["past"]
        config = load_config(_checkpoint(opts, dtype))
        if config.recurrent_depth:  # the baselines time the looped model's decode step
            report["baselines"][dtype] = {"past": past}
            continue
        baseline: dict = {"past": past}
        if opts.torch_baseline:
            log(f"[{dtype}] PyTorch baseline and memory bandwidth ...")
            try:
                baseline.update(torch_baseline(opts, dtype, past))
            except ImportError:  # the baseline is optional; say what it needs
                baseline["error"] = "the PyTorch baseline needs torch (pip install torch); skipped"
            except Exception as exc:  # say why it is missing
                baseline["error"] = f"the PyTorch baseline failed: {type(exc).__name__}: {exc}"
        try:
            from loopcast.exporter import torch_bench

            bandwidth = torch_bench.device_bandwidth_gbs(opts.device)
            nbytes = torch_bench.bytes_per_decode_step(config, 4 if dtype == "fp32" else 2, past)
            baseline.update(
                {
                    "bandwidth_gbs": bandwidth,
                    "bytes_per_step": nbytes,
                    "floor_ms": torch_bench.floor_ms(nbytes["total"], bandwidth),
                    "cache_bytes": _cache_bytes(opts.device),
                }
            )
        except ImportError:
            baseline["floor_error"] = (
                "the bandwidth floor is measured with torch (pip install torch); skipped"
            )
        report["baselines"][dtype] = baseline
        for line in baseline_lines(baseline):
            log(f"[{dtype}] {line}")
        if on_progress is not None:
            on_progress(report)
    return report


def baseline_lines(baseline: dict) -> list[str]:
    """The baselines as sentences: each measured one, else why it is missing."""
    lines = []
    for key, label in (("eager_ms", "PyTorch eager decode"), ("cuda_graph_ms", "PyTorch CUDA graph")):
        if baseline.get(key):
            lines.append(f"{label}: {baseline[key]:.3f} ms per step")
    if baseline.get("floor_ms"):
        lines.append(
            f"bandwidth floor: {baseline['floor_ms']:.3f} ms per step "
            f"({baseline['bytes_per_step']['total'] / 1e6:.1f} MB at {baseline['bandwidth_gbs']:.0f} GB/s)"
        )
    lines += [baseline[key] for key in ("error", "floor_error") if baseline.get(key)]
    return lines


def default_variants(device: str) -> tuple[str, ...]:
    """What a user's export runs on ``device``: the exporter's default op set on the CPU (exact,
    loopcast-attention), the loopcast ops of ``--target cuda`` on CUDA."""
    return ("default",) if device == "cpu" else ("batch-invariant",)


def _cache_bytes(device: str) -> int:
    """Bytes a step can keep in cache between steps: the GPU's L2, or on the CPU the copy size
    the bandwidth is measured with (chosen past the caches). A step whose bytes fit reads them
    from cache, faster than the measured memory bandwidth: its floor is no floor."""
    from loopcast.exporter import torch_bench

    if device == "cuda":
        import torch

        return int(torch.cuda.get_device_properties(0).L2_cache_size)
    return torch_bench._CPU_BANDWIDTH_BYTES


def _machine(device: str) -> dict:
    info = {"platform": platform.platform(), "python": platform.python_version()}
    try:
        import torch

        info["torch"] = torch.__version__
        if device == "cuda" and torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name(0)
            info["cuda"] = torch.version.cuda
    except ImportError:
        pass
    return info
