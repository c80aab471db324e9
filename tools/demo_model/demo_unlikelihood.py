"""Sequence-level unlikelihood for the demo-model trainer (``--unlikelihood``).

Welleck et al., 2019, "Neural Text Generation with Unlikelihood Training" (§5.2): continue
training-set prefixes greedily with the model being trained, then lower the probability of
every continuation token that is part of an n-gram the continuation already produced. Greedy
decoding of a maximum-likelihood model feeds on its own repetitions (the loop gets more likely
each time round); this term penalises exactly the loops the model makes, on the model's own
text, while the Ouro objective on real text keeps the repetitions that code does have.

The loss at depth r is ``-mean_{masked t} log(1 - p_r(x_t | x_<t))``. The trainer weights the
depths by its exit prior π or equally (``--ul-depth-weights``). Equal weights keep the held-out
loss decreasing with depth; with π, depth 4 takes most of the push and falls behind depth 3
(docs/demo-model.md, runs 12–18).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from loopcast.exporter.reference import KVCache, LoopedLM


def repeated_ngram_mask(cont_BL: np.ndarray, n: int) -> np.ndarray:
    """True at every token of an n-gram that already occurred earlier in the same row."""
    batch, length = cont_BL.shape
    mask = np.zeros((batch, length), dtype=bool)
    for b in range(batch):
        row, seen = cont_BL[b].tolist(), set()
        for j in range(length - n + 1):
            gram = tuple(row[j : j + n])
            if gram in seen:
                mask[b, j : j + n] = True
            seen.add(gram)
    return mask


@torch.no_grad()
def greedy_continue(model: LoopedLM, prefix_BP: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """Greedy full-depth continuation of every row (eval mode, static cache): [B, P + new]."""
    was_training = model.training
    model.eval()
    device = prefix_BP.device
    on_gpu = device.type == "cuda"
    batch, plen = prefix_BP.shape
    cache = KVCache(
        model.config,
        plen + new_tokens,
        batch=batch,
        dtype=torch.bfloat16 if on_gpu else torch.float32,
        device=device,
    )
    tokens = [prefix_BP]
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=on_gpu):
        logits = model(prefix_BP, start=0, cache=cache).final_logits[:, -1]
        for i in range(new_tokens):
            nxt = logits.float().argmax(-1, keepdim=True)
            tokens.append(nxt)
            if i + 1 < new_tokens:
                logits = model(nxt, start=plen + i, cache=cache).final_logits[:, -1]
    model.train(was_training)
    return torch.cat(tokens, dim=1)


def unlikelihood_loss(
    model, seq_BT: torch.Tensor, prefix_len: int, mask_BL: torch.Tensor, depth_weights: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(Σ_r w_r·UL_r, per-depth UL [R]) over the masked continuation tokens of ``seq_BT``."""
    out = model(seq_BT[:, :-1], all_depths=True)
    target_BL = seq_BT[:, prefix_len:]
    weight = mask_BL.float()
    count = weight.sum().clamp_min(1.0)
    per_depth = []
    for logits in out.logits:
        logp = F.log_softmax(logits[:, prefix_len - 1 :].float(), dim=-1)
        logp_BL = logp.gather(-1, target_BL.unsqueeze(-1)).squeeze(-1)
        # log(1 - p) from log p, clamped so a token the model is sure of gives a finite push.
        one_minus = (-torch.expm1(logp_BL)).clamp_min(1e-5)
        per_depth.append(-(torch.log(one_minus) * weight).sum() / count)
    per_depth_t = torch.stack(per_depth)
    return (per_depth_t * depth_weights).sum(), per_depth_t.detach()


def statement_heads(tokens: np.ndarray, tokenizer) -> np.ndarray:
    """Positions in ``tokens`` where a line (at any indentation) starts with ``def`` or
    ``class`` (at its indentation token when that stands alone). Prefixes cut there look like
    the prompts users give and the model card's (a function's first line)."""
    text = [tokenizer.decode([i]) for i in range(tokenizer.get_vocab_size())]
    line_start = np.array([("\n" in t and t.rsplit("\n", 1)[1].strip(" ") == "") for t in text])
    spaces = np.array([t != "" and t.strip(" ") == "" for t in text])
    head = np.array([("\n" not in t and t.lstrip(" ").split(" ", 1)[0] in ("def", "class")) for t in text])
    ids = np.asarray(tokens).astype(np.int64)
    at = np.flatnonzero(head[ids[2:]]) + 2
    before = ids[at - 1]
    ok = line_start[before] | (spaces[before] & line_start[ids[at - 2]])
    return np.where(spaces[before], at - 1, at)[ok]
