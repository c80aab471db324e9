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

_UNKNOWN, _CONTROL, _USER_DEFINED = 2, 3, 4  # llama.cpp's token types
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
    if model not in ("gpt2", "llama"):
        raise CheckpointError(
            f"{where}: tokenizer.ggml.model {model!r} is not supported (loopcast builds gpt2 "
            "byte-level BPE and llama SentencePiece-BPE tokenizers); export the Hugging Face "
            "checkpoint instead"
        )
    tokens = list(metadata["tokenizer.ggml.tokens"])
    types = list(metadata.get("tokenizer.ggml.token_type", [1] * len(tokens)))
    bos, eos = metadata.get("tokenizer.ggml.bos_token_id"), metadata.get("tokenizer.ggml.eos_token_id")
    add_bos = bool(metadata.get("tokenizer.ggml.add_bos_token", model == "llama")) and bos is not None
    if model == "llama":
        tokenizer = _sentencepiece(metadata, tokens, types, where)
    else:
        tokenizer = _byte_level_bpe(metadata, tokens, types, where)
    if add_bos and bos is not None:
        tokenizer["post_processor"] = _prepend_bos(tokens[int(bos)], int(bos))
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": add_bos,
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


def _added(tokens: list[str], types: list[int], special: tuple[int, ...], plain: tuple[int, ...]) -> list:
    return [
        {
            "id": i,
            "content": token,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": kind in plain,
            "special": kind in special,
        }
        for i, (token, kind) in enumerate(zip(tokens, types, strict=True))
        if kind in special + plain
    ]


def _prepend_bos(bos_token: str, bos: int) -> dict:
    first, second = ({"SpecialToken": {"id": bos_token, "type_id": i}} for i in (0, 1))
    return {
        "type": "TemplateProcessing",
        "single": [first, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [
            first,
            {"Sequence": {"id": "A", "type_id": 0}},
            second,
            {"Sequence": {"id": "B", "type_id": 1}},
        ],
        "special_tokens": {bos_token: {"id": bos_token, "ids": [bos], "tokens": [bos_token]}},
    }


def _sentencepiece(metadata: dict[str, Any], tokens: list[str], types: list[int], where: str) -> dict:
    """A SentencePiece BPE vocabulary (pieces, scores) as Hugging Face's Llama tokenizer.json:
    "▁" for spaces and one in front (unless ``add_space_prefix`` is false), byte fallback to the
    ``<0xXX>`` pieces, and the merges transformers' SentencePieceExtractor derives: every split
    of a piece into two pieces, ranked by the piece's score (then the shorter left part)."""
    scores = list(metadata.get("tokenizer.ggml.scores", []))
    if len(scores) != len(tokens):
        raise CheckpointError(f"{where}: tokenizer.ggml.scores must give one score per token")
    vocab = {token: i for i, token in enumerate(tokens)}
    merges = []
    for piece, score in zip(tokens, scores, strict=True):
        local = [
            (piece[:at], piece[at:], score)
            for at in range(1, len(piece))
            if piece[:at] in vocab and piece[at:] in vocab
        ]
        merges += sorted(local, key=lambda m: (vocab[m[0]], vocab[m[1]]))
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    unk = next((t for t, kind in zip(tokens, types, strict=True) if kind == _UNKNOWN), None)
    normalizers: list[dict] = [{"type": "Replace", "pattern": {"String": " "}, "content": "▁"}]
    strip = []
    if metadata.get("tokenizer.ggml.add_space_prefix", True):
        normalizers.insert(0, {"type": "Prepend", "prepend": "▁"})
        strip = [{"type": "Strip", "content": " ", "start": 1, "stop": 0}]
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": _added(tokens, types, (_UNKNOWN, _CONTROL), (_USER_DEFINED,)),
        "normalizer": {"type": "Sequence", "normalizers": normalizers},
        "pre_tokenizer": None,
        "post_processor": None,
        "decoder": {
            "type": "Sequence",
            "decoders": [
                {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
                {"type": "ByteFallback"},
                {"type": "Fuse"},
                *strip,
            ],
        },
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": unk,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": True,
            "byte_fallback": True,
            "ignore_merges": False,
            "vocab": vocab,
            "merges": [[left, right] for left, right, _ in merges],
        },
    }


def _byte_level_bpe(metadata: dict[str, Any], tokens: list[str], types: list[int], where: str) -> dict:
    pre = metadata.get("tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZERS:
        raise CheckpointError(
            f"{where}: tokenizer.ggml.pre {pre!r} is not supported (known: {', '.join(PRE_TOKENIZERS)})"
        )
    merges = list(metadata.get("tokenizer.ggml.merges", []))
    normalizer, pre_tokenizer = PRE_TOKENIZERS[pre]
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": _added(tokens, types, (_CONTROL,), (_USER_DEFINED,)),
        "normalizer": normalizer,
        "pre_tokenizer": pre_tokenizer,
        "post_processor": {
            "type": "ByteLevel",
            "add_prefix_space": True,
            "trim_offsets": False,
            "use_regex": True,
        },
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


def write_tokenizer(metadata: dict[str, Any], where: str, out_dir: Path) -> list[str]:
    """Write the tokenizer files into ``out_dir``; return their names."""
    files = tokenizer_files(metadata, where)
    for name, text in files.items():
        (out_dir / name).write_text(text, encoding="utf-8")
    return sorted(files)
