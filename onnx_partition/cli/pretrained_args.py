"""``train``'s options for weights in from, and out to, a Hugging Face ``save_pretrained``
folder (:mod:`onnx_partition.runtime.train.pretrained`), kept apart from :mod:`.args`."""

from __future__ import annotations

import argparse
from pathlib import Path

from onnx_partition.settings.train import DEFAULTS

__all__ = ["pretrained_args"]


def pretrained_args(p: argparse.ArgumentParser, rank: bool = False) -> None:
    """--from-pretrained (a torchrun rank too); --save-pretrained, --save-dtype and
    --hf-config (a local run's: replica 0's final weights come back to it)."""
    p.add_argument("--from-pretrained", type=Path, metavar="DIR",
                   help="start from the weights of DIR's model.safetensors (or the shards of "
                        "its model.safetensors.index.json), as save_pretrained writes them, by "
                        "the model's own parameter names; every name, shape and dtype is "
                        "checked before any rank starts")
    if rank:
        return
    p.add_argument("--save-pretrained", type=Path, metavar="DIR",
                   help="write the trained weights to DIR as save_pretrained does (safetensors "
                        "under the same names, tied duplicates dropped, sharded with an index "
                        "above 5 GB, config.json from --hf-config or --from-pretrained) so "
                        "from_pretrained(DIR) loads them")
    p.add_argument("--save-dtype", choices=("fp32", "bf16"), default=DEFAULTS.pretrained.dtype,
                   help="the dtype --save-pretrained writes float tensors in")
    p.add_argument("--hf-config", type=Path, metavar="DIR",
                   help="the folder whose config.json --save-pretrained writes beside the "
                        "weights (default: --from-pretrained's, when it has one)")
