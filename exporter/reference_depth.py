"""The reference of every depth policy the runtime offers (docs/adaptive-depth.md): greedy
decoding at a static depth, or with Ouro's exit gate under either KV policy.

Written loop by loop from the model's entry points (``embed → prelude → core_loop(r) → coda →
head``, ``exit_gate``), independently of the graphs:

- static ``loops = k``: every row runs loops 0..k-1 and reads the head there (Ouro's
  ``exit_at_step = k-1``; loop j never reads a deeper loop, so skipping loops k..R-1 is exact);
- gated, ``full``: every row runs all R loops (their KV is written); the token is the argmax at
  the exit loop e, the first loop (0-based) whose cumulative exit probability reaches q,
  clamped to min_loops-1..max_loops-1;
- gated, ``last-exited``: a generated token's row stops after its exit loop e, and its K/V of
  loop e is written into the slots of loops e+1..R-1 at its position.

Prompt rows run every loop under both policies; the gate picks the token of the last one.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from loopcast.exporter.reference import KVCache, LoopedLM
from loopcast.exporter.reference_generate import _greedy_loop, validate_request

from loopcast.errors import RequestError
from loopcast.vocab import KVPolicy


@dataclass(frozen=True)
class DepthResult:
    tokens: list[int]
    finish_reason: str
    loops: list[int] = field(default_factory=list)  # loops each token was read at (exit loop + 1)

    def depth_stats(self) -> dict:
        histogram: dict[int, int] = {}
        for k in self.loops:
            histogram[k] = histogram.get(k, 0) + 1
        mean = sum(self.loops) / len(self.loops) if self.loops else 0.0
        return {"exit_histogram": dict(sorted(histogram.items())), "mean_loops": round(mean, 4)}


def exit_loop(gate_logits: list[float], threshold: float, lo: int, hi: int) -> int:
    """The 0-based exit loop of one row from its gate logits at loops 0..R-1: λ_r = σ(g_r),
    p_r = λ_r·Π_{s<r}(1-λ_s), the last loop the rest (float64); the first r whose cumulative
    probability reaches ``threshold``, clamped to lo..hi."""
    first = None
    for r, cumulative in enumerate(_cumulative(gate_logits)):
        if cumulative >= threshold:
            first = r
            break
    return min(max(len(gate_logits) - 1 if first is None else first, lo), hi)


def _cumulative(gate_logits: list[float]):
    R = len(gate_logits)
    survive, cumulative = 1.0, 0.0
    for r, g in enumerate(gate_logits):
        lam = float(torch.sigmoid(torch.tensor(g, dtype=torch.float64)))
        cumulative += lam * survive if r < R - 1 else survive
        survive *= 1.0 - lam
        yield cumulative


@torch.no_grad()
def depth_generate(
    model: LoopedLM,
    prompt_ids: list[int],
    config,
    *,
    stop_ids: tuple[int, ...] = (),
    max_length: int | None = None,
) -> DepthResult:
    """Greedy decoding under ``config``'s depth policy (a GenerationConfig: ``max_new_tokens``,
    ``loops`` or ``exit_threshold``/``min_loops``/``max_loops``/``kv_policy``)."""
    cfg = model.config
    R = cfg.num_loops
    max_length = cfg.max_position_embeddings if max_length is None else max_length
    validate_request(model, prompt_ids, config.max_new_tokens, max_length)
    weight = model.model.embed_tokens.weight
    cache = KVCache(cfg, max_length, dtype=weight.dtype, device=weight.device)
    gated = config.exit_threshold is not None
    if gated and not cfg.has_exit_gate:
        raise RequestError("exit_threshold needs a model with an exit gate (Ouro's early_exit_gate)")
    loops = config.loops or R
    if not 1 <= loops <= R:
        raise RequestError(f"loops must be in 1..{R}, got {loops}")
    lo = (config.min_loops or 1) - 1
    hi = min(config.max_loops or R, R) - 1
    if lo > hi:
        raise RequestError(f"min_loops {lo + 1} exceeds the model's loops or max_loops ({hi + 1})")
    last_exited = gated and config.kv_policy == KVPolicy.LAST_EXITED
    used: list[int] = []

    def row(token: int, n: int, skip: bool) -> torch.Tensor:
        """One row at position n: its loops (all, or up to the exit when ``skip``), its logits."""
        ctx = model.context(n, 1, cache, weight.device)
        x = model.prelude(model.embed(torch.tensor([[token]], device=weight.device)), ctx)
        states, gates = [], []
        stop = loops - 1
        for r in range(loops):
            x = model.core_loop(x, r, ctx)
            states.append(x)
            if gated:
                gates.append(float(model.exit_gate(x)[0, 0]))
                # the gate logits so far decide whether loop r is the exit: the cumulative
                # probability of loops <= r does not depend on the deeper loops' gates
                if (
                    skip
                    and r >= lo
                    and (r == hi or list(_cumulative(gates + [0.0]))[r] >= config.exit_threshold)
                ):
                    stop = r
                    break
        if gated and not skip:
            stop = exit_loop(gates, config.exit_threshold, lo, hi)
        if skip and stop < R - 1:
            _fill_deeper(cache, cfg, stop, n)
        used.append(stop + 1)
        return model.head(model.coda(states[stop], ctx))[0, -1]

    def next_logits(pending: list[int], n: int) -> torch.Tensor:
        if len(pending) > 1:  # the prompt: every loop
            model(
                torch.tensor([pending[:-1]], device=weight.device),
                start=n,
                cache=cache,
                last_loop=None if gated else loops,
            )
            n += len(pending) - 1
            return row(pending[-1], n, skip=False)
        return row(pending[0], n, skip=last_exited)

    result = _greedy_loop(next_logits, prompt_ids, config.max_new_tokens, max_length, stop_ids, False)
    return DepthResult(result.tokens, result.finish_reason, used[: len(result.tokens)])


def _fill_deeper(cache: KVCache, cfg, exit_r: int, position: int) -> None:
    """last-exited: loop ``exit_r``'s K/V at ``position`` into the slots of the deeper loops."""
    for layer in range(cfg.num_layers):
        src = cfg.core_slot(exit_r, layer)
        for r in range(exit_r + 1, cfg.num_loops):
            dst = cfg.core_slot(r, layer)
            cache.key[dst, :, :, position] = cache.key[src, :, :, position]
            cache.value[dst, :, :, position] = cache.value[src, :, :, position]
