"""Building blocks shared by the recipes: conv layers and hand-written attention."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

#: Added to attention scores at masked positions (finite, so a fully masked row is no NaN).
MASKED = -1e9


def conv_bn_relu(cin: int, cout: int, kernel: int, stride: int = 1) -> nn.Sequential:
    """Conv (same padding, no bias) -> BatchNorm -> ReLU."""
    return nn.Sequential(
        nn.Conv2d(cin, cout, kernel, stride=stride, padding=kernel // 2, bias=False),
        nn.BatchNorm2d(cout),
        nn.ReLU(inplace=False),
    )


def conv_relu(cin: int, cout: int, kernel: int, stride: int = 1) -> nn.Sequential:
    """Conv (same padding, with bias) -> ReLU."""
    return nn.Sequential(
        nn.Conv2d(cin, cout, kernel, stride=stride, padding=kernel // 2), nn.ReLU(inplace=False)
    )


def init_cnn(module: nn.Module) -> None:
    """He-normal conv weights (variance-preserving through ReLUs), small random biases.

    Used by the BatchNorm-free CNNs so activations neither vanish nor explode with depth.
    """
    for m in module.modules():
        if isinstance(m, nn.Conv2d | nn.ConvTranspose2d):
            nn.init.kaiming_normal_(m.weight, nonlinearity="relu")
            if m.bias is not None:
                nn.init.normal_(m.bias, std=0.1)


@dataclass(frozen=True)
class TransformerConfig:
    """A stack of ``layers`` transformer layers over ``seq`` tokens of a ``vocab``."""

    layers: int
    dim: int
    heads: int
    vocab: int
    seq: int


class Attention(nn.Module):
    """Multi-head scaled dot-product attention, written out with matmuls and softmax.

    Self-attention when ``context`` is None, cross-attention otherwise. ``bias`` is added
    to the scores and must broadcast to ``(batch, heads, queries, keys)``.
    """

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        if dim % heads:
            raise ValueError(f"dim {dim} is not divisible by heads {heads}")
        self.dim, self.heads, self.head_dim = dim, heads, dim // heads
        self.q = nn.Linear(dim, dim)
        self.k = nn.Linear(dim, dim)
        self.v = nn.Linear(dim, dim)
        self.out = nn.Linear(dim, dim)

    def _split(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        return x.view(b, t, self.heads, self.head_dim).transpose(1, 2)

    def forward(
        self,
        x: torch.Tensor,
        context: torch.Tensor | None = None,
        bias: torch.Tensor | None = None,
    ) -> torch.Tensor:
        kv = x if context is None else context
        q, k, v = self._split(self.q(x)), self._split(self.k(kv)), self._split(self.v(kv))
        scores = (q @ k.transpose(-2, -1)) * self.head_dim**-0.5
        if bias is not None:
            scores = scores + bias
        y = scores.softmax(dim=-1) @ v
        b, t, _ = x.shape
        return self.out(y.transpose(1, 2).reshape(b, t, self.dim))


class FeedForward(nn.Sequential):
    """Linear -> GELU -> Linear."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__(nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim))


def causal_bias(length: int) -> torch.Tensor:
    """A ``(length, length)`` additive mask hiding future positions."""
    return torch.full((length, length), MASKED).triu(1)


def init_transformer(module: nn.Module, std: float = 0.02) -> None:
    """GPT-2/BERT-style normal(0, std) weights, with small random biases and LayerNorm params.

    Zero biases and unit LayerNorms, as at real init, would be identical constants that the
    exporter's optimizer merges into one initializer shared across all layers.
    """
    for m in module.modules():
        if isinstance(m, nn.Linear | nn.Embedding):
            nn.init.normal_(m.weight, std=std)
        if isinstance(m, nn.LayerNorm):
            nn.init.normal_(m.weight, mean=1.0, std=std)
        if isinstance(m, nn.Linear | nn.LayerNorm) and m.bias is not None:
            nn.init.normal_(m.bias, std=std)
