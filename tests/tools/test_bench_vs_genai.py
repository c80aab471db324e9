"""tools/bench/bench_vs_genai.py on a tiny Llama with a byte tokenizer, one artifact serving as
both contenders (``export --genai`` writes the GenAI graph beside ours, on the same weights).

What can fail: the children's protocol and the report's rows, prompt lookup's tokens against
plain greedy, and the two held-out scorers (our verify rows, GenAI's prompt logits) giving one
bits/byte on the same weights. Timings are not asserted."""

from __future__ import annotations

import json

import pytest
from loopcast.exporter.export import ExportOptions, export_checkpoint
from loopcast.exporter.random_checkpoint import write_random_checkpoint

from tests.tiny_models import ARTIFACT_CHECKPOINT_STD, TINY_MODELS, write_byte_tokenizer
from tools.bench import bench_vs_genai

pytest.importorskip("onnxruntime_genai")


def test_report_rows_lookup_identity_and_equal_scores(tmp_path) -> None:
    config = TINY_MODELS["llama-tied-gqa"].replace(vocab_size=256, max_position_embeddings=640)
    ckpt = write_random_checkpoint(config, tmp_path / "ckpt", seed=0, std=ARTIFACT_CHECKPOINT_STD)
    art = tmp_path / "art"
    export_checkpoint(ckpt, art, ExportOptions(max_length=640, verify_width=4, genai=True))
    write_byte_tokenizer(art / "tokenizer.json")
    config_file = art / "tokenizer_config.json"
    tok_config = json.loads(config_file.read_text()) if config_file.exists() else {}
    tok_config["chat_template"] = (
        "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    config_file.write_text(json.dumps(tok_config))
    out = tmp_path / "r.json"
    argv = [f"--ours=ours={art}", f"--genai=genai={art}", "--passes=1", "--new-tokens=8"]
    argv += ["--lookup=ours", "--windows=2", "--seq=32", f"--json={out}"]
    assert bench_vs_genai.main(argv) == 0
    report = json.loads(out.read_text())
    assert set(report["prompts"]) == {*bench_vs_genai.PROMPTS, "chat-edit"}
    for name in report["prompts"]:
        rows = report["prompts"][name]
        edit = name in bench_vs_genai.EDITS
        assert set(rows) == ({"ours", "genai", "ours+lookup"} if edit else {"ours", "genai"})
        assert rows["genai"]["ratio_decode"] == 1.0
        assert all(len(rows[label]["decode_tok_s"]) == 1 for label in rows)
        assert all(rows[label]["cpu_ms_per_token"][0] > 0 for label in rows)
    assert set(report["lookup"]) == {"edit", "chat-edit"}
    assert all(v["identical_to_plain"] is True for v in report["lookup"].values())
    ours, genai = report["contenders"]["ours"], report["contenders"]["genai"]
    assert ours["peak_rss_mib"] > 0 and genai["peak_rss_mib"] > 0
    # byte tokens: the split's tokens per byte is 1, and random weights score near log2(256) = 8
    assert report["heldout"]["tokens_per_byte"] == 1.0
    assert 6.0 < ours["bits_per_byte"] < 10.0
    assert abs(ours["bits_per_byte"] - genai["bits_per_byte"]) < 1e-3


def test_bad_labels_are_refused(tmp_path) -> None:
    with pytest.raises(SystemExit, match="--ours"):
        bench_vs_genai.main(["--genai", f"g={tmp_path}"])
    with pytest.raises(SystemExit, match="--lookup"):
        bench_vs_genai.main(["--ours", f"o={tmp_path}", "--lookup", "x"])
