"""Train the demo model's byte-level BPE tokenizer on the train split of the stdlib corpus.

    python -m tools.demo_model.train_demo_tokenizer [--out-dir loopcast/demo_model] [--vocab-size 4096]

Writes ``tokenizer.json`` and ``tokenizer_config.json``. Special tokens take ids 0, 1, 2 as in
Ouro. There is no normalizer and the pre-tokenizer is ByteLevel without a prefix space, so
``decode(encode(text)) == text`` for any string; the script checks that on every held-out file
and a few edge cases before writing anything.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from tools.demo_model.demo_corpus import read_split, read_split_with_paths

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
EOT = SPECIAL_TOKENS[0]
DEFAULT_OUT_DIR = Path(__file__).resolve().parents[2] / "loopcast" / "demo_model"
DEFAULT_VOCAB_SIZE = 4096
DEFAULT_MODEL_MAX_LENGTH = 2048

# Strings the corpus may not cover: every byte class the byte-level alphabet must handle.
EDGE_CASES = (
    "",
    "\x00\x01\x7f",
    "a\r\nb\rc\n",
    "\t\t  \u00a0\u3000 trailing   ",
    "naïve café — ünïcödé ∑ λx: x² 😀 中文 עברית \U0010ffff",
    "\ufeffdef f():\n    return '''\\x00'''\n",
)


def special_tokens() -> list[AddedToken]:
    """The special tokens in id order; never normalized, never split."""
    return [AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS]


def untrained_tokenizer() -> Tokenizer:
    """A byte-level BPE pipeline with an empty vocabulary."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    # Only affects offsets; keeping the leading space in them matches GPT-2 style tokenizers.
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    return tokenizer


def train_tokenizer(documents: Sequence[str], vocab_size: int) -> Tokenizer:
    """Train BPE on ``documents``; the result depends only on their content and order."""
    tokenizer = untrained_tokenizer()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=special_tokens(),
        # All 256 byte symbols, so that bytes unseen in training still encode.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(documents, trainer=trainer, length=len(documents))
    return tokenizer


def round_trip_failures(tokenizer: Tokenizer, named_texts: Sequence[tuple[str, str]]) -> list[str]:
    """Names of the texts that do not survive encode then decode unchanged."""
    texts = [text for _, text in named_texts]
    encodings = tokenizer.encode_batch_fast(texts, add_special_tokens=False)
    decoded = tokenizer.decode_batch([e.ids for e in encodings], skip_special_tokens=False)
    return [name for (name, text), back in zip(named_texts, decoded, strict=True) if back != text]


def check_tokenizer(tokenizer: Tokenizer, heldout: Sequence[tuple[str, str]], vocab_size: int) -> None:
    """Raise if the ids, the vocabulary size or the round trip are not as promised."""
    ids = [tokenizer.token_to_id(t) for t in SPECIAL_TOKENS]
    if ids != list(range(len(SPECIAL_TOKENS))):
        raise RuntimeError(f"special token ids are {ids}, expected 0..{len(SPECIAL_TOKENS) - 1}")
    if tokenizer.get_vocab_size() != vocab_size:
        got = tokenizer.get_vocab_size()
        raise RuntimeError(f"vocabulary has {got} entries, expected {vocab_size}")
    cases = [*heldout, *((f"edge case {i}", t) for i, t in enumerate(EDGE_CASES))]
    failures = round_trip_failures(tokenizer, cases)
    if failures:
        raise RuntimeError(f"decode(encode(text)) != text for: {', '.join(failures)}")


def tokenizer_config(model_max_length: int) -> dict[str, object]:
    """A Hugging Face ``tokenizer_config.json`` for ``PreTrainedTokenizerFast``."""
    added = {
        str(i): {
            "content": token,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for i, token in enumerate(SPECIAL_TOKENS)
    }
    return {
        "added_tokens_decoder": added,
        "additional_special_tokens": list(SPECIAL_TOKENS[1:]),
        "bos_token": EOT,
        # transformers' clean-up would rewrite " ." etc. and break exact round trips of code.
        "clean_up_tokenization_spaces": False,
        "eos_token": EOT,
        "model_max_length": model_max_length,
        "pad_token": EOT,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": EOT,
    }


def write_outputs(tokenizer: Tokenizer, out_dir: Path, model_max_length: int) -> None:
    """Write ``tokenizer.json`` and ``tokenizer_config.json`` into ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out_dir / "tokenizer.json"), pretty=True)
    config = json.dumps(tokenizer_config(model_max_length), indent=2, ensure_ascii=False)
    (out_dir / "tokenizer_config.json").write_text(config + "\n", encoding="utf-8")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", type=Path, default=DEFAULT_OUT_DIR)
    parser.add_argument("--vocab-size", type=int, default=DEFAULT_VOCAB_SIZE)
    parser.add_argument("--model-max-length", type=int, default=DEFAULT_MODEL_MAX_LENGTH)
    parser.add_argument("--stdlib-root", type=Path, default=None, help="default: this interpreter's")
    args = parser.parse_args(argv)
    # uint16 token arrays (pack_demo_corpus.py) need every id below 2**16.
    smallest = len(SPECIAL_TOKENS) + 256  # the specials and the byte alphabet
    if not smallest <= args.vocab_size <= 2**16:
        parser.error(f"--vocab-size must be in [{smallest}, 65536], got {args.vocab_size}")
    if args.model_max_length < 1:
        parser.error(f"--model-max-length must be positive, got {args.model_max_length}")
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    train_docs = read_split("train", args.stdlib_root)
    heldout = read_split_with_paths("heldout", args.stdlib_root)
    tokenizer = train_tokenizer(train_docs, args.vocab_size)
    check_tokenizer(tokenizer, heldout, args.vocab_size)
    write_outputs(tokenizer, args.out_dir, args.model_max_length)
    non_ascii = sum(not text.isascii() for _, text in heldout)
    print(
        f"trained on {len(train_docs)} files; round trip ok on {len(heldout)} held-out files "
        f"({non_ascii} non-ASCII) and {len(EDGE_CASES)} edge cases; wrote {args.out_dir}"
    )


if __name__ == "__main__":
    main()
