"""Rotary position embeddings: the scaling types of Hugging Face configs, torch-free.

One implementation of the inverse frequencies (numpy, float64) serves both the torch reference
(``exporter/reference.py``) and the exporter, which writes the cos/sin tables into the artifact
at export time. Formulas follow transformers' ``modeling_rope_utils`` (read as a spec; the
fidelity tests compare logits against transformers itself):

- ``default``: ``inv_freq[i] = theta ** (-2i / D)``
- ``linear``:  ``inv_freq / factor``
- ``dynamic``: NTK scaling that transformers applies only once a sequence grows beyond
  ``max_position_embeddings``; below that it is ``default`` exactly. An export's max length
  never exceeds ``max_position_embeddings`` (``ExportOptions.resolved``), so ``dynamic`` is
  ``default`` for every position an artifact can reach, which is what transformers computes.
- ``llama3``: per-band rescaling with ``factor``, ``low_freq_factor``, ``high_freq_factor``,
  ``original_max_position_embeddings``.
- ``yarn``: ramped interpolation/extrapolation mix, and cos/sin scaled by ``attention_factor``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from loopcast.errors import ConfigError

# Parameters each rope type reads (besides rope_type / rope_theta); anything else is refused.
ROPE_PARAMETERS: dict[str, frozenset[str]] = {
    "default": frozenset(),
    "linear": frozenset({"factor"}),
    # transformers' dynamic type does not read original_max_position_embeddings; accepted as inert.
    "dynamic": frozenset({"factor", "original_max_position_embeddings"}),
    "llama3": frozenset(
        {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}
    ),
    "yarn": frozenset(
        {
            "factor",
            "original_max_position_embeddings",
            "attention_factor",
            "beta_fast",
            "beta_slow",
            "mscale",
            "mscale_all_dim",
            "truncate",
        }
    ),
}
_REQUIRED: dict[str, tuple[str, ...]] = {
    "linear": ("factor",),
    "dynamic": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor"),
    "yarn": (),
}


@dataclass(frozen=True)
class RopeScaling:
    """A non-default rope type and its parameters, as (name, value) pairs sorted by name."""

    rope_type: str
    params: tuple[tuple[str, Any], ...] = ()

    def get(self, name: str, default: Any = None) -> Any:
        return dict(self.params).get(name, default)

    def to_hf_dict(self) -> dict[str, Any]:
        return {"rope_type": self.rope_type, **dict(self.params)}


def parse_rope(raw: dict[str, Any]) -> tuple[float, RopeScaling | None]:
    """``(rope_theta, scaling or None)`` from a config in either transformers format.

    transformers ≥ 5 writes ``rope_parameters: {rope_theta, rope_type, ...}``; older versions
    ``rope_theta`` plus ``rope_scaling: {type|rope_type, factor, ...}`` (or null).
    """
    params = raw.get("rope_parameters")
    scaling = raw.get("rope_scaling")
    if params is not None and scaling is not None and params != scaling:
        raise ConfigError("config.json has both rope_parameters and rope_scaling and they differ")
    block = params if params is not None else scaling
    if block is not None and not isinstance(block, dict):
        raise ConfigError(f"config field rope_parameters/rope_scaling must be an object, got {block!r}")
    block = dict(block or {})
    theta = block.pop("rope_theta", None)
    top_theta = raw.get("rope_theta")
    if theta is not None and top_theta is not None and float(theta) != float(top_theta):
        raise ConfigError(f"config.json gives rope_theta {top_theta} and rope_parameters.rope_theta {theta}")
    theta = float(theta if theta is not None else top_theta if top_theta is not None else 10000.0)
    partial = block.pop("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))
    if partial is not None and float(partial) != 1.0:
        raise ConfigError(
            f"partial_rotary_factor {partial} is not supported (only 1.0: rotary on the whole head)"
        )
    rope_type = block.pop("rope_type", None) or block.pop("type", None) or "default"
    block.pop("type", None)
    if rope_type not in ROPE_PARAMETERS:
        raise ConfigError(
            f"rope type {rope_type!r} is not supported; supported: {', '.join(ROPE_PARAMETERS)}"
        )
    unknown = sorted(set(block) - ROPE_PARAMETERS[rope_type])
    if unknown:
        raise ConfigError(
            f"rope parameter {unknown[0]!r} is not understood for rope type {rope_type!r} "
            f"(known: {', '.join(sorted(ROPE_PARAMETERS[rope_type])) or 'none'})"
        )
    for name in _REQUIRED.get(rope_type, ()):
        if block.get(name) is None:
            raise ConfigError(f"rope type {rope_type!r} needs the parameter {name!r}")
    if rope_type == "default":
        return theta, None
    if rope_type in ("llama3", "yarn"):
        # transformers fills this in from max_position_embeddings when absent.
        block.setdefault("original_max_position_embeddings", raw.get("max_position_embeddings", 2048))
    return theta, RopeScaling(rope_type, tuple(sorted(block.items())))


def inv_freq(
    theta: float, head_dim: int, scaling: RopeScaling | None, max_position_embeddings: int
) -> np.ndarray:
    """Scaled inverse frequencies ``[D/2]`` (float64)."""
    base = theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    freq = 1.0 / base
    if scaling is None or scaling.rope_type in ("default", "dynamic"):
        return freq
    factor = scaling.get("factor")
    if scaling.rope_type == "linear":
        return freq / float(factor)
    if scaling.rope_type == "llama3":
        return _llama3(
            freq,
            float(factor),
            float(scaling.get("low_freq_factor")),
            float(scaling.get("high_freq_factor")),
            float(scaling.get("original_max_position_embeddings")),
        )
    return _yarn(theta, head_dim, scaling, max_position_embeddings)[0]


def attention_factor(scaling: RopeScaling | None, max_position_embeddings: int) -> float:
    """The factor transformers multiplies cos and sin by (1 except for yarn)."""
    if scaling is None or scaling.rope_type != "yarn":
        return 1.0
    return _yarn_attention_factor(scaling, max_position_embeddings)


def cos_sin(
    theta: float,
    head_dim: int,
    scaling: RopeScaling | None,
    max_position_embeddings: int,
    positions: np.ndarray,
) -> tuple[np.ndarray, np.ndarray]:
    """cos/sin ``[S, D/2]`` (float32) for the half-split convention; GroupQueryAttention's cache."""
    freqs = (
        positions.astype(np.float64)[:, None]
        * inv_freq(theta, head_dim, scaling, max_position_embeddings)[None, :]
    )
    # The angle is rounded to fp32 before cos/sin, as transformers computes it.
    angle = freqs.astype(np.float32).astype(np.float64)
    scale = attention_factor(scaling, max_position_embeddings)
    return (np.cos(angle) * scale).astype(np.float32), (np.sin(angle) * scale).astype(np.float32)


def _llama3(freq: np.ndarray, factor: float, low: float, high: float, old_context: float) -> np.ndarray:
    low_wavelen, high_wavelen = old_context / low, old_context / high
    wavelen = 2 * math.pi / freq
    scaled = np.where(wavelen > low_wavelen, freq / factor, freq)
    smooth = (old_context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return np.where(medium, smoothed, scaled)


def _yarn_factor(scaling: RopeScaling, max_position_embeddings: int) -> float:
    factor = scaling.get("factor")
    if factor is None:
        return max_position_embeddings / float(scaling.get("original_max_position_embeddings"))
    return float(factor)


def _yarn_attention_factor(scaling: RopeScaling, max_position_embeddings: int) -> float:
    given = scaling.get("attention_factor")
    if given is not None:
        return float(given)
    factor = _yarn_factor(scaling, max_position_embeddings)

    def mscale_of(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return mscale_of(factor, float(mscale)) / mscale_of(factor, float(mscale_all_dim))
    return mscale_of(factor)


def _yarn(
    theta: float, dim: int, scaling: RopeScaling, max_position_embeddings: int
) -> tuple[np.ndarray, float]:
    factor = _yarn_factor(scaling, max_position_embeddings)
    original = float(scaling.get("original_max_position_embeddings"))
    beta_fast = scaling.get("beta_fast") or 32
    beta_slow = scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0, 1)
    pos_freqs = theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    extrapolation_weight = 1 - ramp
    freq = interpolation * (1 - extrapolation_weight) + extrapolation * extrapolation_weight
    return freq, _yarn_attention_factor(scaling, max_position_embeddings)
