"""The ceiling: a bare PyTorch decode loop over a static KV cache.

Plain torch on the checkpoint's safetensors: batch B, contiguous cache
[layers][B, max_len, KH, D], one SDPA per layer, no paging, no scheduling,
no IPC. The engine's decode-heavy throughput is compared against this.
"""

from __future__ import annotations

import json
import os
import time

import torch
import torch.nn.functional as F
from safetensors.torch import load_file


class BareLlama:
    def __init__(self, path: str) -> None:
        with open(os.path.join(path, "config.json")) as f:
            cfg = json.load(f)
        weights: dict[str, torch.Tensor] = {}
        for name in sorted(os.listdir(path)):
            if name.endswith(".safetensors"):
                weights.update(load_file(os.path.join(path, name)))
        self.w = {k: v.float() for k, v in weights.items()}
        self.num_layers = cfg["num_hidden_layers"]
        self.num_heads = cfg["num_attention_heads"]
        self.num_kv_heads = cfg.get("num_key_value_heads", self.num_heads)
        self.head_dim = cfg.get("head_dim") or cfg["hidden_size"] // self.num_heads
        self.eps = cfg["rms_norm_eps"]
        theta = cfg.get("rope_theta", 10000.0)
        inv = 1.0 / theta ** (torch.arange(0, self.head_dim, 2).float() / self.head_dim)
        t = torch.arange(cfg["max_position_embeddings"]).float()
        freqs = torch.outer(t, inv)
        self.cos, self.sin = freqs.cos(), freqs.sin()
        # Fused projections, as any serious decode loop would do.
        self.qkv = []
        self.gate_up = []
        for i in range(self.num_layers):
            p = f"model.layers.{i}."
            self.qkv.append(torch.cat([self.w[p + f"self_attn.{n}_proj.weight"] for n in "qkv"]))
            self.gate_up.append(torch.cat([self.w[p + "mlp.gate_proj.weight"], self.w[p + "mlp.up_proj.weight"]]))
        self.lm_head = self.w.get("lm_head.weight", self.w["model.embed_tokens.weight"])

    def _norm(self, x, weight):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * weight

    def _rope(self, x, pos):  # x [B, T, H, D]
        half = self.head_dim // 2
        cos, sin = self.cos[pos][:, :, None, :], self.sin[pos][:, :, None, :]
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

    @torch.inference_mode()
    def forward(self, ids, pos, caches, start):
        """ids, pos: [B, T]; writes K/V at start..start+T; returns logits of the last position."""
        B, T = ids.shape
        h, kh, d = self.num_heads, self.num_kv_heads, self.head_dim
        x = F.embedding(ids, self.w["model.embed_tokens.weight"])
        end = start + T
        for i in range(self.num_layers):
            p = f"model.layers.{i}."
            y = self._norm(x, self.w[p + "input_layernorm.weight"])
            qkv = y @ self.qkv[i].T
            q, k, v = qkv.split([h * d, kh * d, kh * d], dim=-1)
            q = self._rope(q.view(B, T, h, d), pos)
            k = self._rope(k.view(B, T, kh, d), pos)
            kc, vc = caches[i]
            kc[:, start:end] = k
            vc[:, start:end] = v.view(B, T, kh, d)
            o = F.scaled_dot_product_attention(
                q.transpose(1, 2), kc[:, :end].transpose(1, 2), vc[:, :end].transpose(1, 2),
                is_causal=T > 1, enable_gqa=h != kh,
            )
            x = x + o.transpose(1, 2).reshape(B, T, h * d) @ self.w[p + "self_attn.o_proj.weight"].T
            y = self._norm(x, self.w[p + "post_attention_layernorm.weight"])
            gate, up = (y @ self.gate_up[i].T).chunk(2, dim=-1)
            x = x + (F.silu(gate) * up) @ self.w[p + "mlp.down_proj.weight"].T
        x = self._norm(x[:, -1], self.w["model.norm.weight"])
        return x @ self.lm_head.T

    def decode_throughput(self, prompts: torch.Tensor, num_new_tokens: int) -> tuple[float, float]:
        """Greedy-decode num_new_tokens for each row of prompts [B, P]; returns (seconds, tokens/s)."""
        B, P = prompts.shape
        max_len = P + num_new_tokens
        caches = [
            (torch.zeros(B, max_len, self.num_kv_heads, self.head_dim),
             torch.zeros(B, max_len, self.num_kv_heads, self.head_dim))
            for _ in range(self.num_layers)
        ]
        start = time.perf_counter()
        pos = torch.arange(P)[None].expand(B, P)
        logits = self.forward(prompts, pos, caches, 0)
        token = logits.argmax(-1, keepdim=True)
        for step in range(1, num_new_tokens):
            pos = torch.full((B, 1), P + step - 1)
            logits = self.forward(token, pos, caches, P + step - 1)
            token = logits.argmax(-1, keepdim=True)
        elapsed = time.perf_counter() - start
        return elapsed, B * num_new_tokens / elapsed
