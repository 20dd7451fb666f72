"""Reading a checkpoint's rank files in tests (safetensors, keyed as
:mod:`onnx_partition.runtime.train.checkpoint_state` writes them)."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

from onnx_partition.runtime.train.checkpoint import rank_file


def rank_tensors(folder: Path, rank: int) -> dict[str, torch.Tensor]:
    """Every tensor of rank ``rank``'s file."""
    return load_file(str(rank_file(folder, rank)))


def rank_params(folder: Path, rank: int) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s parameters and buffers (``module/`` keys), by name."""
    return {k[len("module/"):]: v for k, v in rank_tensors(folder, rank).items()
            if k.startswith("module/")}
