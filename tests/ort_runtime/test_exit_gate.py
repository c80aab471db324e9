"""Ouro's exit gate on the runtime (ort_runtime/decoding/exits.py): tokens equal the torch
reference with the same options (exporter/reference_depth.py) under both KV policies, on tiny
checkpoints with R = 2, 3, 4 and the demo; forced gates (a gate bias that makes every token
exit at loop 1, or never before the last) against static depths; min/max clamps; EOS and the
KV capacity; refusals."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from loopcast.exporter.checkpoint import load_checkpoint
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
        _assert_loops_run(model, got, want.loops, policy)
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


def _assert_loops_run(model, got, exit_loops: list[int], policy: str) -> None:
    """The loops that ran (``exit_loops``: each token's, the reference's): the prompt's last row
    all R; a decode row its exit loop's count under last-exited (the deeper loops never run),
    all R under full; one embedding and one head per row."""
    R, steps, rows = model.config.num_loops, got.stats.steps, len(got.tokens)
    ran = R + sum(exit_loops[1:]) if policy == "last-exited" else R * rows
    assert steps["loop_step"] == ran and steps["exit_head"] == rows == steps["loop_embed"]
    assert "decode" not in steps and "exits" not in steps
    # the stats' passes leave out the prompt's last row, as plain decoding's leave out prefill
    assert got.stats.core_passes == ran - R
    assert got.stats.core_calls_per_token == round((ran - R) / rows, 4)


def _forced(bias: float, sign_of: int | None = None):
    """ouro-r3 with its exit-gate bias set to ``bias`` (+30: every loop's λ is 1; -30: 0), or
    (``sign_of``) a gate that reads only that coordinate of the normed state, ×60: λ is 0 or 1
    by its sign, so each token exits at the first loop where it is positive (or the last)."""
    tag = f"gate{bias:+.0f}" if sign_of is None else f"sign{sign_of}"
    out = scratch_root() / f"ckpt-ouro-r3-{tag}"
    if not (out / "config.json").exists():
        shutil.copytree(checkpoint("ouro-r3"), out)
        for f in out.glob("*.safetensors"):
            tensors = load_file(f)
            if "model.early_exit_gate.bias" in tensors:
                tensors["model.early_exit_gate.bias"][:] = bias
                if sign_of is not None:
                    tensors["model.early_exit_gate.weight"][:] = 0.0
                    tensors["model.early_exit_gate.weight"][..., sign_of] = 60.0
                save_file(tensors, str(f))
        export_checkpoint(out, out / "art", ExportOptions())
    return load(out / "art"), load_checkpoint(out, dtype=torch.float32)


def test_a_gate_forcing_loop_one_equals_static_depth_one() -> None:
    model, _ = _forced(30.0)
    static = model.generate(PROMPT, max_new_tokens=12, loops=1, stop_ids=())
    for policy in ("full", "last-exited"):
        got = model.generate(PROMPT, max_new_tokens=12, exit_threshold=0.9, kv_policy=policy, stop_ids=())
        assert got.tokens == static.tokens and got.stats.exit_histogram == {1: 12}
        if policy == "last-exited":  # one loop per decode row, the prompt's last row all 3
            assert got.stats.steps["loop_step"] == 3 + 11
    # min_loops clamps the exit up: every token at loop 2, as static loops=2
    static2 = model.generate(PROMPT, max_new_tokens=12, loops=2, stop_ids=()).tokens
    for policy in ("full", "last-exited"):
        clamped = model.generate(
            PROMPT, max_new_tokens=12, exit_threshold=0.9, min_loops=2, kv_policy=policy, stop_ids=()
        )
        assert clamped.tokens == static2 and clamped.stats.exit_histogram == {2: 12}


def test_a_gate_that_never_exits_early_is_full_depth() -> None:
    model, _ = _forced(-30.0)
    full = model.generate(PROMPT, max_new_tokens=12, stop_ids=())
    static2 = model.generate(PROMPT, max_new_tokens=12, loops=2, stop_ids=()).tokens
    for policy in ("full", "last-exited"):
        got = model.generate(PROMPT, max_new_tokens=12, exit_threshold=0.5, kv_policy=policy, stop_ids=())
        assert got.tokens == full.tokens and got.stats.exit_histogram == {3: 12}
        # max_loops clamps the exit down: every token is static loops=2's (loop 2 is never
        # read: under full it is its own KV, under last-exited loop 1's copy)
        capped = model.generate(
            PROMPT, max_new_tokens=12, exit_threshold=0.5, max_loops=2, kv_policy=policy, stop_ids=()
        )
        assert capped.tokens == static2 and capped.stats.exit_histogram == {2: 12}


def test_a_gate_that_switches_by_token_equals_the_reference() -> None:
    """A sign gate: exits at loop 1 and deeper interleaved within one generation; both policies
    give the reference's tokens and exit loops, and last-exited runs only the loops up to each
    exit."""
    model, ref = _forced(0.0, sign_of=0)
    for policy in ("full", "last-exited"):
        for min_loops, max_loops in ((None, None), (2, None), (None, 2)):
            config = GenerationConfig(
                20,
                exit_threshold=0.5,
                kv_policy=policy,
                min_loops=min_loops,
                max_loops=max_loops,
                stop_ids=(),
            )
            got, want = model.generate(PROMPT, config=config), depth_generate(ref, PROMPT, config)
            assert got.tokens == want.tokens, (policy, min_loops, max_loops)
            assert got.stats.exit_histogram == want.depth_stats()["exit_histogram"]
            _assert_loops_run(model, got, want.loops, policy)
            if min_loops is None and max_loops is None:
                assert len(got.stats.exit_histogram) >= 2, got.stats.exit_histogram
                assert any(a != b for a, b in zip(want.loops[1:], want.loops[2:]))  # switching


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
    # logits far past exp's range: λ = 0, then 1 (no overflow)
    assert exit_loop([-1e4, 1e4, 0.0], 0.5, 0, 2) == 1 and exit_loop([-1e4, -1e4, 0.0], 0.5, 0, 2) == 2


def test_refusals() -> None:
    model = load(artifact("ouro-r3"))
    cases = [
        (dict(exit_threshold=0.5, speculative="prompt-lookup"), "other speculative modes"),
        (dict(exit_threshold=0.5, sampling=SamplingParams(temperature=0.7)), "runs greedy, plain or with"),
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
    for key in ("mean_loops", "core_calls_per_token", "core_passes"):
        assert got["stats"][key] == getattr(want.stats, key), key
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
