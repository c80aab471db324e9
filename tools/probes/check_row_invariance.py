"""Are verify rows bit-identical to decode rows? (stock ORT ops, CPU)

    python -m tools.probes.check_row_invariance [ARTIFACT]    (default: the demo artifact)

For several random positions, runs the same W tokens once through the verify graph (W rows in
one step) and once through the decode graph (one row per step, same positions, same KV), and
compares each row's logits: bit-identical rows, max |Δ|, and whether the argmax agrees. This
is the measurement behind the batch-invariant custom-op issue.
"""

from __future__ import annotations

import sys

import numpy as np
from loopcast.ort_runtime.binding.generator import Generator
from loopcast.ort_runtime.loading.artifact import open_artifact


def main() -> None:
    if len(sys.argv) > 1:
        path = sys.argv[1]
    else:
        from loopcast.exporter.demo_artifact import demo_artifact_dir

        path = demo_artifact_dir()
    model = open_artifact(path)
    W = model.manifest.verify_width
    rng = np.random.default_rng(0)
    identical = total = argmax_same = 0
    worst = 0.0
    for _trial in range(8):
        prompt = rng.integers(3, model.config.vocab_size, int(rng.integers(1, 40))).tolist()
        rows = rng.integers(3, model.config.vocab_size, W).tolist()
        a, b = Generator(model), Generator(model)
        a.prefill(prompt)
        b.prefill(prompt)
        verify = a.run("verify", a.n, tokens=rows).logits.copy()
        for i, token in enumerate(rows):
            decode = b.run("decode", b.n + i, tokens=[token]).logits[0].copy()
            total += 1
            identical += int(np.array_equal(decode, verify[i]))
            argmax_same += int(decode.argmax() == verify[i].argmax())
            worst = max(worst, float(np.abs(decode - verify[i]).max()))
    print(
        f"{path}: W={W}, {total} rows: {identical} bit-identical, argmax equal in {argmax_same}, "
        f"max |logit diff| {worst:.3g}"
    )


if __name__ == "__main__":
    main()
