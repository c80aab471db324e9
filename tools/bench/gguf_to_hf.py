"""A GGUF file as a Hugging Face checkpoint folder, for tools that only read those (ORT-GenAI's
model builder takes float GGUFs or an HF folder, not Q4_1 blocks).

    python -m tools.bench.gguf_to_hf model.gguf OUT_DIR

Writes ``model.safetensors`` (every tensor dequantized to fp32 exactly as loopcast's GGUF path
reads it: exporter/gguf_source.py, q/k rows un-permuted), ``config.json`` (the file's metadata
as a Hugging Face config) and ``tokenizer.json`` / ``tokenizer_config.json`` (the GGUF
tokenizer, exporter/gguf_tokenizer.py). The weights are the ones the GGUF's blocks stand for, so
a quantizer that reads this folder quantizes llama.cpp's values, not the original float ones.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from loopcast.exporter.checkpoint import expected_shapes, write_checkpoint
from loopcast.exporter.gguf_source import GGUFSource
from loopcast.exporter.gguf_tokenizer import write_tokenizer


def gguf_to_hf(gguf: Path, out: Path) -> Path:
    source = GGUFSource(gguf)

    def tensors():
        for name in expected_shapes(source.config):
            yield name, torch.from_numpy(source.read(name).astype("float32"))

    path = write_checkpoint(source.config, tensors, out, torch.float32)
    write_tokenizer(source.metadata, str(gguf), path)
    return path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("gguf", type=Path)
    p.add_argument("out", type=Path)
    args = p.parse_args()
    print(f"wrote {gguf_to_hf(args.gguf, args.out)}")


if __name__ == "__main__":
    main()
