"""What every training rank and the single-process reference step with: the optimizer
(``torch.optim``'s SGD or AdamW with the command line's options) and the autocast context of a
mixed-precision run."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from typing import Any

import torch

from onnx_partition.errors import PartitionError
from onnx_partition.runtime.train.choices import OPTIMIZERS
from onnx_partition.settings.train import DEFAULTS, WEIGHT_DECAY

__all__ = ["autocast", "make_optimizer"]


def make_optimizer(name: str, params: Iterable[torch.nn.Parameter], lr: float, *,
                   weight_decay: float | None = None,
                   momentum: float = DEFAULTS.optimizer.momentum,
                   betas: tuple[float, float] = DEFAULTS.optimizer.betas,
                   shard_group: Any = None) -> torch.optim.Optimizer:
    """``sgd``: SGD (``momentum``, weight decay default 0); ``adamw``: AdamW (``betas``, eps
    1e-8, weight decay default 0.01): ``torch.optim``'s defaults where not given. With a
    ``shard_group`` (a stage's replicas, plan.json's ``shard`` ``optimizer``): the same
    optimizer as a ``ZeroRedundancyOptimizer`` over it, each replica holding and stepping
    its share of the state and broadcasting its updated parameters (ZeRO-1), packed in one
    bucket per replica (``parameters_as_bucket_view``: one broadcast each, not one a tensor)."""
    decay = WEIGHT_DECAY.get(name, 0.0) if weight_decay is None else weight_decay
    if shard_group is not None and name in OPTIMIZERS:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        options: dict[str, Any] = (
            {"momentum": momentum} if name == "sgd" else {"betas": betas})
        return ZeroRedundancyOptimizer(
            list(params), torch.optim.SGD if name == "sgd" else torch.optim.AdamW,
            process_group=shard_group, parameters_as_bucket_view=True, lr=lr,
            weight_decay=decay, **options)
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=momentum, weight_decay=decay)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr, betas=betas, weight_decay=decay)
    raise PartitionError(f"unknown optimizer {name!r}; choose one of {', '.join(OPTIMIZERS)}")


def autocast(device: torch.device, bf16: bool) -> contextlib.AbstractContextManager[object]:
    """bfloat16 autocast on ``device`` (CPU too) when ``bf16``, else nothing; the weights stay
    fp32 (the optimizer's master copy)."""
    if not bf16:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
