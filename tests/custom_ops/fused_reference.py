"""Torch references of ResidualRMSNorm and SwiGLU with the ops' roundings, and the comparison with them.
numpy and torch only, so the GPU kernel tests can use them on a machine without onnxruntime."""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F

TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def to_torch(x: np.ndarray, dtype: str, device: str = "cpu") -> torch.Tensor:
    """An array as fed to or read from the test models (fp32 for bf16) as a tensor of the op dtype."""
    return torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32)).to(device).to(TORCH_DTYPES[dtype])


def rms_norm(v: torch.Tensor, g: torch.Tensor, eps: float) -> torch.Tensor:
    """The torch reference RMSNorm: normalise in fp32, round to the dtype, scale by the weight."""
    v32 = v.float()
    return g * (v32 * torch.rsqrt(v32.pow(2).mean(-1, keepdim=True) + eps)).to(v.dtype)


def residual_rms_norm(
    branch: torch.Tensor, residual: torch.Tensor, weights: dict[str, torch.Tensor], eps: float = 1e-6
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(sum, normed) of ResidualRMSNorm; `weights` holds the present ones by input name."""
    b = rms_norm(branch, weights["branch_weight"], eps) if "branch_weight" in weights else branch
    s = residual + b
    if "loop_weight" in weights:
        s = rms_norm(s, weights["loop_weight"], eps)
    return s, rms_norm(s, weights["out_weight"], eps) if "out_weight" in weights else None


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up  # silu rounded to the dtype first, as in the op


# Two ulps for fp16/bf16; about eight for fp32, whose roundings to T vanish and every element then
# carries the reduction-order difference.
TOLERANCE = {"float32": 1e-6, "float16": 2.0**-9, "bfloat16": 2.0**-6}


def assert_close(got: torch.Tensor, want: torch.Tensor, dtype: str, max_fraction: float = 0.005) -> None:
    """`got` equals the reference up to the order of the fp32 sums: within TOLERANCE of |want| plus
    TOLERANCE of the largest |want| (a sum that cancels is off by ulps of its operands, not of
    itself), and for fp16/bf16 all but `max_fraction` of the elements (at least one may) bit-identical."""
    got, want = got.float().cpu(), want.float().cpu()
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(got, want, rtol=tol, atol=tol * float(want.abs().max()))
    if dtype != "float32":
        differ = int((got != want).sum())
        assert differ <= max(1, math.ceil(max_fraction * got.numel())), (
            f"{differ} of {got.numel()} {dtype} elements differ from the reference"
        )
