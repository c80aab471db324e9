"""Tokenize the stdlib corpus into flat uint16 token arrays for training the demo model.

    python -m tools.demo_model.pack_demo_corpus [--out-dir .corpus] \
        [--tokenizer loopcast/demo_model/tokenizer.json]

Writes ``train.npy`` and ``heldout.npy`` (every document's tokens followed by
``<|endoftext|>`` = 0, documents in sorted relpath order) and ``corpus_meta.json``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import platform
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from tools.demo_model.demo_corpus import LICENSE, SPLITS, Split, read_split_with_paths

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_OUT_DIR = REPO_ROOT / ".corpus"
DEFAULT_TOKENIZER = REPO_ROOT / "loopcast" / "demo_model" / "tokenizer.json"
EOT_TOKEN = "<|endoftext|>"
EOT_ID = 0


def load_tokenizer(path: Path) -> Tokenizer:
    """The demo tokenizer, set to treat special-token text inside documents as plain text."""
    if not path.is_file():
        raise SystemExit(f"tokenizer {path} not found; run tools/demo_model/train_demo_tokenizer.py first")
    tokenizer = Tokenizer.from_file(str(path))
    if tokenizer.token_to_id(EOT_TOKEN) != EOT_ID or tokenizer.get_vocab_size() > 2**16:
        raise SystemExit(f"tokenizer {path}: expected {EOT_TOKEN} = {EOT_ID} and at most 65536 ids")
    # Only the separators we insert may be id 0, never a literal "<|endoftext|>" in source.
    tokenizer.encode_special_tokens = True
    return tokenizer


def encode_documents(tokenizer: Tokenizer, named_texts: Sequence[tuple[str, str]]) -> np.ndarray:
    """One flat uint16 array: each document's ids followed by EOT_ID."""
    texts = [text for _, text in named_texts]
    encodings = tokenizer.encode_batch_fast(texts, add_special_tokens=False)
    ids = [e.ids for e in encodings]
    decoded = tokenizer.decode_batch(ids, skip_special_tokens=False)
    for (name, text), back in zip(named_texts, decoded, strict=True):
        if back != text:
            raise SystemExit(f"{name}: decode(encode(text)) != text")
    pieces = [np.append(np.asarray(doc, dtype=np.uint16), np.uint16(EOT_ID)) for doc in ids]
    return np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.uint16)


def sha256_file(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def documents_digest(named_texts: Sequence[tuple[str, str]]) -> str:
    """sha256 over ``relpath NUL sha256(bytes) LF`` lines: identifies the exact corpus."""
    digest = hashlib.sha256()
    for name, text in named_texts:
        digest.update(f"{name}\0{hashlib.sha256(text.encode('utf-8')).hexdigest()}\n".encode())
    return digest.hexdigest()


def pack_split(tokenizer: Tokenizer, split: Split, out_dir: Path, root: Path | None) -> dict[str, object]:
    """Write ``<split>.npy`` and return its entry for corpus_meta.json."""
    named_texts = read_split_with_paths(split, root)
    tokens = encode_documents(tokenizer, named_texts)
    path = out_dir / f"{split}.npy"
    np.save(path, tokens)
    n_bytes = sum(len(text.encode("utf-8")) for _, text in named_texts)
    n_doc_tokens = len(tokens) - len(named_texts)  # without the separators
    return {
        "file": path.name,
        "n_files": len(named_texts),
        "n_bytes": n_bytes,
        "n_tokens": len(tokens),
        "n_tokens_without_eot": n_doc_tokens,
        "bytes_per_token": round(n_bytes / max(n_doc_tokens, 1), 4),
        "tokens_sha256": hashlib.sha256(tokens.astype("<u2").tobytes()).hexdigest(),
        "npy_sha256": sha256_file(path),
        "documents_sha256": documents_digest(named_texts),
    }


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", type=Path, default=DEFAULT_OUT_DIR)
    parser.add_argument("--tokenizer", type=Path, default=DEFAULT_TOKENIZER)
    parser.add_argument("--stdlib-root", type=Path, default=None, help="default: this interpreter's")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    tokenizer = load_tokenizer(args.tokenizer)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    meta: dict[str, object] = {
        "source": "CPython standard library .py files (tools/demo_model/demo_corpus.py)",
        "license": LICENSE,
        "python_version": platform.python_version(),
        "tokenizer_sha256": sha256_file(args.tokenizer),
        "dtype": "uint16",
        "eot_id": EOT_ID,
        "splits": {split: pack_split(tokenizer, split, args.out_dir, args.stdlib_root) for split in SPLITS},
    }
    meta_text = json.dumps(meta, indent=2) + "\n"
    (args.out_dir / "corpus_meta.json").write_text(meta_text, encoding="utf-8")
    print(meta_text, end="")


if __name__ == "__main__":
    main()
