"""BERT-style bidirectional encoder (Devlin et al., 2018).

Word + learned position embeddings with LayerNorm, post-LayerNorm encoder layers
(self-attention, GELU feed-forward) and a tanh pooler over the first token. Padding
positions (``attention_mask == 0``) are hidden from attention. "realistic" is BERT-base:
12 layers, width 768, 12 heads, FFN 3072, 30522-token vocabulary, 128-token sequences.
"""

from __future__ import annotations

import torch
from torch import nn

from ._layers import MASKED, Attention, FeedForward, TransformerConfig, init_transformer
from ._recipe import Recipe, finish, input_generator, seeded

Config = TransformerConfig


CONFIGS = {
    "tiny": Config(layers=2, dim=32, heads=4, vocab=128, seq=16),
    "small": Config(layers=8, dim=256, heads=4, vocab=2000, seq=64),
    "realistic": Config(layers=12, dim=768, heads=12, vocab=30522, seq=128),
}


class Layer(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.attn, self.ln1 = Attention(dim, heads), nn.LayerNorm(dim)
        self.ffn, self.ln2 = FeedForward(dim, 4 * dim), nn.LayerNorm(dim)

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        x = self.ln1(x + self.attn(x, bias=bias))
        return self.ln2(x + self.ffn(x))


class Bert(nn.Module):
    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab, cfg.dim)
        self.pos = nn.Embedding(cfg.seq, cfg.dim)
        self.ln = nn.LayerNorm(cfg.dim)
        self.layers = nn.ModuleList(Layer(cfg.dim, cfg.heads) for _ in range(cfg.layers))
        self.pooler = nn.Linear(cfg.dim, cfg.dim)
        init_transformer(self)

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        t = input_ids.shape[1]
        x = self.ln(self.tok(input_ids) + self.pos(torch.arange(t, device=input_ids.device)))
        # (batch, 1, 1, keys): 0 where attended, MASKED at padding.
        bias = (1.0 - attention_mask[:, None, None, :].to(x.dtype)) * MASKED
        for layer in self.layers:
            x = layer(x, bias)
        return x, torch.tanh(self.pooler(x[:, 0]))


def build(size: str, batch_size: int) -> Recipe:
    cfg = CONFIGS[size]
    with seeded():
        module = Bert(cfg)
    gen = input_generator()
    ids = torch.randint(0, cfg.vocab, (batch_size, cfg.seq), generator=gen)
    # Each row keeps a random-length prefix of real tokens (at least half), then padding.
    lengths = torch.randint(cfg.seq // 2, cfg.seq + 1, (batch_size, 1), generator=gen)
    mask = (torch.arange(cfg.seq)[None, :] < lengths).to(torch.int64)
    return finish(
        module, {"input_ids": ids, "attention_mask": mask}, ["last_hidden_state", "pooler_output"]
    )
