"""The ``loopcast bench`` report: the text table, the JSON file (and a PNG), where it goes.

Columns and lines that only mean something on a GPU (captured times, CUDA-graph baselines)
appear only when the run measured them, so a CPU report has no empty or ``nan`` cells.
"""

from __future__ import annotations

import datetime
import json
from pathlib import Path

from loopcast.manifest import DECODE


def format_table(report: dict) -> str:
    """The report as text. Columns and lines that only mean something on a GPU (captured
    times, CUDA-graph baselines) appear only when the run measured them."""
    lines = [
        f"loopcast bench — {report['options']['checkpoint']} on "
        f"{report['machine'].get('gpu', report['options']['device'])}"
        f", onnxruntime {report['onnxruntime']}, {report['date']}"
    ]
    for run in report["runs"]:
        base = report["baselines"].get(run["dtype"], {})
        decode = next((s for s in run["steps"] if s["kind"] == DECODE), None)
        captured = any(s["captured_ms"] for s in run["steps"])
        note = (
            " — captured = one fixed position, timing only" if run.get("captured_fixed_position_only") else ""
        )
        weights = "" if run.get("quantize", "none") == "none" else f" / {run['quantize']} weights"
        depth = f", r = {run['loops']}" if run.get("loops") else ""  # a recurrent-depth run
        lines.append(f"\n{run['dtype']} / {run['variant']}{weights} (past {run['past']}{depth}){note}")
        lines.append(
            f"  {'step':<16}"
            + (f"{'captured ms':>12}{'uncaptured ms':>15}" if captured else f"{'ms':>10}")
            + f"{'/ decode':>10}"
        )
        ref = (decode["captured_ms"] or decode["uncaptured_ms"]) if decode else None
        for s in sorted(run["steps"], key=lambda s: (s["kind"], s["rows"])):
            mine = s["captured_ms"] or s["uncaptured_ms"]
            eager = f"{s['uncaptured_ms']:.3f}" if s["uncaptured_ms"] else "-"
            times = (
                (f"{s['captured_ms']:.3f}" if s["captured_ms"] else "-").rjust(12) + eager.rjust(15)
                if captured
                else eager.rjust(10)
            )
            ratio = f"{mine / ref:.2f}" if ref and mine else "-"
            lines.append(f"  {s['kind'] + '(' + str(s['rows']) + ')':<16}{times}{ratio:>10}")
        for key, what in (
            ("decode_without_pdl_ms", "PDL"),
            ("decode_without_swiglu_stage_ms", "SwiGLU staging"),
        ):
            if run.get(key) and decode and decode["captured_ms"]:
                lines.append(
                    f"  decode captured without {what} {run[key]:.3f} ms "
                    f"(with: {decode['captured_ms']:.3f} ms, {run[key] / decode['captured_ms']:.2f}x)"
                )
        torch_parts = [
            f"{label} {base[key]:.3f} ms"
            for key, label in (("eager_ms", "torch eager"), ("cuda_graph_ms", "torch CUDA graph"))
            if base.get(key)
        ]
        if torch_parts:
            lines.append("  baseline: " + ", ".join(torch_parts))
        if ref and base.get("floor_ms"):
            lines.append("  " + bandwidth_line(base, ref))
        r = run["rows_identical"]
        if r:
            lines.append(
                f"  {'cycle' if run.get('loops') else 'verify'} rows bit-identical to decode: "
                f"{r['bit_identical_rows']}/{r['rows']} "
                f"(max |diff| {r['max_abs_diff']:.3g})"
            )
        for workload, rows in (("", run["end_to_end"]), ("edit, ", run.get("end_to_end_edit") or {})):
            if workload and rows:
                lines.append("  edit workload (the answer copies the prompt's function):")
            for name, e in rows.items():
                gate = f"  gate {e['gate']}: {e['gate_reasons'][-1]}" if e.get("gate_reasons") else ""
                extra = (
                    f"  {e['ms_per_token']:.3f} ms/token, {e['core_calls_per_token']:.2f} passes/token"
                    if "core_calls_per_token" in e
                    else ""
                )
                if e.get("host_share") is not None:
                    extra += f", host {100 * e['host_share']:.0f}% of the time"
                lines.append(
                    f"  {workload + name:<24}{e['tokens_per_s']:>9.1f} tok/s  x{e['speedup']:.2f}  divergent "
                    f"prompts {e['divergent_prompts']}{extra}{gate}"
                )
        if run["alternation"]:
            a = run["alternation"]
            lines.append(
                f"  alternation {a['tokens']} tokens: mean ms per step {a['mean_step_ms']}, "
                f"fallbacks {a['fallbacks']}"
            )
        if run["profile_ms"]:
            parts = ", ".join(f"{k} {v:.2f}" for k, v in run["profile_ms"].items())
            lines.append(f"  decode GPU ms by kernel family: {parts}")
    return "\n".join(lines)


def bandwidth_line(base: dict, decode_ms: float) -> str:
    """Decode against the bandwidth floor, as a share of bandwidth only where that means one:
    the step's bytes must exceed what caches hold (``cache_bytes``), else they are read from
    cache and the "floor" is not one (a tiny model on a CPU read at 118% of "bandwidth")."""
    total = base["bytes_per_step"]["total"]
    floor = f"floor {base['floor_ms']:.3f} ms ({total / 1e6:.1f} MB at {base['bandwidth_gbs']:.0f} GB/s)"
    if total <= base.get("cache_bytes", 0):
        cache_mib = base["cache_bytes"] / 2**20
        return f"{floor}: not a floor here, the step's bytes fit in cache ({cache_mib:.0f} MiB)"
    share = base["floor_ms"] / decode_ms
    if share > 1:  # the copy measurement undershoots what the step's reads reach: no ratio to print
        return f"{floor}: decode {decode_ms:.3f} ms beats it, so the measured copy bandwidth is no bound here"
    return f"{floor}: decode {decode_ms:.3f} ms runs at {share * 100:.0f}% of bandwidth"


def default_report_path(checkpoint: str, device: str) -> Path:
    """``<cache>/bench/bench-<checkpoint>-<device>-<UTC time>.json``: never the working directory."""
    from loopcast.devices import cache_root

    name = Path(checkpoint.replace("preset:", "preset-")).name or "checkpoint"
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%dT%H%M%SZ")
    return cache_root() / "bench" / f"bench-{name}-{device}-{stamp}.json"


def write_report(report: dict, out: Path, plot: bool = True) -> list[Path]:
    """JSON always; a PNG of step times when matplotlib is installed (and ``plot``)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(report, indent=1) + "\n")
    tmp.replace(out)
    written = [out]
    if not plot:
        return written
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return written
    fig, ax = plt.subplots(figsize=(9, 4.5))
    labels, values = [], []
    for run in report["runs"]:
        for s in sorted(run["steps"], key=lambda s: (s["kind"], s["rows"])):
            quant = "" if run.get("quantize", "none") == "none" else "/" + run["quantize"]
            labels.append(f"{run['dtype']}/{run['variant'][:5]}{quant}\n{s['kind']}({s['rows']})")
            values.append(s["captured_ms"] or s["uncaptured_ms"])
    ax.bar(range(len(values)), values)
    ax.set_xticks(range(len(values)), labels, rotation=90, fontsize=6)
    ax.set_ylabel("ms per step")
    ax.set_title(f"loopcast bench: {report['options']['checkpoint']}")
    fig.tight_layout()
    png = out.with_suffix(".png")
    fig.savefig(png, dpi=120)
    plt.close(fig)
    return written + [png]
