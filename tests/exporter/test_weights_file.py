"""The artifact's weights file, written with numpy from the memory-mapped checkpoint, holds
bit for bit what torch's conversions give (fused, transposed, rounded to nearest even)."""

from __future__ import annotations

import pytest
import torch
from loopcast.exporter.export import ExportOptions, export_checkpoint
from safetensors.torch import load_file

from loopcast.manifest import WEIGHTS_FILE
from loopcast.presets import PRESETS

TORCH = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


@pytest.mark.parametrize("stored", ["fp32", "bf16"])
@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16"])
def test_weights_equal_torch_conversions(make_checkpoint, tmp_path, stored, dtype):
    config = PRESETS["tiny-llama"].replace(
        qkv_bias=True, o_bias=True, mlp_bias=True, tie_word_embeddings=False
    )
    checkpoint = make_checkpoint(config, dtype=TORCH[stored])
    # stock: fp16/bf16 artifacts are for a GPU, which the default op set refuses without CUDA
    export_checkpoint(checkpoint, tmp_path / "art", ExportOptions(dtype=dtype, max_length=32, ops="stock"))
    ours = load_file(tmp_path / "art" / WEIGHTS_FILE)
    theirs = load_file(checkpoint / "model.safetensors")
    attn, mlp, want = "model.layers.1.self_attn", "model.layers.1.mlp", TORCH[dtype]

    def same(name: str, expected: torch.Tensor) -> None:
        assert ours[name].dtype == want
        assert torch.equal(ours[name], expected.to(want).contiguous()), name

    same("layers.1.qkv_proj.weight_T", torch.cat([theirs[f"{attn}.{p}_proj.weight"] for p in "qkv"]).T)
    same("layers.1.qkv_proj.bias", torch.cat([theirs[f"{attn}.{p}_proj.bias"] for p in "qkv"]))
    same("layers.1.o_proj.bias", theirs[f"{attn}.o_proj.bias"])
    same(
        "layers.1.gate_up_proj.weight_T",
        torch.cat([theirs[f"{mlp}.gate_proj.weight"], theirs[f"{mlp}.up_proj.weight"]]).T,
    )
    same(
        "layers.1.gate_up_proj.bias",
        torch.cat([theirs[f"{mlp}.gate_proj.bias"], theirs[f"{mlp}.up_proj.bias"]]),
    )
    same("layers.1.down_proj.weight_T", theirs[f"{mlp}.down_proj.weight"].T)
    same("lm_head.weight_T", theirs["lm_head.weight"].T)
    same("embed_tokens.weight", theirs["model.embed_tokens.weight"])
