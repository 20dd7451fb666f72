"""Encoder-decoder transformer (Vaswani et al., 2017), pre-LayerNorm variant.

The encoder reads ``src_ids`` with bidirectional self-attention; every decoder layer runs
causal self-attention over ``tgt_ids``, then cross-attends to the final encoder output
(so that output feeds every decoder layer: long edges), then a GELU feed-forward.
"realistic" is Transformer-base: 6 + 6 layers, width 512, 8 heads, FFN 2048, 32000 tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ._layers import Attention, FeedForward, causal_bias, init_transformer
from ._recipe import Recipe, finish, input_generator, seeded


@dataclass(frozen=True)
class Config:
    enc_layers: int
    dec_layers: int
    dim: int
    heads: int
    vocab: int  # shared by source and target
    src: int  # source length
    tgt: int  # target length


CONFIGS = {
    "tiny": Config(1, 2, dim=32, heads=4, vocab=128, src=16, tgt=12),
    "small": Config(4, 4, dim=256, heads=4, vocab=2000, src=64, tgt=48),
    "realistic": Config(6, 6, dim=512, heads=8, vocab=32000, src=128, tgt=128),
}


class EncoderLayer(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.ln1, self.attn = nn.LayerNorm(dim), Attention(dim, heads)
        self.ln2, self.ffn = nn.LayerNorm(dim), FeedForward(dim, 4 * dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.ffn(self.ln2(x))


class DecoderLayer(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.ln1, self.self_attn = nn.LayerNorm(dim), Attention(dim, heads)
        self.ln2, self.cross_attn = nn.LayerNorm(dim), Attention(dim, heads)
        self.ln3, self.ffn = nn.LayerNorm(dim), FeedForward(dim, 4 * dim)

    def forward(self, x: torch.Tensor, memory: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.ln1(x), bias=bias)
        x = x + self.cross_attn(self.ln2(x), context=memory)
        return x + self.ffn(self.ln3(x))


class EncoderDecoder(nn.Module):
    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab, cfg.dim)
        self.pos = nn.Embedding(max(cfg.src, cfg.tgt), cfg.dim)
        self.encoder = nn.ModuleList(
            EncoderLayer(cfg.dim, cfg.heads) for _ in range(cfg.enc_layers)
        )
        self.enc_ln = nn.LayerNorm(cfg.dim)
        self.decoder = nn.ModuleList(
            DecoderLayer(cfg.dim, cfg.heads) for _ in range(cfg.dec_layers)
        )
        self.dec_ln = nn.LayerNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.vocab, bias=False)
        init_transformer(self)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.tok(ids) + self.pos(torch.arange(ids.shape[1], device=ids.device))

    def forward(self, src_ids: torch.Tensor, tgt_ids: torch.Tensor) -> torch.Tensor:
        memory = self.embed(src_ids)
        for enc in self.encoder:
            memory = enc(memory)
        memory = self.enc_ln(memory)
        x = self.embed(tgt_ids)
        bias = causal_bias(tgt_ids.shape[1]).to(x.device)
        for dec in self.decoder:
            x = dec(x, memory, bias)
        return self.head(self.dec_ln(x))


def build(size: str, batch_size: int) -> Recipe:
    cfg = CONFIGS[size]
    with seeded():
        module = EncoderDecoder(cfg)
    gen = input_generator()
    src = torch.randint(0, cfg.vocab, (batch_size, cfg.src), generator=gen)
    tgt = torch.randint(0, cfg.vocab, (batch_size, cfg.tgt), generator=gen)
    return finish(module, {"src_ids": src, "tgt_ids": tgt}, ["logits"])
