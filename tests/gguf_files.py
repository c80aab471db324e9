"""Tiny GGUF files written from tiny Hugging Face checkpoints with the gguf package's writer and
quantizer, the way llama.cpp's convert_hf_to_gguf.py lays them out (tensor names, metadata keys,
a Llama's q/k rows permuted for ggml's rope)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from loopcast.config import ModelConfig


def permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's ``LlamaModel.permute`` (rotate-half pairs → adjacent pairs)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def tokenizer_metadata(tokenizer_json: Path) -> dict:
    """tokenizer.ggml.* of a byte-level BPE tokenizer.json, as llama.cpp's converter writes them."""
    tok = json.loads(tokenizer_json.read_text())
    vocab = tok["model"]["vocab"]
    added = {t["id"]: t for t in tok["added_tokens"]}
    tokens = [""] * (max(vocab.values()) + 1)
    for token, i in vocab.items():
        tokens[i] = token
    types = [3 if i in added and added[i]["special"] else 4 if i in added else 1 for i in range(len(tokens))]
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    return {"tokens": tokens, "types": types, "merges": merges}


def write_gguf(
    checkpoint_dir: Path,
    config: ModelConfig,
    out: Path,
    qtype: str = "F32",
    head_type: str | None = None,
    embed_type: str = "F32",
    tokenizer: dict | None = None,
    chat_template: str | None = None,
    extra_metadata: dict | None = None,
) -> Path:
    """``checkpoint_dir``'s tensors as ``out``: every layer projection in ``qtype`` (F32, F16,
    BF16, Q4_0, Q4_1, Q8_0, Q5_0, ...), the head in ``head_type`` (default ``qtype``), the
    embedding in ``embed_type``, norms and biases in F32."""
    import gguf
    from gguf import GGMLQuantizationType as T
    from safetensors.numpy import load_file

    tensors: dict[str, np.ndarray] = {}
    for f in sorted(checkpoint_dir.glob("*.safetensors")):
        tensors.update(load_file(f))
    arch = config.model_type
    w = gguf.GGUFWriter(str(out), arch)
    w.add_context_length(config.max_position_embeddings)
    w.add_embedding_length(config.hidden_size)
    w.add_block_count(config.num_layers)
    w.add_feed_forward_length(config.intermediate_size)
    w.add_head_count(config.num_heads)
    w.add_head_count_kv(config.num_kv_heads)
    w.add_rope_freq_base(config.rope_theta)
    w.add_layer_norm_rms_eps(config.rms_norm_eps)
    if arch == "llama":
        w.add_rope_dimension_count(config.head_dim)
        w.add_vocab_size(config.vocab_size)
    for key, value in (extra_metadata or {}).items():
        w.add_string(key, value) if isinstance(value, str) else w.add_float32(key, value)
    if tokenizer is not None:
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("gpt-2")
        w.add_token_list(tokenizer["tokens"])
        w.add_token_types(tokenizer["types"])
        w.add_token_merges(tokenizer["merges"])
    if config.eos_token_id is not None:
        w.add_eos_token_id(config.eos_token_id)
    if chat_template is not None:
        w.add_chat_template(chat_template)

    def add(name: str, array: np.ndarray, kind: str) -> None:
        array = np.asarray(array, np.float32)
        if kind == "F32" or array.ndim == 1:
            w.add_tensor(name, array)
        elif kind == "F16":
            w.add_tensor(name, array.astype(np.float16))
        elif kind == "BF16":
            w.add_tensor(name, gguf.quants.quantize(array, T.BF16), raw_dtype=T.BF16)
        elif kind.endswith("_K"):  # no Python quantizer: one zero block a row (refused unread)
            block = np.zeros((array.shape[0], gguf.GGML_QUANT_SIZES[T[kind]][1]), np.uint8)
            w.add_tensor(name, block, raw_dtype=T[kind])
        else:
            w.add_tensor(name, gguf.quants.quantize(array, T[kind]), raw_dtype=T[kind])

    names = {
        "input_layernorm.weight": "attn_norm.weight",
        "post_attention_layernorm.weight": "ffn_norm.weight",
        "self_attn.o_proj.weight": "attn_output.weight",
        "mlp.gate_proj.weight": "ffn_gate.weight",
        "mlp.up_proj.weight": "ffn_up.weight",
        "mlp.down_proj.weight": "ffn_down.weight",
    } | {f"self_attn.{p}_proj.{k}": f"attn_{p}.{k}" for p in "qkv" for k in ("weight", "bias")}
    add("token_embd.weight", tensors["model.embed_tokens.weight"], embed_type)
    add("output_norm.weight", tensors["model.norm.weight"], "F32")
    if "lm_head.weight" in tensors:
        add("output.weight", tensors["lm_head.weight"], head_type or qtype)
    for i in range(config.num_layers):
        for theirs, ours in names.items():
            key = f"model.layers.{i}.{theirs}"
            if key not in tensors:
                continue
            t = tensors[key]
            if arch == "llama" and theirs.startswith("self_attn.q_proj"):
                t = permute(t, config.num_heads)
            if arch == "llama" and theirs.startswith("self_attn.k_proj"):
                t = permute(t, config.num_kv_heads)
            add(f"blk.{i}.{ours}", t, "F32" if "norm" in theirs else qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def dequantized_checkpoint(gguf_path: Path, config: ModelConfig, out: Path) -> Path:
    """A safetensors checkpoint of the values a GGUF's tensors stand for (gguf.quants.dequantize,
    q/k rows permuted back), the weights a float export of the same model would hold."""
    import gguf
    from safetensors.numpy import save_file

    reader = gguf.GGUFReader(str(gguf_path))
    inverse = {
        "attn_norm.weight": "input_layernorm.weight",
        "ffn_norm.weight": "post_attention_layernorm.weight",
        "attn_output.weight": "self_attn.o_proj.weight",
        "ffn_gate.weight": "mlp.gate_proj.weight",
        "ffn_up.weight": "mlp.up_proj.weight",
        "ffn_down.weight": "mlp.down_proj.weight",
    } | {f"attn_{p}.{k}": f"self_attn.{p}_proj.{k}" for p in "qkv" for k in ("weight", "bias")}
    top = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight"}
    top["output.weight"] = "lm_head.weight"
    tensors = {}
    for t in reader.tensors:
        values = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        if t.name in top:
            name = top[t.name]
        else:
            _, i, rest = t.name.split(".", 2)
            name = f"model.layers.{i}.{inverse[rest]}"
            if config.model_type == "llama" and rest.startswith(("attn_q.", "attn_k.")):
                heads = config.num_heads if rest.startswith("attn_q.") else config.num_kv_heads
                shape = values.shape
                values = values.reshape(heads, shape[0] // heads // 2, 2, *shape[1:]).swapaxes(1, 2)
                values = values.reshape(shape)
        tensors[name] = np.ascontiguousarray(values)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(config.to_hf_dict()))
    return out
