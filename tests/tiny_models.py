"""The one registry of tiny test models: every shape the suite uses, each under one name.

Two parts of the suite draw on it: the ``tiny_config`` fixture (tests/conftest.py; torch-side
tests over random checkpoints of std ``TEST_CHECKPOINT_STD``) and the cached exported artifacts
(tests/artifacts.py; ``artifact(name)``, checkpoints of std ``ARTIFACT_CHECKPOINT_STD``). A name
always means the same shape; head_dim stays 16 (the ONNX exporter needs a multiple of 16),
hidden 64, vocab ~100.
"""

from __future__ import annotations

from loopcast.config import ModelConfig
from loopcast.presets import PRESETS

_OURO, _LLAMA = PRESETS["tiny-ouro"], PRESETS["tiny-llama"]

TINY_MODELS: dict[str, ModelConfig] = {
    "ouro-r3": _OURO,
    "ouro-r2-gqa": _OURO.replace(num_loops=2, num_kv_heads=2, vocab_size=89),
    "ouro-r2-gqa-v100": _OURO.replace(
        num_loops=2, num_kv_heads=2, vocab_size=100, max_position_embeddings=64
    ),
    "ouro-r4-1layer": _OURO.replace(num_loops=4, num_layers=1, max_position_embeddings=64),
    "ouro-r4-1layer-mqa": _OURO.replace(
        num_loops=4, num_layers=1, num_kv_heads=1, vocab_size=89, max_position_embeddings=96
    ),
    "llama-tied-gqa": _LLAMA,
    "llama-untied": _LLAMA.replace(tie_word_embeddings=False, num_kv_heads=4),
    "llama-untied-gqa": _LLAMA.replace(
        tie_word_embeddings=False, num_kv_heads=1, vocab_size=96, max_position_embeddings=64
    ),
    # GGUF blocks hold 32 values along K: every projection's K (hidden 64, ffn 96) is a multiple
    "llama-untied-k32": _LLAMA.replace(tie_word_embeddings=False, intermediate_size=96),
    "qwen2-tied-k32": PRESETS["tiny-qwen2"].replace(intermediate_size=96),
}

# The shapes the ``tiny_config`` fixture runs over (Ouro R=3 / R=2 GQA / R=4 one layer, Llama
# tied / untied GQA), and those tests parametrized over "every tiny artifact" run over.
FIXTURE_MODELS = ("ouro-r3", "ouro-r2-gqa-v100", "ouro-r4-1layer-mqa", "llama-tied-gqa", "llama-untied-gqa")
ARTIFACT_MODELS = ("ouro-r3", "ouro-r2-gqa", "ouro-r4-1layer", "llama-tied-gqa", "llama-untied")

# Init std of the fixture checkpoints. 0.02 (the training init) gives near-uniform logits whose
# top-1/top-2 gap falls to ~5e-4; 0.1 keeps logits finite and |logit| < 4, and over 20-token
# generations the smallest gap stays >= 7e-4 while fp32 cached-vs-recompute noise stays <= 4e-6
# (at 0.2 the noise reaches 3e-5: sandwich norms amplify fp32 rounding of large activations).
TEST_CHECKPOINT_STD = 0.1
# The artifacts' checkpoints: 0.15 keeps argmax margins clear.
ARTIFACT_CHECKPOINT_STD = 0.15


def write_byte_tokenizer(path) -> None:
    """A tokenizer.json of 256 ids, one a byte (a byte-level BPE with no merges)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tokenizer = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(sorted(alphabet))}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.save(str(path))
