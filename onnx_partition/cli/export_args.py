"""The options of ``onnx-partition export``: a recipe of ``models/``, or a Hugging Face config
(``--hf-config DIR``, with or without weights)."""

from __future__ import annotations

import argparse
from pathlib import Path

from onnx_partition.settings.export import DEFAULT_SEQ_LEN

__all__ = ["export_args"]


def export_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("name", nargs="?",
                   help="recipe: resnet, inception, unet, gpt, bert, encdec (or --hf-config)")
    p.add_argument("--size", default="tiny", help="recipe: tiny | small | realistic")
    p.add_argument("--batch-size", type=int, default=2, help="example batch used for tracing")
    hf = p.add_argument_group("a Hugging Face model from its config, instead of a recipe")
    hf.add_argument("--hf-config", type=Path, metavar="DIR",
                    help="a folder holding config.json as save_pretrained writes it; inputs "
                         "input_ids and labels, the model's own loss first; random weights")
    hf.add_argument("--no-weights", action="store_true",
                    help="with --hf-config: build on the meta device and export weightless "
                         "(every parameter's name, dtype and shape, no data): plan any size; "
                         "`train` makes each stage's weights on its rank")
    hf.add_argument("--seq-len", type=int, default=DEFAULT_SEQ_LEN,
                    help="with --hf-config: the (static) sequence length")
    hf.add_argument("--hf-class", metavar="NAME",
                    help="with --hf-config: the transformers class (default: the config's "
                         "first architectures entry)")
    p.add_argument("-o", "--output", required=True, type=Path, help="ONNX file to write")
