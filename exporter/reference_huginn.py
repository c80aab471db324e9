"""Torch reference of the recurrent-depth family (Huginn/Raven; docs/architecture.md §1): the oracle.

Written from the architecture. Parameter names are the release's (``transformer.wte.weight``,
``transformer.core_block.{i}.attn.Wqkv.weight``, ...), so ``state_dict()`` round-trips with its
safetensors files. Entry points follow the model:

    embed (·√H) ─▶ prelude ─▶ e ─┬─▶ core_step(s, e, k) for k in 0..r-1 ─▶ s_r ─▶ coda ─▶ head
                                 └──── adapter([s_k, e]) opens every step ──┘
    s_0 = initial_state(seed) (truncated normal) or zero      coda = ln_f ─ 2 blocks ─ ln_f

A block is Huginn's sandwich, the norms *after* the residual adds:
``x = n2(x + attn(n1(x))); x = n4(x + mlp(n3(x)))``. Attention packs q|k|v in one matrix
(``Wqkv``), adds ``qk_bias`` to q and k, and rotates adjacent pairs (the release's
complex-like rotary). KV slots: core step k, layer l → ``k*L + l``; then prelude, then coda
(the config's ``core_slot``/``prelude_slot``/``coda_slot``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from loopcast.exporter.reference import KVCache, RMSNorm, StepContext
from torch import nn

from loopcast.config import ModelConfig
from loopcast.kl_exit import KLExit, step_kl, uniform_log_probs
from loopcast.kv_sharing import core_kv_slot
from loopcast.recurrent_state import initial_state


def rotary_pairs(
    config: ModelConfig, start: int, num_rows: int, device=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin ``[S, D/2]`` (fp32) at positions start.. (the tables the exporter writes)."""
    cos, sin = config.rope_cos_sin(np.arange(start, start + num_rows))
    return torch.from_numpy(cos).to(device), torch.from_numpy(sin).to(device)


def rotate_pairs(x_BHSD: torch.Tensor, cos_SD2: torch.Tensor, sin_SD2: torch.Tensor) -> torch.Tensor:
    """Rotate each adjacent pair (x[2i], x[2i+1]) by position·θ_i, in fp32 (the release's
    ``apply_rotary_emb_complex_like``)."""
    pairs = x_BHSD.float().unflatten(-1, (-1, 2))
    even, odd = pairs[..., 0], pairs[..., 1]
    rotated = torch.stack([even * cos_SD2 - odd * sin_SD2, odd * cos_SD2 + even * sin_SD2], dim=-1)
    return rotated.flatten(-2).to(x_BHSD.dtype)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        h, d = config.hidden_size, config.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, d
        self.chunks = [config.num_heads * d, config.num_kv_heads * d, config.num_kv_heads * d]
        self.Wqkv = nn.Linear(h, sum(self.chunks), bias=False)
        self.has_qk_bias = config.qkv_bias
        if config.qkv_bias:  # [q|k, 1, heads, D]: added before the rotary
            self.qk_bias = nn.Parameter(torch.zeros(2, 1, config.num_heads, d))
        self.proj = nn.Linear(config.num_heads * d, h, bias=False)

    def forward(self, x_BSH: torch.Tensor, ctx: StepContext, slot: int) -> torch.Tensor:
        b, s, _ = x_BSH.shape
        q, k, v = self.Wqkv(x_BSH).split(self.chunks, dim=-1)
        q = q.view(b, s, self.num_heads, self.head_dim)
        k = k.view(b, s, self.num_kv_heads, self.head_dim)
        v = v.view(b, s, self.num_kv_heads, self.head_dim)
        if self.has_qk_bias:
            q, k = q + self.qk_bias[0], k + self.qk_bias[1]
        q = rotate_pairs(q.transpose(1, 2), ctx.cos_SD, ctx.sin_SD)
        k = rotate_pairs(k.transpose(1, 2), ctx.cos_SD, ctx.sin_SD)
        v = v.transpose(1, 2)
        groups = self.num_heads // self.num_kv_heads
        if ctx.cache is None:
            k_all, v_all = k, v
            mask = torch.ones(s, s, dtype=torch.bool, device=q.device).tril()
        else:
            k_all, v_all = ctx.cache.write(slot, ctx.start, k, v)
            total = k_all.shape[2]
            # Row i (position start+i) sees positions <= start+i.
            mask = torch.arange(total, device=q.device)[None, :] <= (
                ctx.start + torch.arange(s, device=q.device)[:, None]
            )
        out = F.scaled_dot_product_attention(
            q, k_all.repeat_interleave(groups, 1), v_all.repeat_interleave(groups, 1), attn_mask=mask
        )
        return self.proj(out.transpose(1, 2).reshape(b, s, self.num_heads * self.head_dim))


class GatedMLP(nn.Module):
    """``proj(silu(fc_1(x)) · fc_2(x))`` with fc = [fc_1 | fc_2] stacked in one matrix."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.fc(x).chunk(2, dim=-1)
        return self.proj(F.silu(gate) * up)


class SandwichBlock(nn.Module):
    """``x = n2(x + attn(n1(x))); x = n4(x + mlp(n3(x)))``."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        eps = config.rms_norm_eps
        self.norm_1 = RMSNorm(config.hidden_size, eps)
        self.attn = Attention(config)
        self.norm_2 = RMSNorm(config.hidden_size, eps)
        self.mlp = GatedMLP(config)
        self.norm_3 = RMSNorm(config.hidden_size, eps)
        self.norm_4 = RMSNorm(config.hidden_size, eps)

    def forward(self, x: torch.Tensor, ctx: StepContext, slot: int) -> torch.Tensor:
        x = self.norm_2(x + self.attn(self.norm_1(x), ctx, slot))
        return self.norm_4(x + self.mlp(self.norm_3(x)))


class _Transformer(nn.Module):
    """The parameters under the release's ``transformer.`` prefix."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        h = config.hidden_size
        self.wte = nn.Embedding(config.vocab_size, h)
        self.prelude = nn.ModuleList(SandwichBlock(config) for _ in range(config.num_prelude_layers))
        self.adapter = nn.Linear(2 * h, h, bias=False)
        self.core_block = nn.ModuleList(SandwichBlock(config) for _ in range(config.num_layers))
        self.coda = nn.ModuleList(SandwichBlock(config) for _ in range(config.num_coda_layers))
        self.ln_f = RMSNorm(h, config.rms_norm_eps)


@dataclass(frozen=True)
class RecurrentOutput:
    """One forward: the logits ``[B, M, V]`` after r core steps, the state s_r ``[B, M, H]``
    (before ln_f) and, with ``all_steps``, the logits after every step (the KL exit reads them)."""

    logits: torch.Tensor
    state: torch.Tensor
    step_logits: list[torch.Tensor]
    exit_loops: int = 0  # the core steps the output was taken after (r without an exit)


class RecurrentLM(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        if not config.recurrent_depth:
            raise ValueError(f"RecurrentLM is the huginn_raven reference, not {config.model_type}")
        self.config = config
        self.transformer = _Transformer(config)
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    # -- entry points (one per architectural part) -------------------------------------------
    def context(self, start: int, num_rows: int, cache: KVCache | None, device=None) -> StepContext:
        cos, sin = rotary_pairs(self.config, start, num_rows, device)
        return StepContext(start, cos, sin, cache)

    def embed(self, input_ids_BS: torch.Tensor) -> torch.Tensor:
        return self.transformer.wte(input_ids_BS) * self.config.embed_scale

    def prelude(self, x: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        for i, block in enumerate(self.transformer.prelude):
            x = block(x, ctx, self.config.prelude_slot(i))
        return x

    def initial_state(self, start: int, num_rows: int, seed: int | None, like: torch.Tensor) -> torch.Tensor:
        """s_0 for the rows at positions start.. (loopcast/recurrent_state.py), ``[1, M, H]``."""
        rows = initial_state(
            self.config.hidden_size, self.config.state_std, np.arange(start, start + num_rows), seed
        )
        return torch.from_numpy(rows)[None].to(device=like.device, dtype=like.dtype)

    def core_step(
        self, state: torch.Tensor, embedded: torch.Tensor, step: int, ctx: StepContext, sharing=None
    ) -> torch.Tensor:
        """One application of the core block at step ``step`` (0-based), the prelude output
        injected through the adapter on ``[state, embedded]``; ``sharing``: the release's KV
        sharing (loopcast/kv_sharing.py ``parse_sharing``), None for a slot per (step, layer)."""
        x = self.transformer.adapter(torch.cat([state, embedded], dim=-1))
        for l, block in enumerate(self.transformer.core_block):
            x = block(x, ctx, core_kv_slot(self.config.num_layers, step, l, sharing))
        return x

    def coda(self, state: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        """Logits (fp32) from a state: ln_f, the coda blocks, ln_f again, the head."""
        x = self.transformer.ln_f(state)
        for i, block in enumerate(self.transformer.coda):
            x = block(x, ctx, self.config.coda_slot(i))
        return self.head(self.transformer.ln_f(x))

    def head(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.transformer.wte.weight if self.config.tie_word_embeddings else self.lm_head.weight
        return (x @ weight.T).float()

    # -- composition ---------------------------------------------------------------------------
    def forward(
        self,
        input_ids_BS: torch.Tensor,
        *,
        loops: int | None = None,
        start: int = 0,
        cache: KVCache | None = None,
        seed: int | None = None,
        all_steps: bool = False,
        kl_exit: KLExit | None = None,
        sharing: tuple[str, int] | None = None,
    ) -> RecurrentOutput:
        """r = ``loops`` core steps (default: the config's) over new rows at positions start...

        ``seed`` draws the initial state (None: zero). With a cache, r must fit its slots
        (``config.num_loops``); ``all_steps`` (no cache: each step's coda would need its own
        coda KV) adds the logits after every step. ``kl_exit`` stops at the first step whose
        KL to the previous step's distribution is below its threshold (loopcast/kl_exit.py).
        """
        if sharing is not None and (cache is None or kl_exit is not None):
            raise ValueError("KV sharing is a cached plain forward (no KL exit)")
        if kl_exit is not None:
            return self._forward_kl_exit(input_ids_BS, loops, start, cache, seed, kl_exit)
        cfg = self.config
        r = cfg.loops_default if loops is None else loops
        if r < 1 or (cache is not None and r > cfg.num_loops):
            raise ValueError(f"loops must be in 1..{cfg.num_loops}, got {r}")
        if all_steps and cache is not None:
            raise ValueError("all_steps needs a recompute (cache=None): each step's coda has its own KV")
        ctx = self.context(start, input_ids_BS.shape[1], cache, input_ids_BS.device)
        embedded = self.prelude(self.embed(input_ids_BS), ctx)
        state = self.initial_state(start, input_ids_BS.shape[1], seed, embedded)
        step_logits = []
        for step in range(r):
            state = self.core_step(state, embedded, step, ctx, sharing)
            if all_steps and step < r - 1:
                step_logits.append(self.coda(state, ctx))
        logits = self.coda(state, ctx)
        if all_steps:
            step_logits.append(logits)
        return RecurrentOutput(logits, state, step_logits, r)

    def _forward_kl_exit(self, input_ids_BS, loops, start, cache, seed, kl_exit: KLExit) -> RecurrentOutput:
        cfg = self.config
        r = cfg.loops_default if loops is None else loops
        if cache is None or not 1 <= r <= cfg.num_loops:
            raise ValueError(f"the KL exit runs cached, with loops in 1..{cfg.num_loops}")
        m = input_ids_BS.shape[1]
        ctx = self.context(start, m, cache, input_ids_BS.device)
        embedded = self.prelude(self.embed(input_ids_BS), ctx)
        state = self.initial_state(start, m, seed, embedded)
        previous = uniform_log_probs(cfg.vocab_size)
        logits, exit_loops = None, r
        for step in range(r):
            state = self.core_step(state, embedded, step, ctx)
            if step + 1 >= kl_exit.min_loops:
                logits = self.coda(state, ctx)  # the check writes the coda KV, as the release's
                kl, previous = step_kl(previous, logits[0, -1].double().numpy())
                if kl < kl_exit.threshold:
                    exit_loops = step + 1
                    break
        if logits is None:  # min_loops > r: no step was checked
            logits = self.coda(state, ctx)
        exited = state
        for step in range(exit_loops, r):  # the steps the rows skipped
            if kl_exit.kv_policy == "full":
                state = self.core_step(state, embedded, step, ctx)  # for the KV only
            else:  # last-exited: the exit step's K/V, layer by layer
                for l in range(cfg.num_layers):
                    src, dst = cfg.core_slot(exit_loops - 1, l), cfg.core_slot(step, l)
                    cache.key[dst, :, :, start : start + m] = cache.key[src, :, :, start : start + m]
                    cache.value[dst, :, :, start : start + m] = cache.value[src, :, :, start : start + m]
        return RecurrentOutput(logits, exited, [], exit_loops)


@torch.no_grad()
def greedy_generate(
    model: RecurrentLM,
    prompt: list[int],
    max_new_tokens: int,
    *,
    loops: int | None = None,
    seed: int | None = None,
    max_length: int | None = None,
    kl_exit: KLExit | None = None,
    exits: list[int] | None = None,
    sharing: tuple[str, int] | None = None,
    stop_ids: tuple[int, ...] = (),
) -> tuple[list[int], list[torch.Tensor]]:
    """Cached greedy decoding: the prompt in one call, then one token per call; returns the new
    tokens and each step's logits ``[V]`` (the reference of the runtime's plain decoding).
    With ``kl_exit``, ``exits`` (if given) gets each call's exit step count."""
    cfg = model.config
    cache = KVCache(cfg, max_length or cfg.max_position_embeddings, dtype=model.transformer.wte.weight.dtype)
    ids = torch.tensor([prompt])
    out = model(ids, loops=loops, cache=cache, seed=seed, kl_exit=kl_exit, sharing=sharing)
    n, tokens, logits = len(prompt), [], []
    for _ in range(max_new_tokens):
        if exits is not None:
            exits.append(out.exit_loops)
        logits.append(out.logits[0, -1])
        token = int(out.logits[0, -1].argmax())
        tokens.append(token)
        if len(tokens) == max_new_tokens or token in stop_ids or n >= cache.max_length:
            break
        out = model(
            torch.tensor([[token]]),
            loops=loops,
            start=n,
            cache=cache,
            seed=seed,
            kl_exit=kl_exit,
            sharing=sharing,
        )
        n += 1
    return tokens, logits
