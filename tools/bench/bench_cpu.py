"""CPU benchmark of the demo model: torch reference vs ONNX Runtime, and the speculation matrix.

    python -m tools.bench.bench_cpu            # full run (~7 min on 2 cores), JSON → docs/perf-cpu.json
    python -m tools.bench.bench_cpu --quick    # smoke run (2 prompts, 32 tokens, 1 pass), JSON → /tmp

The measuring is ``loopcast.bench.matrix`` (bench/matrix.py: what is timed and how); this script
gives it its two workloads, cut from held-out demo-corpus documents (tools/demo_model/demo_prompts.py):
  * ``code`` — code continuation: 200 characters of a held-out document starting at its first
    ``def`` line (also the torch-vs-ORT baseline's workload);
  * ``edit`` — an edit-style prompt that the model continues by copying: 300 characters from
    the same place, a newline, then the snippet's first 40 characters again.
Prompts: ``--prompts`` (8) held-out documents of this interpreter's stdlib, evenly spaced among
those with a ``def`` line, in sorted path order — deterministic.

Threads: ORT uses its default intra-op pool; torch runs with ``--torch-threads`` (default 1).
On the 2-core demo machine one torch thread is as fast as two when the machine is idle and is
not wrecked by other load (two OpenMP threads fell to ~11 tokens/s beside one busy process,
one thread stayed at ~39). Pass ``--torch-threads 2`` to measure torch's default.

Output: a progress line per configuration and pass, the markdown tables last (to paste into
docs/perf.md), and a JSON file with every number plus machine info. The exit status is 1 when
any tokens differ from plain greedy (the JSON and tables are still written).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from loopcast.bench.matrix import MatrixOptions, Workload, report_mismatches, run_matrix

from tools.demo_model.demo_corpus import read_split_with_paths
from tools.demo_model.demo_prompts import (
    CODE_CHARS,
    EDIT_CHARS,
    EDIT_REPEAT_CHARS,
    cut_at_line_end,
    cut_at_word_end,
)
from tools.demo_model.demo_prompts import select_snippets as _select_snippets

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_OUT = "docs/perf-cpu.json"
QUICK_OUT = "/tmp/loopcast-perf-cpu-quick.json"


def select_snippets(count: int) -> list[tuple[str, int, str]]:
    """``count`` held-out documents of this interpreter's stdlib (sorted path order), each as
    (relpath, offset of its first ``def`` line, document text): demo_prompts.select_snippets."""
    return _select_snippets(read_split_with_paths("heldout"), count)


def make_workloads(count: int) -> dict[str, Workload]:
    """``code``: ~200 characters from the first ``def`` line, whole lines. ``edit``: ~300
    characters from the same place (whole lines), a newline, then its first ~40 characters."""
    snippets = select_snippets(count)
    sources = [f"{relpath}:{start}" for relpath, start, _ in snippets]
    code = [cut_at_line_end(text[start:], CODE_CHARS) for _, start, text in snippets]
    edit = []
    for _, start, text in snippets:
        snippet = cut_at_line_end(text[start:], EDIT_CHARS) + "\n"
        edit.append(snippet + "\n" + cut_at_word_end(snippet, EDIT_REPEAT_CHARS))
    return {"code": Workload("code", code, sources), "edit": Workload("edit", edit, sources)}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="smoke run: 2 prompts, 32 new tokens, 1 pass; JSON to " + QUICK_OUT,
    )
    parser.add_argument("--out", help=f"JSON output (default {DEFAULT_OUT}; {QUICK_OUT} with --quick)")
    parser.add_argument("--prompts", type=int, help="prompts per workload (default 8, 2 with --quick)")
    parser.add_argument("--max-new-tokens", type=int, help="tokens per run (default 128, 32 with --quick)")
    parser.add_argument(
        "--torch-threads",
        type=int,
        default=1,
        help="torch intra-op threads for the reference (default 1: see the docstring)",
    )
    parser.add_argument(
        "--repeats", type=int, help="passes; each configuration keeps its fastest (default 2, 1 with --quick)"
    )
    args = parser.parse_args(argv)
    quick = args.quick
    args.out = Path(args.out or (QUICK_OUT if quick else DEFAULT_OUT))
    args.prompts = args.prompts or (2 if quick else 8)
    args.max_new_tokens = args.max_new_tokens or (32 if quick else 128)
    args.repeats = args.repeats or (1 if quick else 2)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    opts = MatrixOptions(args.prompts, args.max_new_tokens, args.repeats, args.torch_threads)
    workloads = make_workloads(args.prompts)
    with tempfile.TemporaryDirectory(prefix="loopcast-bench-") as tmp:
        out = run_matrix(opts, workloads, Path(tmp), repo=REPO_ROOT, log=lambda line: print(line, flush=True))
    out["settings"]["quick"] = args.quick
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    bugs = report_mismatches(out["baseline"], out["rows"])
    print(f"\nwrote {args.out} in {out['run_seconds']:.0f}s\n")
    print(out["markdown"])
    return 1 if bugs else 0


if __name__ == "__main__":
    sys.exit(main())
