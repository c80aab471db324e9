"""An independent numpy forward of a Huginn/Raven checkpoint (the release's tensor names), for
checking the torch reference and the graphs: whole-sequence recompute, float64, its own rotary
(adjacent pairs, θ_i = base^(-2i/D)) and its own reading of config.json and the weights."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file


class HuginnNumpy:
    def __init__(self, checkpoint_dir: Path) -> None:
        raw = json.loads((Path(checkpoint_dir) / "config.json").read_text())
        self.raw = raw
        self.h = raw["n_embd"]
        self.heads = raw["n_heads"]
        self.kv_heads = raw.get("num_key_value_heads") or self.heads
        self.d = self.h // self.heads
        self.eps = raw["norm_eps"]
        self.base = raw["rope_base"]
        self.prelude_n = raw["n_layers_in_prelude"]
        self.core_n = raw["n_layers_in_recurrent_block"]
        self.coda_n = raw["n_layers_in_coda"]
        self.w = {
            k: v.astype(np.float64) for k, v in load_file(Path(checkpoint_dir) / "model.safetensors").items()
        }

    def _norm(self, x, name):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + self.eps) * self.w[name]

    def _rotate(self, x_SHD, positions):
        inv = self.base ** (-np.arange(0, self.d, 2) / self.d)
        angle = positions[:, None] * inv[None, :]  # [S, D/2]
        cos, sin = np.cos(angle)[:, None, :], np.sin(angle)[:, None, :]
        even, odd = x_SHD[..., 0::2], x_SHD[..., 1::2]
        out = np.empty_like(x_SHD)
        out[..., 0::2] = even * cos - odd * sin
        out[..., 1::2] = odd * cos + even * sin
        return out

    def _block(self, x_SH, p):
        s = x_SH.shape[0]
        a_in = self._norm(x_SH, f"{p}.norm_1.weight")
        qkv = a_in @ self.w[f"{p}.attn.Wqkv.weight"].T
        nq, nkv = self.heads * self.d, self.kv_heads * self.d
        q = qkv[:, :nq].reshape(s, self.heads, self.d)
        k = qkv[:, nq : nq + nkv].reshape(s, self.kv_heads, self.d)
        v = qkv[:, nq + nkv :].reshape(s, self.kv_heads, self.d)
        if f"{p}.attn.qk_bias" in self.w:
            bias = self.w[f"{p}.attn.qk_bias"]
            q, k = q + bias[0], k + bias[1]
        pos = np.arange(s, dtype=np.float64)
        q, k = self._rotate(q, pos), self._rotate(k, pos)
        group = self.heads // self.kv_heads
        out = np.zeros((s, self.heads, self.d))
        causal = np.tril(np.ones((s, s), dtype=bool))
        for hh in range(self.heads):
            kh, vh = k[:, hh // group], v[:, hh // group]
            scores = (q[:, hh] @ kh.T) / math.sqrt(self.d)
            scores = np.where(causal, scores, -np.inf)
            prob = np.exp(scores - scores.max(-1, keepdims=True))
            prob /= prob.sum(-1, keepdims=True)
            out[:, hh] = prob @ vh
        x_SH = self._norm(x_SH + out.reshape(s, -1) @ self.w[f"{p}.attn.proj.weight"].T, f"{p}.norm_2.weight")
        fc = self._norm(x_SH, f"{p}.norm_3.weight") @ self.w[f"{p}.mlp.fc.weight"].T
        gate, up = np.split(fc, 2, axis=-1)
        m = (gate / (1 + np.exp(-gate)) * up) @ self.w[f"{p}.mlp.proj.weight"].T
        return self._norm(x_SH + m, f"{p}.norm_4.weight")

    def logits(self, ids: list[int], loops: int, state0: np.ndarray) -> np.ndarray:
        """``[S, V]`` after ``loops`` core steps from the initial state ``state0`` ``[S, H]``."""
        wte = self.w["transformer.wte.weight"]
        e = wte[np.asarray(ids)] * math.sqrt(self.h)
        for i in range(self.prelude_n):
            e = self._block(e, f"transformer.prelude.{i}")
        s = state0.astype(np.float64)
        for _ in range(loops):
            s = np.concatenate([s, e], axis=-1) @ self.w["transformer.adapter.weight"].T
            for i in range(self.core_n):
                s = self._block(s, f"transformer.core_block.{i}")
        x = self._norm(s, "transformer.ln_f.weight")
        for i in range(self.coda_n):
            x = self._block(x, f"transformer.coda.{i}")
        x = self._norm(x, "transformer.ln_f.weight")
        head = self.w.get("lm_head.weight", wte) if not self.raw.get("tie_embeddings", True) else wte
        return x @ head.T
