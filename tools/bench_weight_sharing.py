"""Resident memory of one loaded artifact with and without ORT weight prepacking.

    python tools/bench_weight_sharing.py [ARTIFACT]      (default: the demo artifact)

Each mode runs in a fresh child process: load all graph kinds, generate 64 tokens with
prompt lookup (so decode and verify both run), then report VmRSS / private memory (from
/proc/self/smaps_rollup) and the mean decode and verify step times.
"""

from __future__ import annotations

import json
import subprocess
import sys

CHILD = r"""
import json, sys
from loopcast.ort_runtime import load
m = load(sys.argv[1], share_weights=sys.argv[2] == "1")
text = "def area(w, h):\n    return w * h\n\n\ndef area("
for _ in range(2):
    r = m.generate(text * 2, 64, stop_ids=(), speculative="prompt-lookup")
mem = {}
for line in open("/proc/self/smaps_rollup"):
    key, _, rest = line.partition(":")
    if key in ("Rss", "Pss", "Private_Clean", "Private_Dirty", "Shared_Clean"):
        mem[key] = int(rest.split()[0]) // 1024
s = r.stats
mem["decode_ms"] = round(1000 * s.step_seconds.get("decode", 0) / max(1, s.steps.get("decode", 0)), 2)
mem["verify_ms"] = round(1000 * s.step_seconds.get("verify", 0) / max(1, s.steps.get("verify", 0)), 2)
mem["weights_mb"] = round(__import__("os").path.getsize(sys.argv[1] + "/weights.safetensors") / 2**20, 1)
print(json.dumps(mem))
"""


def main() -> None:
    if len(sys.argv) > 1:
        artifact = sys.argv[1]
    else:
        from loopcast.demo import demo_artifact_dir
        artifact = str(demo_artifact_dir())
    rows = {}
    for share in ("0", "1"):
        out = subprocess.run([sys.executable, "-c", CHILD, artifact, share], check=True,
                             capture_output=True, text=True).stdout
        rows["share_weights" if share == "1" else "prepacked (default)"] = json.loads(out.strip().splitlines()[-1])
    print(json.dumps(rows, indent=1))
    print("| mode | RSS MiB | private MiB | decode ms | verify(W) ms | weights file MiB |")
    print("|---|---:|---:|---:|---:|---:|")
    for mode, m in rows.items():
        print(f"| {mode} | {m['Rss']} | {m['Private_Clean'] + m['Private_Dirty']} | {m['decode_ms']} | "
              f"{m['verify_ms']} | {m['weights_mb']} |")


if __name__ == "__main__":
    main()
