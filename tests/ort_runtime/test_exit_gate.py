"""Ouro's exit gate on the runtime (ort_runtime/decoding/exits.py): tokens equal the torch
reference with the same options (exporter/reference_depth.py) under both KV policies, on tiny
checkpoints with R = 2, 3, 4 and the demo; forced gates (a gate bias that makes every token
exit at loop 1, or never before the last) against static depths; min/max clamps; EOS and the
KV capacity; refusals."""

from __future__ import annotations

import json
import shutil

import pytest
from loopcast.exporter.export import ExportOptions, export_checkpoint
from loopcast.exporter.reference_depth import depth_generate
from loopcast.ort_runtime.api import load
from loopcast.ort_runtime.decoding.exits import exit_loop
from loopcast.ort_runtime.decoding.generation_config import GenerationConfig
from loopcast.ort_runtime.decoding.sampling import SamplingParams
from safetensors.numpy import load_file, save_file

from loopcast.errors import RequestError
from tests.artifacts import artifact, checkpoint, reference, scratch_root

PROMPT = [3, 5, 7, 11, 2, 9]


@pytest.mark.parametrize("name", ["ouro-r2-gqa", "ouro-r3", "ouro-r4-1layer"])
@pytest.mark.parametrize("policy", ["full", "last-exited"])
def test_tokens_equal_the_reference(name: str, policy: str) -> None:
    model, ref = load(artifact(name)), reference(name)
    depths = set()
    for q in (0.1, 0.3, 0.5, 0.7):
        config = GenerationConfig(16, exit_threshold=q, kv_policy=policy, stop_ids=())
        got, want = model.generate(PROMPT, config=config), depth_generate(ref, PROMPT, config)
        assert got.tokens == want.tokens, q
        assert got.stats.exit_histogram == want.depth_stats()["exit_histogram"]
        assert got.stats.kv_policy == policy
        depths |= set(got.stats.exit_histogram)
    assert len(depths) > 1  # the gate's decisions vary: the test sees more than one exit


def test_demo_equals_the_reference() -> None:
    model, ref = load(artifact("demo")), reference("demo")
    ids = model.encode("import os\n")
    for policy in ("full", "last-exited"):
        config = GenerationConfig(12, exit_threshold=0.2, kv_policy=policy, stop_ids=())
        got = model.generate(ids, config=config)
        assert got.tokens == depth_generate(ref, ids, config).tokens, policy
        assert 1 <= got.stats.mean_loops <= 4


def _forced(bias: float):
    """ouro-r3 with its exit-gate bias set to ``bias`` (+30: every loop's λ is 1; -30: 0)."""
    out = scratch_root() / f"ckpt-ouro-r3-gate{bias:+.0f}"
    if not (out / "config.json").exists():
        shutil.copytree(checkpoint("ouro-r3"), out)
        for f in out.glob("*.safetensors"):
            tensors = load_file(f)
            if "model.early_exit_gate.bias" in tensors:
                tensors["model.early_exit_gate.bias"][:] = bias
                save_file(tensors, str(f))
        export_checkpoint(out, out / "art", ExportOptions())
    return load(out / "art")


def test_a_gate_forcing_loop_one_equals_static_depth_one() -> None:
    model = _forced(30.0)
    static = model.generate(PROMPT, max_new_tokens=12, loops=1, stop_ids=())
    for policy in ("full", "last-exited"):
        got = model.generate(PROMPT, max_new_tokens=12, exit_threshold=0.9, kv_policy=policy, stop_ids=())
        assert got.tokens == static.tokens and got.stats.exit_histogram == {1: 12}
    # min_loops clamps the exit up: every token at loop 2, as static loops=2
    clamped = model.generate(PROMPT, max_new_tokens=12, exit_threshold=0.9, min_loops=2, stop_ids=())
    assert clamped.tokens == model.generate(PROMPT, max_new_tokens=12, loops=2, stop_ids=()).tokens
    assert clamped.stats.exit_histogram == {2: 12}


def test_a_gate_that_never_exits_early_is_full_depth() -> None:
    model = _forced(-30.0)
    full = model.generate(PROMPT, max_new_tokens=12, stop_ids=())
    got = model.generate(PROMPT, max_new_tokens=12, exit_threshold=0.5, stop_ids=())
    assert got.tokens == full.tokens and got.stats.exit_histogram == {3: 12}
    # max_loops clamps the exit down: under `full` every token is static loops=2's
    capped = model.generate(PROMPT, max_new_tokens=12, exit_threshold=0.5, max_loops=2, stop_ids=())
    assert capped.tokens == model.generate(PROMPT, max_new_tokens=12, loops=2, stop_ids=()).tokens
    assert capped.stats.exit_histogram == {2: 12}


def test_eos_and_the_kv_capacity() -> None:
    name = "ouro-r4-1layer"  # max_position_embeddings 64: the artifact's KV capacity
    model, ref = load(artifact(name)), reference(name)
    free = model.generate(PROMPT, max_new_tokens=8, exit_threshold=0.3, stop_ids=())
    stop = free.tokens[4]
    config = GenerationConfig(8, exit_threshold=0.3, kv_policy="last-exited", stop_ids=(stop,))
    got = model.generate(PROMPT, config=config)
    want = depth_generate(ref, PROMPT, config, stop_ids=(stop,))
    assert got.tokens == want.tokens and got.finish_reason == "eos" and want.finish_reason == "eos"
    long = GenerationConfig(100, exit_threshold=0.3, stop_ids=())
    got = model.generate(PROMPT, config=long)
    want = depth_generate(ref, PROMPT, long, max_length=64)
    assert got.tokens == want.tokens and got.finish_reason == "length"
    assert sum(got.stats.exit_histogram.values()) == len(got.tokens)


def test_exit_rule() -> None:
    # λ = 0.5 everywhere: cumulative 0.5, 0.75, 1 over R = 3
    assert [exit_loop([0.0, 0.0, 0.0], q, 0, 2) for q in (0.5, 0.6, 0.75, 0.76, 1.0)] == [0, 1, 1, 2, 2]
    assert exit_loop([0.0, 0.0, 0.0], 0.5, 1, 2) == 1 and exit_loop([0.0, 0.0, 0.0], 1.0, 0, 1) == 1


def test_refusals() -> None:
    model = load(artifact("ouro-r3"))
    cases = [
        (dict(exit_threshold=0.5, speculative="prompt-lookup"), "greedy plain decoding"),
        (dict(exit_threshold=0.5, sampling=SamplingParams(temperature=0.7)), "greedy plain decoding"),
        (dict(exit_threshold=0.5, loops=2), "either loops"),
        (dict(min_loops=2), "need exit_threshold"),
        (dict(kv_policy="last-exited"), "needs exit_threshold"),
        (dict(exit_threshold=1.5), r"exit_threshold must be in \(0, 1\]"),
        (dict(exit_threshold=0.5, max_loops=4), r"max_loops must be in 1\.\.3"),
        (dict(exit_threshold=0.5, min_loops=3, max_loops=2), "exceeds max_loops"),
        (dict(exit_threshold=0.5, kv_policy="partial"), "kv_policy must be one of full, last-exited"),
        (dict(use_weighted_exit=True), "use_weighted_exit"),
    ]
    for options, message in cases:
        with pytest.raises(RequestError, match=message):
            model.generate(PROMPT, max_new_tokens=2, **options)
    llama = load(artifact("llama-tied-gqa"))
    with pytest.raises(RequestError, match="needs the exits graph"):
        llama.generate(PROMPT, max_new_tokens=2, exit_threshold=0.5)


def test_cli_flags() -> None:
    from click.testing import CliRunner
    from loopcast.cli import main

    path, ids = str(artifact("ouro-r3")), ",".join(map(str, PROMPT))
    args = ["generate", path, "--prompt-ids", ids, "--max-new-tokens", "6", "--json"]
    gated = ["--exit-threshold", "0.4", "--min-loops", "1", "--max-loops", "3", "--kv-policy", "last-exited"]
    result = CliRunner().invoke(main, args + gated)
    assert result.exit_code == 0, result.output
    got = json.loads(result.output)
    want = load(artifact("ouro-r3")).generate(
        PROMPT, max_new_tokens=6, exit_threshold=0.4, kv_policy="last-exited"
    )
    assert got["tokens"] == want.tokens and got["stats"]["kv_policy"] == "last-exited"
    assert sum(got["stats"]["exit_histogram"].values()) == len(want.tokens)
    bad = CliRunner().invoke(main, args + ["--min-loops", "2"])
    assert bad.exit_code == 2 and "--min-loops" in bad.output.strip().splitlines()[-1]


def test_the_checkpoints_threshold_is_the_default() -> None:
    import json as json_

    out = scratch_root() / "ckpt-ouro-r3-threshold"
    if not (out / "config.json").exists():
        shutil.copytree(checkpoint("ouro-r3"), out)
        raw = json_.loads((out / "config.json").read_text())
        (out / "config.json").write_text(json_.dumps({**raw, "early_exit_threshold": 0.3}))
        export_checkpoint(out, out / "art", ExportOptions())
    model = load(out / "art")
    default = model.generate(PROMPT, max_new_tokens=12, stop_ids=())
    assert default.stats.kv_policy == "full"
    assert default.tokens == model.generate(PROMPT, max_new_tokens=12, exit_threshold=0.3, stop_ids=()).tokens
    # a request that names a depth, or speculates, runs its own
    assert model.generate(PROMPT, max_new_tokens=12, loops=3, stop_ids=()).stats.kv_policy == ""
    assert model.generate(PROMPT, max_new_tokens=4, speculative="prompt-lookup").stats.kv_policy == ""
