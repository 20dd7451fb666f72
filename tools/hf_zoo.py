"""Hugging Face models of the kinds issue 36 names, built from configs with random weights (no
downloads), small enough to judge on 2 CPU cores, and exported with :func:`onnx_partition.export`.

The onnx package's own zoo copies (``onnx/backend/test/data/real/``) are URLs only, and this
machine reaches no network beyond package registries: these stand in for them, the depth of each
family kept (GPT-2 12 layers, BERT 6, Llama 8, T5 4+4, ViT 6, a 64-layer thin Llama, ResNet-50,
ConvNeXt-T's 3-3-9-3, MobileNetV2, EfficientNet-B0, RegNet) and the widths cut.

    from hf_zoo import ZOO, export_zoo
    export_zoo("gpt2-12", Path("gpt2-12.onnx"))
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["ZOO", "build", "export_zoo"]

VOCAB = 256
TOKENS = 16
PIXELS = 32


def _lm(kind: str, layers: int, width: int, **extra: Any) -> Any:
    import transformers as tf

    heads = max(width // 16, 1)
    if kind == "gpt2":
        return tf.GPT2LMHeadModel(tf.GPT2Config(
            n_layer=layers, n_embd=width, n_head=heads, n_positions=TOKENS,
            vocab_size=VOCAB, bos_token_id=0, eos_token_id=0))
    common = {"num_hidden_layers": layers, "hidden_size": width, "num_attention_heads": heads,
              "intermediate_size": 4 * width, "vocab_size": VOCAB,
              "max_position_embeddings": TOKENS}
    if kind == "bert":
        return tf.BertForMaskedLM(tf.BertConfig(**common))
    if kind == "llama":
        return tf.LlamaForCausalLM(tf.LlamaConfig(
            num_key_value_heads=max(heads // 2, 1), **common, **extra))
    if kind == "t5":
        return tf.T5ForConditionalGeneration(tf.T5Config(
            vocab_size=VOCAB, d_model=width, d_kv=16, d_ff=4 * width, num_layers=layers,
            num_decoder_layers=layers, num_heads=heads, decoder_start_token_id=0,
            use_cache=False))
    raise ValueError(kind)


def _vision(kind: str) -> Any:
    import transformers as tf

    if kind == "vit":
        return tf.ViTForImageClassification(tf.ViTConfig(
            image_size=PIXELS, patch_size=8, num_channels=3, num_labels=10,
            num_hidden_layers=6, hidden_size=64, num_attention_heads=4, intermediate_size=256))
    if kind == "resnet50":
        return tf.ResNetForImageClassification(tf.ResNetConfig(
            embedding_size=16, hidden_sizes=[32, 64, 128, 256], depths=[3, 4, 6, 3],
            layer_type="bottleneck", num_labels=10))
    if kind == "convnext":
        return tf.ConvNextForImageClassification(tf.ConvNextConfig(
            hidden_sizes=[16, 32, 64, 128], depths=[3, 3, 9, 3], num_labels=10,
            image_size=PIXELS))
    if kind == "mobilenetv2":
        return tf.MobileNetV2ForImageClassification(tf.MobileNetV2Config(
            depth_multiplier=0.35, image_size=PIXELS, num_labels=10))
    if kind == "efficientnet":
        return tf.EfficientNetForImageClassification(tf.EfficientNetConfig(
            width_coefficient=0.25, depth_coefficient=1.0, image_size=PIXELS, num_labels=10,
            hidden_dim=320))  # the head's width, which the config does not scale
    if kind == "regnet":
        return tf.RegNetForImageClassification(tf.RegNetConfig(
            embedding_size=16, hidden_sizes=[16, 32, 64, 128], depths=[1, 2, 4, 1],
            groups_width=8, num_labels=10))
    raise ValueError(kind)


#: name -> builder of the module; a language model reads ``TOKENS`` token ids, a vision model
#: a ``PIXELS``-square RGB image.
ZOO: dict[str, Callable[[], Any]] = {
    "gpt2-12": lambda: _lm("gpt2", 12, 64),
    "bert-6": lambda: _lm("bert", 6, 64),
    "llama-8": lambda: _lm("llama", 8, 64),
    "t5-4+4": lambda: _lm("t5", 4, 64),
    "vit-6": lambda: _vision("vit"),
    "llama-64-thin": lambda: _lm("llama", 64, 32),
    "resnet50": lambda: _vision("resnet50"),
    "convnext": lambda: _vision("convnext"),
    "mobilenetv2": lambda: _vision("mobilenetv2"),
    "efficientnet": lambda: _vision("efficientnet"),
    "regnet": lambda: _vision("regnet"),
}


def build(name: str) -> tuple[Any, tuple[Any, ...], dict[str, Any]]:
    """The module ``name`` of :data:`ZOO` in eval mode (seeded: every build is equal), its
    positional example inputs (2 rows) and keyword ones (T5's decoder ids)."""
    import torch
    import transformers

    if name not in ZOO:
        raise ValueError(f"no zoo model {name!r} (known: {', '.join(ZOO)})")
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    module = ZOO[name]().eval()
    generator = torch.Generator().manual_seed(0)
    if name in ("vit-6", "resnet50", "convnext", "mobilenetv2", "efficientnet", "regnet"):
        return module, (torch.randn(2, 3, PIXELS, PIXELS, generator=generator),), {}
    ids = torch.randint(1, VOCAB, (2, TOKENS), generator=generator)
    if name.startswith("t5"):
        return module, (ids,), {"decoder_input_ids": ids[:, : TOKENS // 2]}
    return module, (ids,), {}


def export_zoo(name: str, path: Path) -> Path:
    """``name`` exported to ``path`` as a user would: ``onnx_partition.export``, random weights
    recorded as such."""
    from onnx_partition import export

    module, args, kwargs = build(name)
    return export(module, args, path, kwargs=kwargs or None, weights="random")
