"""Small modules whose saved-for-backward bytes the tests count by hand (``cost/saved.py``,
``cost/autocast.py``): a Linear + GELU (+ Dropout) + LayerNorm block, and a tiny HF GPT-2
returning its logits, as ``torch.export`` takes it."""

from __future__ import annotations

import torch
import transformers

__all__ = ["HIDDEN", "ROWS", "WIDTH", "Block", "Logits", "tiny_gpt2"]

ROWS, WIDTH, HIDDEN = 4, 8, 16


class Block(torch.nn.Module):
    """Linear(WIDTH, HIDDEN), GELU, Dropout(0.5) if ``dropout``, LayerNorm(HIDDEN)."""

    def __init__(self, dropout: bool = False) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(WIDTH, HIDDEN)
        self.act = torch.nn.GELU()
        self.drop = torch.nn.Dropout(0.5) if dropout else torch.nn.Identity()
        self.ln = torch.nn.LayerNorm(HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ln(self.drop(self.act(self.lin(x))))


class Logits(torch.nn.Module):
    """An HF causal LM returning only its logits."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, return_dict=False)[0]


def tiny_gpt2() -> torch.nn.Module:
    """HF GPT-2: 2 layers, width 32, 4 heads, 16 positions, vocabulary 100, no KV cache."""
    transformers.logging.set_verbosity_error()
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=4, n_positions=16, vocab_size=100, bos_token_id=0,
        eos_token_id=0))
    model.config.use_cache = False
    return model
