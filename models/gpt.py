"""GPT-2-style decoder-only transformer (Radford et al., 2019).

Token + learned position embeddings, pre-LayerNorm blocks of causal self-attention and
a GELU MLP, final LayerNorm and an (untied) LM head. "realistic" is GPT-2 medium:
24 layers, width 1024, 16 heads, 50257-token vocabulary, 128-token context.
"""

from __future__ import annotations

import torch
from torch import nn

from ._layers import Attention, FeedForward, TransformerConfig, causal_bias, init_transformer
from ._recipe import Recipe, finish, input_generator, seeded

Config = TransformerConfig


CONFIGS = {
    "tiny": Config(layers=2, dim=32, heads=4, vocab=128, seq=16),
    "small": Config(layers=12, dim=256, heads=4, vocab=2000, seq=64),
    "realistic": Config(layers=24, dim=1024, heads=16, vocab=50257, seq=128),
}


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.ln1, self.attn = nn.LayerNorm(dim), Attention(dim, heads)
        self.ln2, self.mlp = nn.LayerNorm(dim), FeedForward(dim, 4 * dim)

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x), bias=bias)
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab, cfg.dim)
        self.pos = nn.Embedding(cfg.seq, cfg.dim)
        self.blocks = nn.ModuleList(Block(cfg.dim, cfg.heads) for _ in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.vocab, bias=False)
        init_transformer(self)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        t = input_ids.shape[1]
        x = self.tok(input_ids) + self.pos(torch.arange(t, device=input_ids.device))
        bias = causal_bias(t).to(x.device)
        for block in self.blocks:
            x = block(x, bias)
        return self.head(self.ln_f(x))


def build(size: str, batch_size: int) -> Recipe:
    cfg = CONFIGS[size]
    with seeded():
        module = GPT(cfg)
    ids = torch.randint(0, cfg.vocab, (batch_size, cfg.seq), generator=input_generator())
    return finish(module, {"input_ids": ids}, ["logits"])
