"""``export --genai``: ONNX Runtime GenAI runs the artifact and agrees with loopcast's runtime.

Two independent decoding loops (GenAI's C++ generator with its own KV buffers and masks, and
``ort_runtime``'s IO-bound generator) on one exported artifact must give the same greedy
tokens, for Llama (R=1, tied and untied, GQA) and looped models (each (loop, layer) KV slot is
one GenAI layer).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from loopcast.exporter.export import ExportOptions, export_checkpoint
from loopcast.ort_runtime import load

from tests.artifacts import checkpoint

og = pytest.importorskip("onnxruntime_genai")

PROMPT = [5, 6, 7, 8, 9, 10, 11]


def _genai_greedy(artifact, prompt: list[int], new_tokens: int) -> list[int]:
    model = og.Model(str(artifact))
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=len(prompt) + new_tokens, do_sample=False)
    generator = og.Generator(model, params)
    generator.append_tokens([prompt])
    tokens = []
    while not generator.is_done():
        generator.generate_next_token()
        tokens.append(int(generator.get_next_tokens()[0]))
    return tokens


@pytest.mark.parametrize(
    "name, pad",
    [
        ("llama-tied-gqa", None),
        ("llama-untied", None),
        ("ouro-r2-gqa", None),
        ("demo", None),
        ("llama-untied", 32),
    ],
)
def test_genai_and_loopcast_greedy_tokens_match(tmp_path, name, pad):
    """(pad: the loopcast-attention artifact's heads of 16 stored as 32, which GenAI's graph reads
    too: its KV is the stored head size, genai_config.json's head_size)"""
    source = "demo" if name == "demo" else checkpoint(name)
    options = ExportOptions(max_length=96, genai=True, pad_heads_to=pad)
    manifest = export_checkpoint(source, tmp_path / "art", options)
    if pad:
        assert (
            json.loads((tmp_path / "art" / "genai_config.json").read_text())["model"]["decoder"]["head_size"]
            == pad
        )
    ours = load(tmp_path / "art").generate(PROMPT, 40).tokens
    theirs = _genai_greedy(tmp_path / "art", PROMPT, 40)
    # GenAI stops at EOS too; it may not count the EOS token the same way, so compare its prefix.
    assert len(theirs) >= len(ours) - 1 >= 10
    assert theirs[: len(ours)] == ours[: len(theirs)]
    assert manifest.genai_files == ["genai_decoder.onnx", "genai_config.json"]


def test_genai_graph_shares_the_weights_file(tmp_path):
    """The GenAI graph holds no weights: it reads weights.safetensors as external data."""
    import onnx

    export_checkpoint(checkpoint("llama-untied"), tmp_path / "art", ExportOptions(max_length=64, genai=True))
    graph = tmp_path / "art" / "genai_decoder.onnx"
    assert graph.stat().st_size < 64 * 1024
    model = onnx.load(str(graph), load_external_data=False)
    external = {
        e.value for init in model.graph.initializer for e in init.external_data if e.key == "location"
    }
    assert external == {"weights.safetensors"}
    config = json.loads((tmp_path / "art" / "genai_config.json").read_text())
    assert config["search"]["past_present_share_buffer"] is True
    assert config["search"]["max_length"] == config["model"]["context_length"] == 64
    names = [i.name for i in model.graph.input]
    assert names[:2] == ["input_ids", "attention_mask"]
    assert "past_key_values.0.key" in names and "present.1.value" in [o.name for o in model.graph.output]


def test_looped_model_maps_each_loop_layer_slot_to_a_genai_layer(tmp_path):
    export_checkpoint(checkpoint("ouro-r3"), tmp_path / "art", ExportOptions(max_length=64, genai=True))
    config = json.loads((tmp_path / "art" / "genai_config.json").read_text())
    manifest = json.loads((tmp_path / "art" / "manifest.json").read_text())
    model = manifest["model"]
    assert (
        config["model"]["decoder"]["num_hidden_layers"]
        == model["num_hidden_layers"] * model["total_ut_steps"]
    )
    assert _genai_greedy(tmp_path / "art", PROMPT, 12) == load(tmp_path / "art").generate(PROMPT, 12).tokens


def test_cli_export_genai_flag(tmp_path):
    out = tmp_path / "art"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "loopcast.cli",
            "export",
            str(checkpoint("llama-tied-gqa")),
            "-o",
            str(out),
            "--max-length",
            "32",
            "--genai",
        ],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr
    assert "GenAI" in proc.stdout
    assert (out / "genai_config.json").is_file() and (out / "genai_decoder.onnx").is_file()


def test_genai_reads_the_artifact_tokenizer(tmp_path):
    """The tokenizer files the export copies are enough for GenAI's own tokenizer."""
    from tokenizers import Tokenizer

    export_checkpoint("demo", tmp_path / "art", ExportOptions(max_length=64, genai=True))
    text = "def main():\n    return sorted(items)\n"
    theirs = og.Tokenizer(og.Model(str(tmp_path / "art"))).encode(text)
    ours = Tokenizer.from_file(str(tmp_path / "art" / "tokenizer.json")).encode(text).ids
    assert [int(t) for t in theirs] == ours


def test_sibling_artifact_of_another_verify_width_keeps_the_genai_files(tmp_path):
    from loopcast.exporter.export import with_verify_width

    export_checkpoint(
        checkpoint("llama-tied-gqa"), tmp_path / "art", ExportOptions(max_length=64, genai=True)
    )
    derived = with_verify_width(tmp_path / "art", tmp_path / "w3", 3)
    assert derived.genai_files == ["genai_decoder.onnx", "genai_config.json"]
    assert _genai_greedy(tmp_path / "w3", PROMPT, 8) == _genai_greedy(tmp_path / "art", PROMPT, 8)
