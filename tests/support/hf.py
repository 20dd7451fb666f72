"""Tiny Hugging Face models built from configs with random weights (no downloads), as users
hand them to :func:`onnx_partition.export`: the model itself, its ``ModelOutput`` flattened by
the exporter. The session fixture ``hf_exported`` (tests/conftest.py) exports each once."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers

from onnx_partition import export

__all__ = ["HF_MODELS", "VOCAB", "build_hf", "export_hf", "hf_example"]

VOCAB = 100
#: The models the fixture serves: three language models and a vision model.
HF_MODELS = ("gpt2", "bert", "llama", "vit")


def build_hf(name: str) -> torch.nn.Module:
    """A 2-layer, 32-wide model of the family ``name`` (seeded, so every build is equal)."""
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    small = {"num_hidden_layers": 2, "hidden_size": 32, "num_attention_heads": 4,
             "intermediate_size": 64}
    if name == "gpt2":  # lm_head tied to wte
        return transformers.GPT2LMHeadModel(transformers.GPT2Config(
            n_layer=2, n_embd=32, n_head=4, n_positions=16, vocab_size=VOCAB,
            bos_token_id=0, eos_token_id=0))
    if name == "bert":
        return transformers.BertForMaskedLM(transformers.BertConfig(
            vocab_size=VOCAB, max_position_embeddings=16, **small))
    if name == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=VOCAB, max_position_embeddings=16, num_key_value_heads=2, **small))
    if name == "vit":
        return transformers.ViTForImageClassification(transformers.ViTConfig(
            image_size=16, patch_size=8, num_channels=3, num_labels=5, **small))
    raise ValueError(f"no tiny Hugging Face model {name!r}")


def hf_example(name: str, rows: int = 2
               ) -> tuple[tuple[torch.Tensor, ...], dict[str, torch.Tensor]]:
    """Example inputs (positional) and labels (keyword) of ``rows`` rows."""
    generator = torch.Generator().manual_seed(0)
    if name == "vit":
        return ((torch.randn(rows, 3, 16, 16, generator=generator),),
                {"labels": torch.randint(0, 5, (rows,), generator=generator)})
    ids = torch.randint(0, VOCAB, (rows, 8), generator=generator)
    return (ids,), {"labels": ids}


def export_hf(name: str, path: Path, *, labels: bool = False) -> Path:
    """The model exported as it is (``use_cache`` turned off by the exporter); with
    ``labels`` also an input, so its first output is its own loss."""
    args, kwargs = hf_example(name)
    return export(build_hf(name), args, path, kwargs=kwargs if labels else None)
