"""GGUF input (exporter/gguf_source.py, gguf_blocks.py, gguf_tokenizer.py): tiny GGUFs written
with the gguf package's writer and quantizer from tiny checkpoints export to artifacts that
compute what the same weights exported from safetensors compute, the tokenizer built from the
metadata gives the Hugging Face tokenizer's ids, and what loopcast cannot read is refused in one
line."""

from __future__ import annotations

from functools import cache
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from loopcast.cli import main
from loopcast.exporter.export import ExportOptions, export_checkpoint
from loopcast.exporter.gguf_blocks import BlockType, to_matmulnbits, unpermute_rows
from loopcast.exporter.gguf_tokenizer import tokenizer_files
from loopcast.exporter.quantize import Quantized, dequantize
from loopcast.exporter.weights import read_stored
from loopcast.ort_runtime.api import load
from loopcast.ort_runtime.loading.artifact import open_artifact

from loopcast.demo_checkpoint import demo_checkpoint_dir
from loopcast.errors import ArtifactError, ExportError
from loopcast.manifest import Manifest
from loopcast.quant import QuantMethod, QuantScheme, WeightFormat
from tests.artifacts import checkpoint, scratch_root
from tests.gguf_files import dequantized_checkpoint, permute, tokenizer_metadata, write_gguf
from tests.tiny_models import TINY_MODELS

gguf = pytest.importorskip("gguf")

LLAMA, QWEN2 = "llama-untied-k32", "qwen2-tied-k32"
PROMPT = [5, 17, 42, 9, 33, 2, 71]


@cache
def _gguf(name: str, qtype: str, head_type: str | None = None, embed_type: str = "F32") -> Path:
    out = scratch_root() / f"{name}-{qtype}-{head_type}-{embed_type}.gguf"
    return write_gguf(checkpoint(name), TINY_MODELS[name], out, qtype, head_type, embed_type)


@cache
def _export(source: str, tag: str, options: ExportOptions | None = None) -> Path:
    out = scratch_root() / f"gguf-art-{tag}"
    export_checkpoint(source, out, options or ExportOptions())
    return out


def _tokens(artifact: Path) -> list[int]:
    return load(artifact).generate(PROMPT, 24, stop_ids=()).tokens


def _matrix(stored: dict, weights: Path, base: str, scheme: QuantScheme, k: int, n: int, bits: int):
    """The fp32 [N, K] matrix an artifact's MatMulNBits tensors of ``base`` stand for."""
    data = np.memmap(weights, np.uint8, "r")

    def tensor(name: str, dtype) -> np.ndarray:
        s = stored[name]
        return np.frombuffer(data[s.offset : s.offset + s.length].tobytes(), dtype).reshape(s.shape)

    zp = None
    if not scheme.symmetric:
        zp = tensor(f"{base}.zero_points", np.float32 if scheme.float_zero_points else np.uint8)
    qt = Quantized(
        tensor(f"{base}.weight_q", np.uint8), tensor(f"{base}.scales", np.float32), zp, k, n, bits, 32
    )
    return dequantize(qt)


@pytest.mark.parametrize("kind", [BlockType.Q4_0, BlockType.Q4_1, BlockType.Q8_0])
def test_blocks_map_onto_matmulnbits_without_a_float_round_trip(kind: BlockType) -> None:
    """Codes and scales are copied: the dequantized MatMulNBits matrix is gguf's own dequantized
    one, bit for bit for Q4_0/Q8_0 (under a symmetric or an asymmetric scheme); Q4_1's
    ``q·d + m`` becomes ``(q + m/d)·d``, within an ulp."""
    rng = np.random.default_rng(int(kind))
    w = rng.standard_normal((12, 96)).astype(np.float32)
    w[3, :32] = 0.25  # a flat block (Q4_1: d = 0)
    raw = gguf.quants.quantize(w, gguf.GGMLQuantizationType(int(kind)))
    expected = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType(int(kind)))
    blocks = raw.reshape(12, 3, kind.block_bytes)
    layouts = [(False, True)] if kind is BlockType.Q4_1 else [(True, False), (False, False), (False, True)]
    for symmetric, float_zp in layouts:
        qt = to_matmulnbits(blocks, kind, symmetric=symmetric, float_zero_points=float_zp)
        if kind is BlockType.Q4_1:
            np.testing.assert_allclose(dequantize(qt), expected, rtol=2e-7, atol=2e-7)
        else:
            assert np.array_equal(dequantize(qt), expected)


def test_unpermute_undoes_llama_cpp_permute() -> None:
    w = np.arange(64 * 8, dtype=np.float32).reshape(64, 8)
    assert np.array_equal(unpermute_rows(permute(w, 4), 4), w)
    assert not np.array_equal(permute(w, 4), w)


@pytest.mark.parametrize("name,embed", [(LLAMA, "F32"), (QWEN2, "Q8_0")])
def test_q8_0_gguf_equals_the_safetensors_int8_export(name: str, embed: str) -> None:
    """Q8_0's grid is our int8 RTN grid: the same weights from safetensors quantized with
    --quantize int8 --block-size 32 give the same codes and scales, so the same tokens (a
    tied Q8_0 embedding: a float Gather of its values and an int8 head of its blocks)."""
    g = _gguf(name, "Q8_0", embed_type=embed)
    from_gguf = _export(str(g), f"{name}-q8")
    manifest = Manifest.read(from_gguf)
    assert manifest.source_format == "gguf" and manifest.quantization.method is QuantMethod.GGUF
    assert manifest.quantization.layers is WeightFormat.INT8
    deq = dequantized_checkpoint(g, TINY_MODELS[name], scratch_root() / f"deq-{name}-q8")
    head = WeightFormat.INT8 if embed == "Q8_0" or name == LLAMA else WeightFormat.FLOAT
    assert manifest.quantization.head is head
    scheme = QuantScheme(WeightFormat.INT8, 32, True, head)
    from_st = _export(str(deq), f"{name}-q8-st", ExportOptions(quantization=scheme))
    a, b = read_stored(from_gguf / "weights.safetensors"), read_stored(from_st / "weights.safetensors")
    assert a.keys() == b.keys()
    bytes_a, bytes_b = (p.joinpath("weights.safetensors").read_bytes() for p in (from_gguf, from_st))
    for tensor, s in a.items():
        t = b[tensor]
        assert bytes_a[s.offset : s.offset + s.length] == bytes_b[t.offset : t.offset + t.length], tensor
    assert _tokens(from_gguf) == _tokens(from_st)


@pytest.mark.parametrize("name,qtype", [(LLAMA, "Q4_0"), (LLAMA, "Q4_1"), (QWEN2, "Q4_0")])
def test_q4_gguf_holds_the_gguf_matrices_and_decodes_like_them(name: str, qtype: str) -> None:
    """llama.cpp's Q4 grids (-8..7 and min + d·q) are not our RTN's (-7..7, integer zero points),
    so the check is on the matrices: every stored matrix dequantizes to gguf's own dequantized
    values, un-permuted (bit for bit for Q4_0, within an ulp for Q4_1); with fp32 compute
    (--accuracy-level 0) the greedy tokens are the float export's of those values."""
    cfg = TINY_MODELS[name]
    g = _gguf(name, qtype)
    art = _export(str(g), f"{name}-{qtype}-acc0", ExportOptions(source_accuracy_level=0))
    manifest = Manifest.read(art)
    scheme = manifest.quantization
    assert scheme.layers is WeightFormat.INT4 and scheme.float_zero_points == (qtype == "Q4_1")
    deq = dequantized_checkpoint(g, cfg, scratch_root() / f"deq-{name}-{qtype}")
    from safetensors.numpy import load_file

    ref = load_file(str(deq / "model.safetensors"))
    stored = read_stored(art / "weights.safetensors")
    d, h = cfg.head_dim, cfg.hidden_size
    for i in range(cfg.num_layers):
        qkv = np.concatenate([ref[f"model.layers.{i}.self_attn.{p}_proj.weight"] for p in "qkv"])
        gate_up = np.concatenate([ref[f"model.layers.{i}.mlp.{p}_proj.weight"] for p in ("gate", "up")])
        for base, w in (("qkv_proj", qkv), ("gate_up_proj", gate_up)):
            got = _matrix(stored, art / "weights.safetensors", f"layers.{i}.{base}", scheme, h, w.shape[0], 4)
            if qtype == "Q4_0":
                assert np.array_equal(got, w), base
            else:
                np.testing.assert_allclose(got, w, rtol=2e-7, atol=2e-7)
    assert (cfg.num_heads + 2 * cfg.num_kv_heads) * d == qkv.shape[0]
    float_art = _export(str(deq), f"{name}-{qtype}-float")
    assert _tokens(art) == _tokens(float_art)


def test_q4_1_layers_under_a_q8_0_head_load_and_decode_like_their_values() -> None:
    """llama.cpp's Q4_1 files keep the head (tied: the embedding) in Q8_0: its blocks keep uint8
    zero points (128) beside the layers' fp32 ones, since MatMulNBits refuses 8-bit weights with
    fp32 zero points; the export (the loopcast op set by default) loads at the default accuracy
    level and, at fp32 compute, decodes like the float export of the file's values."""
    g = _gguf(LLAMA, "Q4_1", "Q8_0")
    manifest = Manifest.read(_export(str(g), "llama-q41-q80head"))
    scheme = manifest.quantization
    assert scheme.head is WeightFormat.INT8 and scheme.float_zero_points
    # fp32 zero points choose the loopcast op set: MatMulNBits' rows are not exact on them
    assert manifest.op_set == "loopcast" and manifest.exact_verify["cpu"]
    art = _export(str(g), "llama-q41-q80head-acc0", ExportOptions(source_accuracy_level=0))
    deq = dequantized_checkpoint(g, TINY_MODELS[LLAMA], scratch_root() / "deq-llama-q41-q80head")
    assert _tokens(art) == _tokens(_export(str(deq), "llama-q41-q80head-float"))


def test_q4_1_gguf_on_the_loopcast_op_set_speculates_exactly() -> None:
    """The loopcast op set's CPU kernel takes Q4_1's fp32 zero points: rows exact at accuracy
    level 4 (int8 activations), so prompt lookup returns plain greedy's tokens; at level 0 the
    tokens are those of the float export of the file's values. CUDA is not declared (its kernels
    take uint8 zero points): a 16-bit export is refused at once, a CUDA load before any session."""
    g = _gguf(LLAMA, "Q4_1", "Q8_0")
    art = _export(str(g), "llama-q41-loopcast", ExportOptions(ops="loopcast"))
    manifest = Manifest.read(art)
    assert manifest.exact_verify == {"cpu": True, "cuda": False}
    model = load(art)
    plain = model.generate(PROMPT + PROMPT, 24, stop_ids=()).tokens
    lookup = model.generate(PROMPT + PROMPT, 24, stop_ids=(), speculative="prompt-lookup", gate="always")
    assert lookup.tokens == plain and lookup.stats.proposed > 0
    acc0 = _export(str(g), "llama-q41-loopcast-acc0", ExportOptions(ops="loopcast", source_accuracy_level=0))
    deq = dequantized_checkpoint(g, TINY_MODELS[LLAMA], scratch_root() / "deq-llama-q41-q80head")
    assert _tokens(acc0) == _tokens(_export(str(deq), "llama-q41-q80head-float"))
    with pytest.raises(ExportError, match="Q4_1 blocks .* run on the CPU kernels only"):
        export_checkpoint(str(g), scratch_root() / "never", ExportOptions(ops="loopcast", dtype="fp16"))
    # refused on CUDA before any session (or the provider check) is made
    with pytest.raises(ArtifactError, match="fp32 zero points .* run on the CPU kernels only"):
        open_artifact(art, "cuda")


@pytest.mark.parametrize("name,qtype", [(LLAMA, "F32"), (LLAMA, "F16"), (LLAMA, "BF16"), (QWEN2, "F32")])
def test_float_gguf_equals_the_float_export(name: str, qtype: str) -> None:
    """A float GGUF (q/k permuted by the converter, permuted back here) writes the float export's
    weights bit for bit (F16/BF16: those of a checkpoint of the 16-bit values), so the same tokens."""
    g = _gguf(name, qtype)
    art = _export(str(g), f"{name}-{qtype}")
    src = checkpoint(name)
    if qtype != "F32":
        src = dequantized_checkpoint(g, TINY_MODELS[name], scratch_root() / f"deq-{name}-{qtype}")
    ref = _export(str(src), f"{name}-{qtype}-st")
    assert Manifest.read(art).quantization is None
    a, b = (p.joinpath("weights.safetensors").read_bytes() for p in (art, ref))
    sa, sb = read_stored(art / "weights.safetensors"), read_stored(ref / "weights.safetensors")
    assert sa == sb
    for s in sa.values():
        assert a[s.offset : s.offset + s.length] == b[s.offset : s.offset + s.length], s.name
    assert _tokens(art) == _tokens(ref)


def test_float_gguf_requantized_with_quantize(tmp_path) -> None:
    art = tmp_path / "a"
    export_checkpoint(
        str(_gguf(LLAMA, "F32")), art, ExportOptions(quantization=QuantScheme(WeightFormat.INT4, 64))
    )
    scheme = Manifest.read(art).quantization
    assert scheme.method is QuantMethod.RTN and scheme.block_size == 64


def test_tokenizer_from_metadata_gives_the_hf_ids() -> None:
    """The demo model's byte-level BPE, written into GGUF metadata the way llama.cpp's converter
    writes it, rebuilds into a tokenizer giving the original's ids (special tokens included);
    the chat template comes along."""
    from tokenizers import Tokenizer

    hf = demo_checkpoint_dir() / "tokenizer.json"
    meta = tokenizer_metadata(hf)
    metadata = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "gpt-2",
        "tokenizer.ggml.tokens": meta["tokens"],
        "tokenizer.ggml.token_type": meta["types"],
        "tokenizer.ggml.merges": meta["merges"],
        "tokenizer.ggml.eos_token_id": 0,
        "tokenizer.chat_template": "{% for m in messages %}<|im_start|>{{ m.content }}<|im_end|>{% endfor %}",
    }
    files = tokenizer_files(metadata, "test.gguf")
    ours, theirs = Tokenizer.from_str(files["tokenizer.json"]), Tokenizer.from_file(str(hf))
    texts = [
        "Hello world, this is a test.",
        "  leading spaces and\ttabs\nnew lines",
        "<|im_start|>user\nnumbers 12345 and émojis 🎉<|im_end|>",
        "def f(x):\n    return x ** 2  # comment",
    ]
    for text in texts:
        assert ours.encode(text).ids == theirs.encode(text).ids, text
        assert ours.decode(ours.encode(text).ids) == theirs.decode(theirs.encode(text).ids)
    assert '"chat_template"' in files["tokenizer_config.json"]
    assert '"eos_token": "<|endoftext|>"' in files["tokenizer_config.json"]


def test_export_carries_the_tokenizer_and_chat_template(tmp_path) -> None:
    cfg = TINY_MODELS[LLAMA]
    meta = tokenizer_metadata(demo_checkpoint_dir() / "tokenizer.json")
    meta = {k: v[: cfg.vocab_size] if k != "merges" else [] for k, v in meta.items()}
    g = write_gguf(
        checkpoint(LLAMA), cfg, tmp_path / "t.gguf", "Q8_0", tokenizer=meta, chat_template="{{ 1 }}"
    )
    art = tmp_path / "a"
    export_checkpoint(str(g), art, ExportOptions())
    manifest = Manifest.read(art)
    assert set(manifest.tokenizer_files) == {"tokenizer.json", "tokenizer_config.json"}
    model = load(art)
    assert model.encode("ab") == [meta["tokens"].index("a"), meta["tokens"].index("b")]
    assert model.chat_template is not None


def _cli(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def _one_line(result, message: str) -> None:
    assert result.exit_code != 0
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], result.output


READS = "loopcast reads F32, F16, Q4_0, Q4_1, Q8_0, BF16"


@pytest.mark.parametrize(
    "qtype,embed,extra,message",
    [
        ("Q5_0", "F32", {}, f"tensor output.weight has type Q5_0; {READS} (llama-quantize"),
        ("Q8_0", "Q6_K", {}, f"tensor token_embd.weight has type Q6_K; {READS}"),
        ("F32", "F32", {"llama.rope.scaling.type": "yarn"}, "key llama.rope.scaling.type is not supported"),
        ("F32", "F32", {"llama.attention.sliding_window": 16.0}, "llama.attention.sliding_window is not"),
    ],
)
def test_what_loopcast_cannot_read_is_refused_in_one_line(tmp_path, qtype, embed, extra, message) -> None:
    cfg = TINY_MODELS[LLAMA]
    g = write_gguf(checkpoint(LLAMA), cfg, tmp_path / "x.gguf", qtype, embed_type=embed, extra_metadata=extra)
    _one_line(_cli("export", g, "-o", tmp_path / "a"), message)
    assert not (tmp_path / "a").exists()


def test_quantize_on_a_quantized_gguf_is_refused(tmp_path) -> None:
    result = _cli("export", _gguf(LLAMA, "Q8_0"), "-o", tmp_path / "a", "--quantize", "int4")
    _one_line(result, "the file's layers are already quantized (gguf int8 block 32")


def test_inspect_explains_a_gguf_and_its_artifact() -> None:
    g = _gguf(LLAMA, "Q4_0", "Q8_0")
    result = _cli("inspect", g)
    assert result.exit_code == 0, result.output
    assert "llama, 2 layers, hidden 64, heads 4/2 x 16" in result.output
    assert "tensors         6 F32, 14 Q4_0, 1 Q8_0" in result.output
    assert "exports as      gguf int4 block 32 symmetric, head int8" in result.output
    art = _export(str(g), "llama-q4-q8head")
    result = _cli("inspect", art)
    assert (
        "exported from gguf" in result.output and "gguf int4 block 32 symmetric, head int8" in result.output
    )


def test_sentencepiece_tokenizer_from_metadata_gives_its_ids(tmp_path) -> None:
    """A SentencePiece BPE model (byte fallback, no normalization: Llama's settings), written into
    GGUF metadata the way llama.cpp's converter writes it (pieces, scores, token types), rebuilds
    into a tokenizer giving sentencepiece's own ids, which Hugging Face's Llama tokenizer
    reproduces; it decodes back to the text."""
    import json as json_module

    spm = pytest.importorskip("sentencepiece")
    from tokenizers import Tokenizer

    text = Path(json_module.__file__).read_text(encoding="utf-8")
    (tmp_path / "corpus.txt").write_text(text, encoding="utf-8")
    spm.SentencePieceTrainer.train(
        input=str(tmp_path / "corpus.txt"),
        model_prefix=str(tmp_path / "sp"),
        vocab_size=600,
        model_type="bpe",
        byte_fallback=True,
        character_coverage=1.0,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        minloglevel=2,
    )
    sp = spm.SentencePieceProcessor(model_file=str(tmp_path / "sp.model"))
    n = sp.get_piece_size()
    kinds = [
        2 if sp.is_unknown(i) else 3 if sp.is_control(i) else 6 if sp.is_byte(i) else 1 for i in range(n)
    ]
    metadata = {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": [sp.id_to_piece(i) for i in range(n)],
        "tokenizer.ggml.scores": [sp.get_score(i) for i in range(n)],
        "tokenizer.ggml.token_type": kinds,
        "tokenizer.ggml.bos_token_id": sp.bos_id(),
        "tokenizer.ggml.eos_token_id": sp.eos_id(),
    }
    files = tokenizer_files(metadata, "test.gguf")
    ours = Tokenizer.from_str(files["tokenizer.json"])
    texts = [line for line in text.splitlines() if line.strip()][:200]
    texts += ["Hello world,  two  spaces", "émojis 🎉 and 中文", " leading", "tabs\tand\nnewlines"]
    for line in texts:
        ids = ours.encode(line, add_special_tokens=False).ids
        assert ids == sp.encode(line), line
        assert ours.decode(ids) == line
    assert ours.encode("x").ids[0] == sp.bos_id()  # add_bos_token defaults to true for llama
