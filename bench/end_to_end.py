"""``loopcast bench``'s end-to-end rows: tokens/s of plain greedy and of each speculative mode
on the same prompts, tokens compared with plain greedy's (the first divergence and plain's top-1
margin there), and whether verify rows are the decode rows bit for bit."""

from __future__ import annotations

import statistics
import time

import numpy as np
from loopcast.bench.pipeline import oracle_rows
from loopcast.ort_runtime.decoding.exactness import decode_rows

from loopcast.manifest import CYCLE, CYCLE_RUN, DECODE, DRAFT, VERIFY


def rows_identical(model, prompts: list[list[int]]) -> dict:
    """Per prompt: W decode steps (M=1) vs one verify(W) step over the same tokens."""
    W = model.loaded.manifest.verify_width
    same, total, worst = 0, 0, 0.0
    for prompt in prompts:
        gen = model.new_generator()
        fed, rows = decode_rows(gen, prompt, W)
        gen.rewind(len(prompt))
        verify = gen.run(VERIFY, gen.n, tokens=fed).logits
        for i in range(W):
            total += 1
            same += bool(np.array_equal(verify[i], rows[i]))
            worst = max(worst, float(np.abs(verify[i] - rows[i]).max()))
    return {"bit_identical_rows": same, "rows": total, "max_abs_diff": worst}


def _first_divergence(model, prompt: list[int], plain: list[int], other: list[int]) -> dict:
    """Where ``other`` leaves plain greedy, and plain greedy's top-1/top-2 margin there."""
    j = next((i for i, (x, y) in enumerate(zip(plain, other)) if x != y), min(len(plain), len(other)))
    if j >= len(plain):
        return {"index": j, "margin": None}
    # Token j of plain greedy comes from the step that fed the token before it.
    context = prompt + plain[:j]
    gen = model.new_generator()
    if len(context) > 1:
        gen.prefill(context[:-1])
    top = np.sort(gen.run(DECODE, gen.n, tokens=[context[-1]]).logits[0])[-2:]
    return {"index": j, "margin": float(top[1] - top[0])}


def end_to_end(
    model,
    prompts: list[list[int]],
    new_tokens: int,
    oracle_rejects: tuple[float, ...] = (),
    speculative: tuple[str, ...] = ("prompt-lookup", "self", "pipeline"),
    passes: int = 1,
) -> dict:
    """tokens/s of plain greedy and of each ``speculative`` mode with the default gate (auto)
    and ungated (gate always); tokens vs plain greedy. Stock artifacts are not exact, so their
    modes run with allow_inexact and the divergent prompts are counted. With ``oracle_rejects``,
    the pipeline also runs on oracle drafts (bench/pipeline.py).

    ``passes`` passes over the prompts, the modes taking turns prompt by prompt, so that drift
    on the machine (clocks, other jobs) hits every mode alike; a mode's ``speedup`` is the
    median over passes of its rate against plain's in the same pass."""
    exact = model.loaded.exact_verify
    modes = [("plain", {})]
    for mode in speculative:
        if (mode == "self" and not model.loaded.has(DRAFT)) or (
            mode == "pipeline" and not model.loaded.has(CYCLE)
        ):
            continue
        base = {
            "speculative": mode,
            "num_draft_tokens": None if mode == "pipeline" else 4,
            "allow_inexact": not exact,
        }
        modes += [(mode, {**base, "gate": "auto"}), (f"{mode} (gate always)", {**base, "gate": "always"})]
        if mode == "pipeline" and model.loaded.has(CYCLE_RUN):  # the host-scheduled lanes, for comparison
            modes.append(
                (
                    "pipeline (one cycle per call, gate always)",
                    {**base, "gate": "always", "pipeline_device_lanes": False},
                )
            )
    plain_tokens: dict[int, list[int]] = {}
    runs = {name: [] for name, _ in modes}
    for _ in range(passes):
        acc = {
            name: {
                "tokens": 0,
                "seconds": 0.0,
                "divergent": 0,
                "firsts": [],
                "accepted": 0,
                "proposed": 0,
                "rounds": 0,
                "reasons": [],
                "gate_report": None,
            }
            for name, _ in modes
        }
        for i, prompt in enumerate(prompts):
            for name, kwargs in modes:
                a = acc[name]
                model.generate(prompt, 8, stop_ids=(), **kwargs)  # warm the slots this mode uses
                t0 = time.perf_counter()
                out = model.generate(prompt, new_tokens, stop_ids=(), **kwargs)
                a["seconds"] += time.perf_counter() - t0
                a["tokens"] += len(out.tokens)
                a["accepted"] += out.stats.accepted
                a["proposed"] += out.stats.proposed
                a["rounds"] += out.stats.rounds
                if out.stats.gate_report:
                    a["reasons"].append(out.stats.gate_report.get("reason"))
                    a["gate_report"] = out.stats.gate_report
                if name == "plain":
                    plain_tokens.setdefault(i, out.tokens)
                if out.tokens != plain_tokens[i]:
                    a["divergent"] += 1
                    a["firsts"].append(_first_divergence(model, prompt, plain_tokens[i], out.tokens))
        for name, a in acc.items():
            runs[name].append(a)
    result = {}
    for name, kwargs in modes:
        rates = [a["tokens"] / a["seconds"] for a in runs[name]]
        ratios = [r / (p["tokens"] / p["seconds"]) for r, p in zip(rates, runs["plain"], strict=True)]
        mid = sorted(range(passes), key=lambda j: rates[j])[passes // 2]  # the median pass
        a = runs[name][mid]
        result[name] = {
            "tokens_per_s": rates[mid],
            "ms_per_token": 1e3 * a["seconds"] / a["tokens"],
            "tokens": a["tokens"],
            "seconds": a["seconds"],
            "divergent_prompts": max(r["divergent"] for r in runs[name]),
            "first_divergences": a["firsts"],
            "rounds": a["rounds"],
            "acceptance": a["accepted"] / a["proposed"] if a["proposed"] else None,
            "gate": kwargs.get("gate"),
            "gate_reasons": a["reasons"],
            "gate_report": a["gate_report"],
            "exact_verify": exact,
            "speedup": statistics.median(ratios),
            "pass_speedups": [round(x, 4) for x in ratios],
        }
    if oracle_rejects and model.loaded.has(CYCLE) and exact:
        oracle = oracle_rows(model, prompts, plain_tokens, new_tokens, oracle_rejects)
        for entry in oracle.values():
            entry["speedup"] = entry["tokens_per_s"] / result["plain"]["tokens_per_s"]
        result.update(oracle)
    return result
