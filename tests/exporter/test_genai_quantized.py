"""``export --genai --quantize``: the GenAI graph of a quantized artifact reads the artifact's
MatMulNBits tensors and gives loopcast's greedy tokens. Driven here through plain onnxruntime in
GenAI's IO contract (input_ids, attention_mask, past_key_values.* → logits, present.*), so CI
checks it without onnxruntime-genai; with that package installed, GenAI itself runs it too."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from loopcast.exporter.export import ExportOptions, export_checkpoint
from loopcast.ort_runtime import load

from loopcast.errors import ExportError
from loopcast.quant import QuantScheme, WeightFormat
from tests.artifacts import checkpoint

PROMPT = [5, 6, 7, 8, 9, 10, 11]
INT4_INT8_HEAD = QuantScheme(WeightFormat.INT4, 32, True, WeightFormat.INT8)


def _contract_greedy(artifact, prompt: list[int], new_tokens: int, max_length: int) -> list[int]:
    """Greedy decoding of genai_decoder.onnx as GenAI drives it: the mask grows by one per token,
    and each step's present KV (the static [1, Hkv, max_length, D] buffer) is the next past."""
    session = ort.InferenceSession(str(artifact / "genai_decoder.onnx"), providers=["CPUExecutionProvider"])
    past = {
        i.name: np.zeros(
            [max_length if d == "max_length" or not isinstance(d, int) else d for d in i.shape], np.float32
        )
        for i in session.get_inputs()
        if i.name.startswith("past_key_values.")
    }
    ids, tokens = list(prompt), []
    step = np.array([ids], np.int64)
    for _ in range(new_tokens):
        feeds = {"input_ids": step, "attention_mask": np.ones((1, len(ids)), np.int64), **past}
        outputs = dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds)))
        token = int(np.argmax(outputs["logits"][0, -1]))
        tokens.append(token)
        ids.append(token)
        step = np.array([[token]], np.int64)
        past = {name: outputs[name.replace("past_key_values", "present")] for name in past}
    return tokens


@pytest.mark.parametrize("name", ["llama-tied-gqa", "ouro-r2-gqa"])
def test_quantized_genai_graph_gives_loopcast_tokens(tmp_path, name: str) -> None:
    art = tmp_path / "art"
    manifest = export_checkpoint(
        checkpoint(name), art, ExportOptions(max_length=64, genai=True, quantization=INT4_INT8_HEAD)
    )
    assert manifest.genai_files == ["genai_decoder.onnx", "genai_config.json"]
    graph = onnx.load(str(art / "genai_decoder.onnx"), load_external_data=False)
    products = [n.op_type for n in graph.graph.node if n.op_type in ("MatMulNBits", "MatMul", "Gemm")]
    # every projection and the head read quantized weights (attention's own products are inside
    # GroupQueryAttention)
    assert products and set(products) == {"MatMulNBits"}, products
    ours = load(art).generate(PROMPT, 16).tokens
    theirs = _contract_greedy(art, PROMPT, len(ours), 64)
    assert theirs == ours


def test_quantized_genai_runs_in_onnxruntime_genai(tmp_path) -> None:
    pytest.importorskip("onnxruntime_genai")
    from tests.exporter.test_genai_export import _genai_greedy

    art = tmp_path / "art"
    options = ExportOptions(max_length=64, genai=True, quantization=INT4_INT8_HEAD)
    export_checkpoint(checkpoint("llama-tied-gqa"), art, options)
    tokens = _genai_greedy(art, PROMPT, 12)
    ours = load(art).generate(PROMPT, 12).tokens
    assert tokens[: len(ours)] == ours[: len(tokens)] and len(tokens) >= len(ours) - 1


def test_quantized_genai_in_half_precision_is_refused(tmp_path) -> None:
    options = ExportOptions(
        max_length=64, genai=True, dtype="fp16", ops="loopcast", quantization=INT4_INT8_HEAD
    )
    with pytest.raises(ExportError, match="--genai needs --dtype fp32"):
        export_checkpoint(checkpoint("llama-tied-gqa"), tmp_path / "art", options)
    assert not (tmp_path / "art").exists()
