#!/usr/bin/env python3
"""ORT-GenAI's plain greedy decoding per token, timed as tools/bench/host_loop.py times ours.

    python -m tools.bench.genai_decode GENAI_DIR [--device cuda] [--cuda-graph] [--prompt-len 1000]
        [--new-tokens 256] [--runs 3] [--out genai.json]

GENAI_DIR is a folder written by ORT-GenAI's model builder (``python -m
onnxruntime_genai.models.builder -i HF_DIR -o GENAI_DIR -p int4 -e cuda``). A random prompt of
``--prompt-len`` ids (the same seed and draw as host_loop.py, so both see the same ids for the
same vocabulary) is appended, then ``--new-tokens`` tokens are generated one call at a time;
per run: ms per token after the first (the first ``generate_next_token`` finishes the prefill),
``--runs`` runs after one warm-up, medians printed. ``--cuda-graph`` sets the CUDA provider's
``enable_cuda_graph`` (ORT-GenAI captures the decode step once the prompt has run).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path


def _model(og, folder: str, device: str, cuda_graph: bool):
    config = og.Config(folder)
    if device == "cuda":
        config.clear_providers()
        config.append_provider("cuda")
        if cuda_graph:
            config.set_provider_option("cuda", "enable_cuda_graph", "1")
    elif cuda_graph:
        raise SystemExit("error: --cuda-graph needs --device cuda")
    return og.Model(config)


def _vocab_size(folder: str) -> int:
    config = json.loads((Path(folder) / "genai_config.json").read_text())
    return int(config["model"]["vocab_size"])


def run_once(og, model, prompt: list[int], new_tokens: int) -> float:
    """Seconds per token after the first, for one greedy generation."""
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=len(prompt) + new_tokens, do_sample=False)
    generator = og.Generator(model, params)
    generator.append_tokens([prompt])
    generator.generate_next_token()
    generator.get_next_tokens()  # the first token: the prompt's pass has finished
    t0 = time.perf_counter()
    n = 0
    while not generator.is_done():
        generator.generate_next_token()
        generator.get_next_tokens()  # the id reaches the host, as our loop's does
        n += 1
    return (time.perf_counter() - t0) / max(n, 1)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("genai_dir")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--cuda-graph", action="store_true")
    ap.add_argument("--prompt-len", type=int, default=1000)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    import numpy as np
    import onnxruntime_genai as og

    model = _model(og, args.genai_dir, args.device, args.cuda_graph)
    vocab = _vocab_size(args.genai_dir)
    prompt = np.random.default_rng(0).integers(3, vocab, args.prompt_len).tolist()
    run_once(og, model, prompt, 16)
    runs = [1e3 * run_once(og, model, prompt, args.new_tokens) for _ in range(args.runs)]
    median = statistics.median(runs)
    graph = ", CUDA graph" if args.cuda_graph else ""
    print(
        f"ORT-GenAI {og.__version__} {args.genai_dir} on {args.device}{graph}: prompt {args.prompt_len}, "
        f"{args.new_tokens} new tokens, median of {args.runs}: {median:.3f} ms per token end to end"
    )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(
                {"args": vars(args), "runs_ms_per_token": runs, "median_ms_per_token": median}, f, indent=1
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
