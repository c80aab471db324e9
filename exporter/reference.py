"""Torch reference model of the looped-transformer family (docs/architecture.md §1): the oracle.

Written from the architecture, not from an upstream implementation. Parameter names follow the
Hugging Face checkpoints (``model.layers.{i}.self_attn.q_proj.weight``, ...), so
``state_dict()`` round-trips with upstream safetensors files.

Entry points mirror the architecture so that every graph kind has a reference:

    embed ─▶ prelude ─▶ core_loop(r) for r in 0..R-1 ─▶ coda ─▶ head
                         (each loop ends with the loop-norm; its output feeds the next loop,
                          the exit gate and, at any depth d, the lm_head)
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from loopcast.config import ModelConfig


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Statistics in fp32 whatever the model dtype, as upstream Ouro/Llama do.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class KVCache:
    """Fixed per-slot KV buffers ``[slots, B, H_kv, S_max, D]`` written by position.

    The cache does not track a length: the caller owns ``n`` (docs/architecture.md §2). Rewind is the
    caller setting ``n`` back; data past ``n`` is never read before it is rewritten.
    """

    def __init__(
        self,
        config: ModelConfig,
        max_length: int,
        batch: int = 1,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        shape = (config.num_kv_slots, batch, config.num_kv_heads, max_length, config.head_dim)
        self.key = torch.zeros(shape, dtype=dtype, device=device)
        self.value = torch.zeros(shape, dtype=dtype, device=device)
        self.max_length = max_length

    def write(self, slot: int, start: int, key_BHSD: torch.Tensor, value_BHSD: torch.Tensor):
        """Store the new rows at positions start.., return K/V for positions 0..start+M-1."""
        stop = start + key_BHSD.shape[2]
        self.key[slot, :, :, start:stop] = key_BHSD
        self.value[slot, :, :, start:stop] = value_BHSD
        return self.key[slot, :, :, :stop], self.value[slot, :, :, :stop]


def rotary_cos_sin(config: ModelConfig, start: int, num_rows: int, dtype: torch.dtype, device=None):
    """cos/sin ``[S, D]`` at positions start.. for the half-split (rotate_half) convention.

    The scaled frequencies (rope types, yarn's attention factor) come from ``loopcast.rope``,
    the same fp32 tables the exporter writes into the artifact. Positions are host integers,
    so building the tables never waits on the device.
    """
    cos, sin = (torch.from_numpy(t) for t in config.rope_cos_sin(np.arange(start, start + num_rows)))
    cos, sin = torch.cat([cos, cos], dim=-1), torch.cat([sin, sin], dim=-1)
    return cos.to(device=device, dtype=dtype), sin.to(device=device, dtype=dtype)


def apply_rotary(x_BHSD: torch.Tensor, cos_SD: torch.Tensor, sin_SD: torch.Tensor) -> torch.Tensor:
    half = x_BHSD.shape[-1] // 2
    rotated = torch.cat([-x_BHSD[..., half:], x_BHSD[..., :half]], dim=-1)
    return x_BHSD * cos_SD + rotated * sin_SD


@dataclass(frozen=True)
class StepContext:
    """Where the new rows sit: their first position, the rotary tables, and the cache."""

    start: int
    cos_SD: torch.Tensor
    sin_SD: torch.Tensor
    cache: KVCache | None


class Attention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        h, d = config.hidden_size, config.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, d
        self.q_proj = nn.Linear(h, config.num_heads * d, bias=config.qkv_bias)
        self.k_proj = nn.Linear(h, config.num_kv_heads * d, bias=config.qkv_bias)
        self.v_proj = nn.Linear(h, config.num_kv_heads * d, bias=config.qkv_bias)
        self.o_proj = nn.Linear(config.num_heads * d, h, bias=config.o_bias)

    def forward(self, x_BSH: torch.Tensor, ctx: StepContext, slot: int) -> torch.Tensor:
        b, s, _ = x_BSH.shape
        q = self.q_proj(x_BSH).view(b, s, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x_BSH).view(b, s, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x_BSH).view(b, s, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary(q, ctx.cos_SD, ctx.sin_SD), apply_rotary(k, ctx.cos_SD, ctx.sin_SD)
        groups = self.num_heads // self.num_kv_heads
        if ctx.cache is None:
            # Full recompute (and training): the new rows are the whole sequence.
            k_all, v_all = k, v
            out = F.scaled_dot_product_attention(
                q, k_all.repeat_interleave(groups, 1), v_all.repeat_interleave(groups, 1), is_causal=True
            )
        else:
            k_all, v_all = ctx.cache.write(slot, ctx.start, k, v)
            # Row i (position start+i) sees positions <= start+i.
            total = k_all.shape[2]
            mask = torch.arange(total, device=q.device)[None, :] <= (
                ctx.start + torch.arange(s, device=q.device)[:, None]
            )
            out = F.scaled_dot_product_attention(
                q, k_all.repeat_interleave(groups, 1), v_all.repeat_interleave(groups, 1), attn_mask=mask
            )
        return self.o_proj(out.transpose(1, 2).reshape(b, s, self.num_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        h, i = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(h, i, bias=config.mlp_bias)
        self.up_proj = nn.Linear(h, i, bias=config.mlp_bias)
        self.down_proj = nn.Linear(i, h, bias=config.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """Ouro sandwich layer (``x += n2(attn(n1(x))); x += n4(mlp(n3(x)))``) or Llama pre-norm."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        eps = config.rms_norm_eps
        self.self_attn = Attention(config)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps)
        self.sandwich = config.sandwich_norm
        if self.sandwich:
            self.input_layernorm_2 = RMSNorm(config.hidden_size, eps)
            self.post_attention_layernorm_2 = RMSNorm(config.hidden_size, eps)

    def forward(self, x: torch.Tensor, ctx: StepContext, slot: int) -> torch.Tensor:
        a = self.self_attn(self.input_layernorm(x), ctx, slot)
        x = x + (self.input_layernorm_2(a) if self.sandwich else a)
        m = self.mlp(self.post_attention_layernorm(x))
        return x + (self.post_attention_layernorm_2(m) if self.sandwich else m)


class _Backbone(nn.Module):
    """Holds the parameters under the upstream ``model.`` prefix."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_layers))
        if config.num_prelude_layers:
            self.prelude_layers = nn.ModuleList(
                DecoderLayer(config) for _ in range(config.num_prelude_layers)
            )
        if config.num_coda_layers:
            self.coda_layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_coda_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        if config.has_exit_gate:
            self.early_exit_gate = nn.Linear(config.hidden_size, 1)


@dataclass(frozen=True)
class LoopedOutput:
    """Per-depth results of one forward: index r holds what loop r (depth r+1) produced."""

    logits: list[torch.Tensor]  # [B, M, V] at each computed depth
    hidden: list[torch.Tensor]  # loop-normed state after each loop [B, M, H]
    gate_logits: list[torch.Tensor]  # exit-gate logit after each loop [B, M] (Ouro only)

    @property
    def final_logits(self) -> torch.Tensor:
        return self.logits[-1]


class LoopedLM(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = _Backbone(config)
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    # -- entry points (one per architectural part) -------------------------------------------
    def context(self, start: int, num_rows: int, cache: KVCache | None, device=None) -> StepContext:
        window = self.config.sliding_window
        if window is not None and start + num_rows > window:
            # Below the window, windowed and full attention agree; beyond it they do not.
            raise ValueError(f"positions up to {start + num_rows} exceed the sliding window {window}")
        cos, sin = rotary_cos_sin(self.config, start, num_rows, self.model.embed_tokens.weight.dtype, device)
        return StepContext(start, cos, sin, cache)

    def embed(self, input_ids_BS: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids_BS)

    def prelude(self, x: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        for i in range(self.config.num_prelude_layers):
            x = self.model.prelude_layers[i](x, ctx, self.config.prelude_slot(i))
        return x

    def core_loop(self, x: torch.Tensor, loop: int, ctx: StepContext) -> torch.Tensor:
        """One pass of the core stack at depth ``loop`` (0-based) followed by the loop-norm."""
        for layer_index, layer in enumerate(self.model.layers):
            x = layer(x, ctx, self.config.core_slot(loop, layer_index))
        return self.model.norm(x)

    def coda(self, x: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        for i in range(self.config.num_coda_layers):
            x = self.model.coda_layers[i](x, ctx, self.config.coda_slot(i))
        return x

    def head(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.model.embed_tokens.weight if self.config.tie_word_embeddings else self.lm_head.weight
        return x @ weight.T

    def exit_gate(self, x: torch.Tensor) -> torch.Tensor:
        return self.model.early_exit_gate(x).squeeze(-1)

    # -- compositions --------------------------------------------------------------------------
    def forward(
        self,
        input_ids_BS: torch.Tensor | None = None,
        *,
        start: int = 0,
        cache: KVCache | None = None,
        first_loop: int = 0,
        last_loop: int | None = None,
        hidden_BSH: torch.Tensor | None = None,
        all_depths: bool = False,
    ) -> LoopedOutput:
        """Run loops ``first_loop .. last_loop-1`` over new rows at positions ``start..``.

        ``first_loop == 0`` starts from token ids (embed + prelude); otherwise ``hidden_BSH``
        is the loop-normed state at depth ``first_loop`` (the verify_tail contract). Stopping
        early (``last_loop < R``) gives that depth's logits: the coda and lm_head read the
        state of the last loop run. ``all_depths`` adds logits at every depth.
        """
        cfg = self.config
        last_loop = cfg.num_loops if last_loop is None else last_loop
        if not 0 <= first_loop < last_loop <= cfg.num_loops:
            raise ValueError(f"loop range {first_loop}..{last_loop} outside 0..{cfg.num_loops}")
        if all_depths and cache is not None and cfg.num_coda_layers:
            # The cache holds one coda KV per position (the committed depth's); a shallower
            # depth's coda would need its own, so its logits are undefined on a cached step.
            raise ValueError(
                "all_depths with a KV cache is undefined for models with coda layers; "
                "run last_loop=d per depth instead"
            )
        if first_loop == 0:
            x = self.embed(input_ids_BS)
        else:
            if hidden_BSH is None:
                raise ValueError("hidden_BSH is required when first_loop > 0")
            x = hidden_BSH
        ctx = self.context(start, x.shape[1], cache, x.device)
        if first_loop == 0:
            x = self.prelude(x, ctx)
        logits, hidden, gates = [], [], []
        for loop in range(first_loop, last_loop):
            x = self.core_loop(x, loop, ctx)
            hidden.append(x)
            if cfg.has_exit_gate:
                gates.append(self.exit_gate(x))
            if all_depths or loop == last_loop - 1:
                # Without coda layers (Ouro, Llama) the coda is the identity and every depth's
                # logits are defined with or without a cache (see the check above).
                is_last = loop == last_loop - 1
                coda_ctx = ctx if is_last else StepContext(ctx.start, ctx.cos_SD, ctx.sin_SD, None)
                logits.append(self.head(self.coda(x, coda_ctx)))
        return LoopedOutput(logits, hidden, gates)


def exit_probabilities(gate_logits: list[torch.Tensor]) -> torch.Tensor:
    """Ouro's exit distribution over loops (docs/architecture.md §1), stacked on the last axis.

    λ_r = σ(gate_r); p_r = λ_r · Π_{s<r}(1-λ_s) for r < R-1; the last loop takes the rest.
    """
    lambdas = [torch.sigmoid(g.float()) for g in gate_logits]
    survive = torch.ones_like(lambdas[0])
    probs = []
    for r, lam in enumerate(lambdas):
        if r == len(lambdas) - 1:
            probs.append(survive)
        else:
            probs.append(lam * survive)
            survive = survive * (1.0 - lam)
    return torch.stack(probs, dim=-1)


def init_weights(model: LoopedLM, seed: int, std: float = 0.02) -> None:
    """Deterministic random init: normal(0, std) matrices, unit norms, zero gate bias."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if name.endswith("norm.weight") or "layernorm" in name:
                param.fill_(1.0)
            elif name.endswith("early_exit_gate.bias"):
                param.zero_()
            else:
                param.copy_(torch.randn(param.shape, generator=generator) * std)
