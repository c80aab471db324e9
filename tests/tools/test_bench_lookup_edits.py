"""tools/bench/bench_lookup_edits.py on a tiny Llama with a byte tokenizer: the requests carry
the names they rename, variants parse, and every variant's tokens equal plain greedy's (the
exit status says so). Timings are not asserted."""

from __future__ import annotations

import json

import pytest
from loopcast.exporter.export import ExportOptions, export_checkpoint
from loopcast.exporter.random_checkpoint import write_random_checkpoint

from tests.tiny_models import ARTIFACT_CHECKPOINT_STD, TINY_MODELS, write_byte_tokenizer
from tools.bench import bench_lookup_edits


def test_requests_ask_each_rename_of_its_source() -> None:
    requests = bench_lookup_edits.edit_requests()
    assert len(requests) == len(bench_lookup_edits.EDITS)
    for (_, name, old, new), text in zip(bench_lookup_edits.EDITS, requests.values(), strict=True):
        assert f"`{old}` to `{new}`" in text and "def " + name.split(".")[-1] in text


def test_bad_variant_is_one_error() -> None:
    with pytest.raises(SystemExit, match="expected LABEL:KEY=VALUE"):
        bench_lookup_edits.parse_variant("ng3")
    assert bench_lookup_edits.parse_variant("ng3:max_ngram=3,gate=always") == (
        "ng3",
        {"max_ngram": 3, "gate": "always"},
    )


def test_variants_return_plain_greedy_tokens(tmp_path) -> None:
    config = TINY_MODELS["llama-tied-gqa"].replace(vocab_size=256, max_position_embeddings=1100)
    ckpt = write_random_checkpoint(config, tmp_path / "ckpt", seed=0, std=ARTIFACT_CHECKPOINT_STD)
    art = tmp_path / "art"
    export_checkpoint(ckpt, art, ExportOptions(max_length=1100, verify_width=4))
    write_byte_tokenizer(art / "tokenizer.json")
    out = tmp_path / "r.json"
    argv = [str(art), "--passes=1", "--new-tokens=6", "--variant=a:max_ngram=2", "--variant=b:gate=always"]
    assert bench_lookup_edits.main([*argv, f"--json={out}"]) == 0
    report = json.loads(out.read_text())
    assert report["identical_to_plain"] is True
    assert set(report["a"]["median_by_request"]) == {name for _, name, _, _ in bench_lookup_edits.EDITS}
    assert report["b"]["options"] == {"gate": "always"} and report["a"]["geomean"] > 0
