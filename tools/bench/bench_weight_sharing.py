"""Memory of one loaded artifact, per way of holding its weights, with step times.

    python -m tools.bench.bench_weight_sharing [ARTIFACT ...] [--device cpu|cuda] [--repeats 3] [--json OUT]
                                          (default: the demo artifact)

Each (artifact, mode) runs in a fresh child process, modes interleaved over ``--repeats``
rounds: open the artifact, prefill a 32-token prompt, 64 decode steps, 16 verify steps on one
generator; then report peak RSS (VmHWM), RSS, PSS and private memory from /proc (on CUDA: the
GPU's used memory from nvidia-smi less the idle GPU's), the load time, median decode and verify step times,
and whether verify rows equal decode rows bit for bit.

Modes: ``baseline`` (no artifact: the runtime's imports and, on CUDA, a one-node session),
``default``, ``per_session`` (every session its own copy of the weights: before
ort_runtime/loading/shared_weights.py), ``kinds=N`` (only the first N kinds opened, ``--kinds-rows``).
CPU also: ``speculative`` (the default after a speculative generation made the sessions of
the kinds it defers: ort_runtime/loading/session_table.py), ``eager`` (every kind's session at load:
before those were deferred), ``verify_own`` (verify in its own session: before verify ran on
prefill's), ``separate`` (one session per graph kind: before decode shared prefill's session),
``share_weights`` (no prepacking at all).

The budget line per artifact: ``1.2 × (weights + KV) + baseline`` against the default's peak
RSS (CPU) or device memory (CUDA), with the decode step against ``per_session``'s.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

CHILD = r"""
import json, os, subprocess, sys, time
import numpy as np
from loopcast.ort_runtime.loading.artifact import open_artifact
from loopcast.ort_runtime.decoding.exactness import decode_rows
from loopcast.ort_runtime.binding.generator import Generator
path, device, mode = sys.argv[1:4]
kw = {"separate": {"share_sessions": False, "defer_sessions": False},
      "share_weights": {"share_weights": True},
      "per_session": {"shared_initializers": False}, "eager": {"defer_sessions": False},
      "verify_own": {"share_sessions": ("decode",), "defer_sessions": False}}.get(mode, {})
if mode.startswith("kinds="):
    from loopcast.manifest import Manifest
    kw = {"kinds": tuple(Manifest.read(path).graphs)[:int(mode[6:])]}
out = {}
if mode == "baseline":
    # the runtime's own footprint: its imports and, on CUDA, one session of a one-node graph
    # (CUDA context, the provider's libraries and arena) run once
    import onnx, onnxruntime as ort
    from onnx import helper, TensorProto
    g = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])])
    if device == "cuda":
        ort.preload_dlls()
    model = helper.make_model(g, ir_version=10, opset_imports=[helper.make_opsetid("", 21)])
    s = ort.InferenceSession(model.SerializeToString(),
                             providers=[
                                 "CUDAExecutionProvider" if device == "cuda" else "CPUExecutionProvider"
                             ])
    s.run(None, {"x": np.zeros(1, np.float32)})
else:
    t0 = time.perf_counter()
    model = open_artifact(path, device, **kw)
    if mode == "speculative":  # what a self-speculative or pipeline generation opens on first use
        for kind in model.sessions:
            model.sessions[kind]
    made = model.sessions.made() if hasattr(model.sessions, "made") else model.sessions
    out = {"load_s": round(time.perf_counter() - t0, 2), "sessions": len({id(s) for s in made.values()}),
           "shared_weights": model.shared_weights is not None}
    m, cfg = model.manifest, model.config
    slots = len(m.graphs["decode"].kv_slots) if "decode" in m.graphs else 0
    out["kv_mib"] = round(2 * slots * cfg.num_kv_heads * m.max_length * cfg.head_dim
                          * {"fp32": 4, "fp16": 2, "bf16": 2}[m.dtype] / 2**20, 1)
if mode != "baseline" and ("kinds" not in kw or "verify" in model.sessions):
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, model.config.vocab_size, 32).tolist()
    gen = Generator(model)
    fed, rows = decode_rows(gen, prompt, 64)
    width = model.manifest.graphs["verify"].rows
    gen.rewind(32)
    v = [gen.run("verify", gen.n, tokens=fed[:width]) for _ in range(16)][-1]
    out["exact_rows"] = all(np.array_equal(v.logits[i], rows[i]) for i in range(width))
    out["decode_ms"] = round(1000 * np.median(gen.clock.seconds("decode") / gen.clock.runs("decode")), 2)
    out["verify_ms"] = round(1000 * gen.clock.seconds("verify") / gen.clock.runs("verify"), 2)
status = {l.split(":")[0]: int(l.split()[1]) // 1024
          for l in open("/proc/self/status") if l.startswith(("VmHWM", "VmRSS"))}
smaps = {l.split(":")[0]: int(l.split()[1]) // 1024
         for l in open("/proc/self/smaps_rollup") if ":" in l and l.split()[1].isdigit()}
out.update(peak_rss_mib=status["VmHWM"], rss_mib=status["VmRSS"], pss_mib=smaps["Pss"],
           private_mib=smaps["Private_Clean"] + smaps["Private_Dirty"])
if device == "cuda":
    # The whole GPU's used memory (nvidia-smi's per-process PIDs are the host's inside a container);
    # the parent subtracts what the idle GPU used before any child ran.
    q = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", "0"],
                       capture_output=True, text=True).stdout
    out["gpu_used_mib"] = int(q.split()[0])
weights = os.path.getsize(os.path.join(path, "weights.safetensors"))
out["weights_mib"] = round(weights / 2**20, 1)
print(json.dumps(out))
"""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("artifacts", nargs="*")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", help="write every run here")
    p.add_argument("--kinds-rows", action="store_true", help="also a row per number of kinds opened")
    args = p.parse_args()
    if not args.artifacts:
        from loopcast.exporter.demo_artifact import demo_artifact_dir

        args.artifacts = [str(demo_artifact_dir())]
    runs: dict[tuple[str, str], list[dict]] = {}
    idle = 0
    if args.device == "cuda":
        idle = int(
            subprocess.run(
                ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", "0"],
                capture_output=True,
                text=True,
                check=True,
            ).stdout.split()[0]
        )
    for repeat in range(args.repeats):
        for artifact in args.artifacts:
            modes = ["baseline", "default", "per_session"]
            if args.device == "cpu":
                modes += ["speculative", "eager", "verify_own", "separate", "share_weights"]
            if args.kinds_rows:
                from loopcast.manifest import Manifest

                modes += [f"kinds={k}" for k in range(1, len(Manifest.read(artifact).graphs) + 1)]
            for mode in modes if repeat % 2 == 0 else modes[::-1]:
                done = subprocess.run(
                    [sys.executable, "-c", CHILD, artifact, args.device, mode], capture_output=True, text=True
                )
                if done.returncode:
                    print(f"{artifact} {mode}: failed\n{done.stderr[-2000:]}", file=sys.stderr)
                    continue
                run = json.loads(done.stdout.strip().splitlines()[-1])
                if "gpu_used_mib" in run:
                    run["device_mib"] = run["gpu_used_mib"] - idle
                runs.setdefault((artifact, mode), []).append(run)
    keys = [
        "sessions",
        "shared_weights",
        "load_s",
        "peak_rss_mib",
        "pss_mib",
        "private_mib",
        "decode_ms",
        "verify_ms",
        "exact_rows",
    ]
    if args.device == "cuda":
        keys.insert(2, "device_mib")
    print(
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {args.device}, medians of {args.repeats} "
        "interleaved runs (range in brackets)"
    )
    print("| artifact | mode | weights MiB | " + " | ".join(keys) + " |")
    print("|---|---|---:|" + "---:|" * len(keys))
    for (artifact, mode), rs in runs.items():
        cells = []
        for k in keys:
            vals = [r[k] for r in rs if k in r]
            if not vals:
                cells.append("—")
            elif isinstance(vals[0], bool):
                cells.append(str(all(vals)))
            else:
                med = statistics.median(vals)
                cells.append(
                    f"{med:g}"
                    + (
                        f" [{min(vals):g}–{max(vals):g}]"
                        if len(vals) > 1 and min(vals) != max(vals) and k not in ("sessions",)
                        else ""
                    )
                )
        print(
            f"| {artifact.rstrip('/').split('/')[-1]} | {mode} | {rs[0]['weights_mib']} | "
            + " | ".join(cells)
            + " |"
        )

    def med(artifact, mode, key):
        return statistics.median(r[key] for r in runs.get((artifact, mode), [{key: float("nan")}]))

    for artifact in args.artifacts:
        if (artifact, "default") not in runs or (artifact, "baseline") not in runs:
            continue
        used_key = "device_mib" if args.device == "cuda" else "peak_rss_mib"
        base = med(artifact, "baseline", used_key)
        weights_kv = med(artifact, "default", "weights_mib") + med(artifact, "default", "kv_mib")
        budget = 1.2 * weights_kv + base
        used = med(artifact, "default", used_key)
        before = "verify_own" if args.device == "cpu" else "per_session"
        slower = med(artifact, "default", "decode_ms") / med(artifact, before, "decode_ms") - 1
        print(
            f"{artifact.rstrip('/').split('/')[-1]}: {used_key} {used:g} MiB against 1.2 x (weights + KV "
            f"{weights_kv:g}) + baseline {base:g} = {budget:.0f} MiB: {used / budget:.2f} of the budget "
            f"({'within' if used <= budget else 'OVER'}); decode {slower:+.1%} against {before}"
        )
        if (artifact, "speculative") in runs:
            spec = med(artifact, "speculative", used_key)
            print(
                f"  after a speculative generation opened its kinds: {spec:g} MiB, "
                f"{spec / budget:.2f} of the budget"
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({f"{a}|{m}": rs for (a, m), rs in runs.items()}, f, indent=1)


if __name__ == "__main__":
    main()
