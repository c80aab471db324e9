"""Is ONNX Runtime's MatMulNBits row-invariant on this CPU? (docs/architecture.md, "Quantized weights")

    python -m tools.probes.check_matmulnbits_rows [--rows 8] [--threads 0]

Builds one-node com.microsoft MatMulNBits graphs for bits 4 and 8, block sizes 32/64/128,
symmetric and asymmetric (zero points), accuracy_level 0/1/4, at the demo model's projection
shapes and a ~135M Llama's (K=576, N=1536 ...) on random codes, runs M = 2..rows rows in one call
and each row alone (M=1), and prints per combination whether every row of every M equals its M=1 row bit for
bit, and the largest difference. Row-invariant combinations keep ``exact_verify`` true.
"""

from __future__ import annotations

import argparse
import itertools

import numpy as np
import onnxruntime as ort
from loopcast.exporter.matmulnbits_rows import matmulnbits_session, random_tensors, rows_differ

from loopcast.quant import QuantLinear

# (label, K, N): demo (H 384, I 1024, 6+6+6 heads of 64) and SmolLM-135M (H 576, I 1536, 9+3+3 heads)
SHAPES = [
    ("demo qkv", 384, 1152),
    ("demo down", 1024, 384),
    ("demo head", 384, 4096),
    ("135M gate_up", 576, 3072),
    ("135M down", 1536, 576),
    ("135M qkv", 576, 960),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--threads", type=int, default=0, help="intra-op threads (0: ORT's default)")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    print(f"onnxruntime {ort.__version__}, M = 1..{args.rows}")
    print(f"{'bits':>4} {'block':>5} {'zp':>5} {'level':>5}  invariant  max|diff|  shapes not invariant")
    for bits, block, symmetric, level in itertools.product((4, 8), (32, 64, 128), (True, False), (0, 1, 4)):
        bad, worst = [], 0.0
        for label, k, n in SHAPES:
            linear = QuantLinear(label, k, n, bits, block, symmetric, level)
            try:
                sess = matmulnbits_session(linear, *random_tensors(linear, rng), threads=args.threads)
            except Exception as exc:  # an unsupported combination: say so, keep going
                bad.append(f"{label}: {type(exc).__name__}")
                continue
            diff = rows_differ(sess, k, args.rows, rng)
            worst = max(worst, diff)
            if diff:
                bad.append(label)
        zp = "sym" if symmetric else "asym"
        verdict = "yes" if not bad else "NO"
        print(f"{bits:>4} {block:>5} {zp:>5} {level:>5}  {verdict:>9}  {worst:9.2e}  {', '.join(bad)}")


if __name__ == "__main__":
    main()
