"""Static depth (``loops=k``): only loops 0..k-1 run, and the tokens are the torch reference's at
that depth (exporter/reference_depth.py) on tiny checkpoints with R = 2, 3, 4 and the demo;
prompt lookup composes at depth k, self-speculation and the pipeline are refused."""

from __future__ import annotations

import pytest
from click.testing import CliRunner
from loopcast.cli import main
from loopcast.exporter.export import ExportOptions, export_checkpoint
from loopcast.exporter.reference_depth import depth_generate
from loopcast.ort_runtime.api import load
from loopcast.ort_runtime.decoding.generation_config import GenerationConfig

from loopcast.errors import RequestError
from loopcast.manifest import Manifest
from tests.artifacts import artifact, checkpoint, reference, require_exact_cpu_artifacts, scratch_root

PROMPT = [3, 5, 7, 11, 2, 9, 4]


@pytest.mark.parametrize("name", ["ouro-r2-gqa", "ouro-r3", "ouro-r4-1layer"])
def test_tokens_equal_the_reference_at_every_depth(name: str) -> None:
    model, ref = load(artifact(name)), reference(name)
    R = ref.config.num_loops
    assert Manifest.read(artifact(name)).exit_depths == list(range(1, R))
    seen = set()
    for k in range(1, R + 1):
        config = GenerationConfig(12, loops=k, stop_ids=())
        got = model.generate(PROMPT, config=config)
        assert got.tokens == depth_generate(ref, PROMPT, config).tokens, k
        # only k loops ran: one pass over the core per loop and token
        assert got.stats.core_calls_per_token == pytest.approx(k * 11 / 12, abs=1e-4)
        assert got.stats.core_passes == k * 11 and got.stats.exit_histogram == {k: 12}
        seen.add(tuple(got.tokens))
    assert len(seen) > 1  # the depths disagree somewhere: the test can tell them apart


def test_demo_at_three_loops_equals_the_reference() -> None:
    model, ref = load(artifact("demo")), reference("demo")
    ids = model.encode("def fib(n):\n")
    config = GenerationConfig(16, loops=3, stop_ids=())
    got = model.generate(ids, config=config)
    assert got.tokens == depth_generate(ref, ids, config).tokens
    assert set(got.stats.steps) >= {"decode@3"}


def test_prompt_lookup_composes_at_depth_k() -> None:
    require_exact_cpu_artifacts()
    model = load(artifact("ouro-r3"))
    prompt = PROMPT * 3  # repeats: prompt lookup finds drafts
    for k in (1, 2):
        plain = model.generate(prompt, max_new_tokens=16, loops=k, stop_ids=())
        spec = model.generate(
            prompt, max_new_tokens=16, loops=k, stop_ids=(), speculative="prompt-lookup", gate="always"
        )
        assert spec.tokens == plain.tokens
        assert spec.stats.steps.get(f"verify@{k}", 0) > 0 and spec.stats.proposed > 0


@pytest.mark.parametrize("mode", ["self", "pipeline"])
def test_full_depth_verifiers_are_refused_below_r(mode: str) -> None:
    model = load(artifact("ouro-r3", draft_depth=1))
    with pytest.raises(RequestError, match=f"speculative mode '{mode}' verifies at full depth"):
        model.generate(PROMPT, max_new_tokens=4, loops=2, speculative=mode)


def test_depth_errors() -> None:
    model = load(artifact("ouro-r3"))
    with pytest.raises(RequestError, match=r"loops must be in 1\.\.3"):
        model.generate(PROMPT, max_new_tokens=2, loops=4)
    with pytest.raises(RequestError, match="loops must be a positive integer"):
        GenerationConfig(loops=0)
    # continuing a sequence written at depth 1 at a greater depth would read unwritten KV
    gen = model.new_generator()
    list(model.stream_ids(PROMPT, max_new_tokens=3, loops=1, generator=gen))
    with pytest.raises(RequestError, match="written at depth 1"):
        list(model.stream_ids([5], max_new_tokens=3, generator=gen))
    list(model.stream_ids([5], max_new_tokens=3, loops=1, generator=gen))  # the same depth goes on


def test_an_artifact_without_a_depth_refuses_it() -> None:
    out = scratch_root() / "art-ouro-r3-depth2"
    if not (out / "manifest.json").exists():
        export_checkpoint(checkpoint("ouro-r3"), out, ExportOptions(exit_depths=(2,)))
    model = load(out)
    assert Manifest.read(out).exit_depths == [2]
    assert model.generate(PROMPT, max_new_tokens=4, loops=2, stop_ids=()).tokens
    with pytest.raises(RequestError, match="loops must be one of 2, 3 on this artifact"):
        model.generate(PROMPT, max_new_tokens=4, loops=1)


def test_cli_loops_flag() -> None:
    path = str(artifact("ouro-r3"))
    ids = ",".join(map(str, PROMPT))
    result = CliRunner().invoke(
        main, ["generate", path, "--prompt-ids", ids, "--max-new-tokens", "6", "--loops", "2", "--json"]
    )
    assert result.exit_code == 0, result.output
    import json

    got = json.loads(result.output)
    want = load(artifact("ouro-r3")).generate(PROMPT, max_new_tokens=6, loops=2)
    assert got["tokens"] == want.tokens
    bad = CliRunner().invoke(
        main, ["generate", path, "--prompt-ids", ids, "--loops", "2", "--speculative", "self"]
    )
    assert bad.exit_code == 2 and bad.output.strip().splitlines()[-1].startswith("error: ")
    assert "--loops" in bad.output


def test_a_depth_graph_run_before_its_prefill_makes_the_shared_session() -> None:
    """decode@k runs on prefill@k's CPU session; made first, its factory makes the host's."""
    from loopcast.ort_runtime.loading.artifact import open_artifact

    loaded = open_artifact(artifact("ouro-r3"), "cpu")
    assert loaded.sessions.pending("decode@2") and loaded.sessions.pending("prefill@2")
    assert loaded.sessions["decode@2"] is loaded.sessions["prefill@2"]
