"""Prompt lookup on a suite of rename requests: its speedup over plain greedy, per request and as a
geometric mean, for one or more prompt-lookup settings measured in the same run.

    python -m tools.bench.bench_lookup_edits ART [--passes 3] [--new-tokens 160] \
        [--variant ng3:max_ngram=3 --variant ng6:max_ngram=6] [--json r.json]

Each request asks, through the artifact's chat template (plain text without one), to rename one
argument of a function from Python's standard library and to reply with the whole function: the
answer copies most of the prompt, as edits do. Per pass and request: plain greedy first, then each
variant in turn (the order reversed every other pass), decode tok/s = tokens after the first over
the time from the first token to the last; a variant's ratio is taken against that pass's plain
run, and the report gives each request's median ratio and their geometric mean. Every variant's
tokens must equal plain greedy's (exit status 1 otherwise). A variant is ``LABEL:KEY=VALUE,...``
over the generation options (``max_ngram``, ``min_ngram``, ``num_draft_tokens``, ``gate``).
"""

from __future__ import annotations

import argparse
import inspect
import json
import statistics
import sys
import time
from pathlib import Path

# (module, qualified name, the argument renamed, its new name): stdlib functions whose source
# ships with every CPython.
EDITS = (
    ("statistics", "mean", "data", "values"),
    ("statistics", "median", "data", "values"),
    ("shutil", "copyfileobj", "length", "size"),
    ("textwrap", "indent", "prefix", "pad"),
    ("textwrap", "dedent", "text", "source"),
    ("json", "dumps", "obj", "value"),
    ("csv", "DictReader.__init__", "f", "stream"),
    ("fractions", "Fraction.limit_denominator", "max_denominator", "limit"),
)
MAX_SOURCE_CHARS = 900  # keeps each request well inside a 1024-position artifact


def edit_requests() -> dict[str, str]:
    """Request name -> the user turn: the rename asked, then the function's source (blank lines
    dropped, cut at MAX_SOURCE_CHARS)."""
    import importlib

    out = {}
    for module, name, old, new in EDITS:
        obj = importlib.import_module(module)
        for part in name.split("."):
            obj = getattr(obj, part)
        lines = [line for line in inspect.getsource(obj).splitlines() if line.strip()]
        source = "\n".join(lines)[:MAX_SOURCE_CHARS]
        out[name] = (
            f"Rename the variable `{old}` to `{new}` in this Python function. Reply with the whole "
            f"function only.\n\n```python\n{source}\n```"
        )
    return out


def parse_variant(text: str) -> tuple[str, dict]:
    label, _, rest = text.partition(":")
    if not label or not rest:
        raise SystemExit(f"error: --variant {text!r}: expected LABEL:KEY=VALUE[,KEY=VALUE]")
    options: dict = {}
    for item in rest.split(","):
        key, _, value = item.partition("=")
        if not key or not value:
            raise SystemExit(f"error: --variant {text!r}: {item!r} is not KEY=VALUE")
        options[key.strip()] = int(value) if value.strip().lstrip("-").isdigit() else value.strip()
    return label, options


def _prompt_ids(path: Path, tokenizer, text: str) -> list[int]:
    from loopcast.ort_runtime.text.chat import load_chat_template

    template = load_chat_template(path)
    if template is None:
        return tokenizer.encode(text).ids
    rendered = template.render([{"role": "user", "content": text}], add_generation_prompt=True)
    return tokenizer.encode(rendered, add_special_tokens=False).ids


def _timed(model, ids: list[int], new_tokens: int, **options) -> tuple[list[int], float]:
    tokens, first = [], 0.0
    for token in model.stream_ids(ids, max_new_tokens=new_tokens, **options):
        if not tokens:
            first = time.perf_counter()
        tokens.append(int(token))
    rate = (len(tokens) - 1) / (time.perf_counter() - first) if len(tokens) > 1 else 0.0
    return tokens, rate


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("artifact", type=Path)
    p.add_argument("--passes", type=int, default=3)
    p.add_argument("--new-tokens", type=int, default=160)
    p.add_argument("--variant", action="append", default=None, help="LABEL:KEY=VALUE,... (default: lookup:)")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    from loopcast.ort_runtime import load
    from tokenizers import Tokenizer

    variants = dict(parse_variant(v) for v in args.variant) if args.variant else {"lookup": {}}
    model = load(args.artifact)
    tokenizer = Tokenizer.from_file(str(args.artifact / "tokenizer.json"))
    prompts = {name: _prompt_ids(args.artifact, tokenizer, text) for name, text in edit_requests().items()}
    ratios: dict[str, dict[str, list[float]]] = {label: {name: [] for name in prompts} for label in variants}
    identical = True
    for i in range(args.passes):
        for name, ids in prompts.items():
            plain, plain_rate = _timed(model, ids, args.new_tokens)
            order = list(variants) if i % 2 == 0 else list(variants)[::-1]
            for label in order:
                options = variants[label]
                tokens, rate = _timed(model, ids, args.new_tokens, speculative="prompt-lookup", **options)
                if tokens != plain:
                    identical = False
                    print(f"pass {i} {name} {label}: tokens DIFFER from plain greedy", flush=True)
                ratios[label][name].append(rate / plain_rate if plain_rate else 0.0)
                print(f"pass {i} {name:28s} {label:10s} x{ratios[label][name][-1]:.2f}", flush=True)
    report: dict = {"passes": args.passes, "new_tokens": args.new_tokens, "identical_to_plain": identical}
    print("\n| variant | geomean | " + " | ".join(prompts) + " |")
    for label in variants:
        medians = {name: statistics.median(v) for name, v in ratios[label].items()}
        geo = statistics.geometric_mean(medians.values())
        report[label] = {"options": variants[label], "geomean": geo, "median_by_request": medians}
        print(f"| {label} | {geo:.3f} | " + " | ".join(f"{m:.2f}" for m in medians.values()) + " |")
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=1))
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
