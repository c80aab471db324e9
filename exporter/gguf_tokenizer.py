"""A GGUF file's tokenizer (``tokenizer.ggml.*``) as the ``tokenizer.json`` and
``tokenizer_config.json`` of a Hugging Face tokenizer that gives the same ids.

``tokenizer.ggml.model`` ``gpt2`` (byte-level BPE): the vocabulary is ``tokens`` in id order,
the merges are ``merges`` in rank order, tokens of type CONTROL (3) are special added tokens and
USER_DEFINED (4) plain added tokens; ``tokenizer.ggml.pre`` names the pre-tokenizer's split rule
(llama.cpp's names for the regexes of the tokenizers it knows), so only the ones listed here are
accepted. The chat template (``tokenizer.chat_template``) goes into tokenizer_config.json, with
the BOS/EOS strings its templates read.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from loopcast.errors import CheckpointError

_CONTROL, _USER_DEFINED = 3, 4
_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _byte_level(use_regex: bool) -> dict:
    return {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": use_regex}


def _split(pattern: str) -> dict:
    return {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": False}


# tokenizer.ggml.pre → (normalizer, pre-tokenizer) of the Hugging Face tokenizer it came from
PRE_TOKENIZERS: dict[str, tuple[dict | None, dict]] = {
    "default": (None, _byte_level(True)),  # GPT-2's regex
    "gpt-2": (None, _byte_level(True)),
    "llama-bpe": (None, {"type": "Sequence", "pretokenizers": [_split(_LLAMA3), _byte_level(False)]}),
    "qwen2": (
        {"type": "NFC"},
        {"type": "Sequence", "pretokenizers": [_split(_QWEN2), _byte_level(False)]},
    ),
    "smollm": (
        None,
        {
            "type": "Sequence",
            "pretokenizers": [{"type": "Digits", "individual_digits": True}, _byte_level(True)],
        },
    ),
}


def tokenizer_files(metadata: dict[str, Any], where: str) -> dict[str, str]:
    """File name → text of the tokenizer files of a GGUF's metadata (empty when it has none)."""
    model = metadata.get("tokenizer.ggml.model")
    if model is None:
        return {}
    if model != "gpt2":
        raise CheckpointError(
            f"{where}: tokenizer.ggml.model {model!r} is not supported yet (loopcast builds byte-level "
            "BPE tokenizers, tokenizer.ggml.model gpt2); export the Hugging Face checkpoint instead"
        )
    pre = metadata.get("tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZERS:
        raise CheckpointError(
            f"{where}: tokenizer.ggml.pre {pre!r} is not supported (known: {', '.join(PRE_TOKENIZERS)})"
        )
    tokens = list(metadata["tokenizer.ggml.tokens"])
    types = list(metadata.get("tokenizer.ggml.token_type", [1] * len(tokens)))
    merges = list(metadata.get("tokenizer.ggml.merges", []))
    normalizer, pre_tokenizer = PRE_TOKENIZERS[pre]
    added = [
        {
            "id": i,
            "content": token,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": kind != _CONTROL,
            "special": kind == _CONTROL,
        }
        for i, (token, kind) in enumerate(zip(tokens, types, strict=True))
        if kind in (_CONTROL, _USER_DEFINED)
    ]
    bos, eos = metadata.get("tokenizer.ggml.bos_token_id"), metadata.get("tokenizer.ggml.eos_token_id")
    add_bos = bool(metadata.get("tokenizer.ggml.add_bos_token", False))
    post: dict = {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": False, "use_regex": True}
    if add_bos and bos is not None:
        bos_token = tokens[int(bos)]
        post = {
            "type": "TemplateProcessing",
            "single": [
                {"SpecialToken": {"id": bos_token, "type_id": 0}},
                {"Sequence": {"id": "A", "type_id": 0}},
            ],
            "pair": [
                {"SpecialToken": {"id": bos_token, "type_id": 0}},
                {"Sequence": {"id": "A", "type_id": 0}},
                {"SpecialToken": {"id": bos_token, "type_id": 1}},
                {"Sequence": {"id": "B", "type_id": 1}},
            ],
            "special_tokens": {bos_token: {"id": bos_token, "ids": [int(bos)], "tokens": [bos_token]}},
        }
    tokenizer = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": normalizer,
        "pre_tokenizer": pre_tokenizer,
        "post_processor": post,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": pre == "llama-bpe",  # Llama 3's tokenizer.json sets it
            "vocab": {token: i for i, token in enumerate(tokens)},
            "merges": [m.split(" ", 1) for m in merges],
        },
    }
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": add_bos and bos is not None,
        "clean_up_tokenization_spaces": False,
    }
    for role, index in (("bos_token", bos), ("eos_token", eos)):
        if index is not None:
            config[role] = tokens[int(index)]
    if "tokenizer.chat_template" in metadata:
        config["chat_template"] = str(metadata["tokenizer.chat_template"])
    return {
        "tokenizer.json": json.dumps(tokenizer, ensure_ascii=False),
        "tokenizer_config.json": json.dumps(config, indent=1, ensure_ascii=False) + "\n",
    }


def write_tokenizer(metadata: dict[str, Any], where: str, out_dir: Path) -> list[str]:
    """Write the tokenizer files into ``out_dir``; return their names."""
    files = tokenizer_files(metadata, where)
    for name, text in files.items():
        (out_dir / name).write_text(text, encoding="utf-8")
    return sorted(files)
