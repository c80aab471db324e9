"""The torch reference (exporter/reference_huginn.py) against the release's own modeling code.

    python tools/probes/check_huginn_release.py --release-dir DIR [--checkpoint CKPT] [--loops 1 4 32]

``DIR`` holds the release's ``raven_modeling_minimal.py`` and ``raven_config_minimal.py`` (from
the ``tomg-group-umd/huginn-0125`` Hugging Face repository, or ``recpre/`` of
github.com/seal-rg/recurrent-pretraining); they are imported from there at run time, never
copied into loopcast. ``CKPT`` is a Huginn checkpoint directory (default: a fresh random
``tiny-huginn``). The release's ``RavenForCausalLM`` is built from the checkpoint's config.json
fields and loaded with its safetensors; both models run the same tokens with a zero initial
state (the release's ``input_states``) at each r, without and with the KV cache (the release's
``HuginnDynamicCache``, token by token), and the probe prints the largest logit difference and
whether the argmax agrees. Needs ``transformers`` besides torch.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import tempfile
from pathlib import Path

import torch


def _release(release_dir: Path):
    sys.path.insert(0, str(release_dir.parent))
    package = release_dir.name
    (release_dir / "__init__.py").touch(exist_ok=True)
    config = importlib.import_module(f"{package}.raven_config_minimal")
    modeling = importlib.import_module(f"{package}.raven_modeling_minimal")
    return config.RavenConfig, modeling


class _Record:
    def __init__(self, **fields) -> None:
        self.__dict__.update(fields)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--release-dir", type=Path, required=True)
    parser.add_argument("--checkpoint", type=Path)
    parser.add_argument("--loops", type=int, nargs="+", default=[1, 4, 32])
    parser.add_argument("--tokens", type=int, default=8)
    args = parser.parse_args()

    from loopcast.exporter.checkpoint import load_checkpoint
    from loopcast.exporter.random_checkpoint import write_random_checkpoint
    from loopcast.exporter.reference import KVCache
    from safetensors.torch import load_file

    from loopcast.presets import PRESETS

    ckpt = args.checkpoint
    if ckpt is None:
        ckpt = write_random_checkpoint(
            PRESETS["tiny-huginn"], Path(tempfile.mkdtemp()) / "ckpt", seed=4, std=0.1
        )
    raw = json.loads((ckpt / "config.json").read_text())
    RavenConfig, modeling = _release(args.release_dir.resolve())
    fields = {
        k: raw[k]
        for k in (
            "n_embd",
            "n_heads",
            "n_layers",
            "block_size",
            "vocab_size",
            "tie_embeddings",
            "intermediate_size",
            "n_layers_in_recurrent_block",
            "mean_recurrence",
            "n_layers_in_prelude",
            "n_layers_in_coda",
            "qk_bias",
            "rope_base",
            "norm_eps",
        )
    }
    if isinstance(modeling.RavenPreTrainedModel._tied_weights_keys, list):
        # transformers >= 5 wants the tie as a mapping (target -> source); the release's code is a list
        modeling.RavenPreTrainedModel._tied_weights_keys = {"lm_head.weight": "transformer.wte.weight"}
    # transformers >= 5 rejects the release's output record's fields: a plain record instead
    modeling.CausalLMOutputRecurrentLatents = _Record
    release = modeling.RavenForCausalLM(RavenConfig(**fields)).eval()
    state = load_file(ckpt / "model.safetensors")
    missing, unexpected = release.load_state_dict(state, strict=False)
    missing = [m for m in missing if m not in ("freqs_cis", "lm_head.weight")]
    if missing or unexpected:
        raise SystemExit(f"state dict mismatch: missing {missing}, unexpected {unexpected}")
    if release.config.tie_embeddings:
        release.tie_weights()
    ours = load_checkpoint(ckpt).eval()
    ids = torch.tensor([[(7 * i + 3) % raw["vocab_size"] for i in range(args.tokens)]])
    worst = 0.0
    for r in args.loops:
        with torch.no_grad():
            theirs = release(
                input_ids=ids,
                num_steps=torch.tensor([r, 0]),
                input_states=torch.zeros(1, ids.shape[1], raw["n_embd"]),
            ).logits[0]
            mine = ours(ids, loops=r, seed=None).logits[0]
            # cached, token by token: the release's dynamic cache against loopcast's KV slots
            cache = modeling.HuginnDynamicCache()
            cache_ours = KVCache(ours.config.replace(num_loops=max(r, ours.config.num_loops)), ids.shape[1])
            ours_cached = ours.config.num_loops >= r
            rows_theirs, rows_mine = [], []
            for p in range(ids.shape[1]):
                step = release(
                    input_ids=ids[:, p : p + 1],
                    num_steps=torch.tensor([r, 0]),
                    input_states=torch.zeros(1, 1, raw["n_embd"]),
                    past_key_values=cache,
                    use_cache=True,
                    position_ids=torch.tensor([[p]]),
                )
                rows_theirs.append(step.logits[0, -1])
                if ours_cached:
                    rows_mine.append(
                        ours(ids[:, p : p + 1], loops=r, start=p, cache=cache_ours).logits[0, -1]
                    )
        diff = float((theirs - mine).abs().max())
        same = bool((theirs.argmax(-1) == mine.argmax(-1)).all())
        line = f"r={r:<3} full forward: max |logit diff| {diff:.2e}, argmax equal {same}"
        worst = max(worst, diff)
        if rows_mine:
            cached = float((torch.stack(rows_theirs) - torch.stack(rows_mine)).abs().max())
            line += f"; cached token by token: {cached:.2e}"
            worst = max(worst, cached)
        print(line, flush=True)
    print(f"worst {worst:.2e}")


if __name__ == "__main__":
    main()
