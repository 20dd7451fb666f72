"""The gradient sums after a step's backward, and the whole model's gradient norm, for both
engines (ours: :mod:`onnx_partition.runtime.train.rank`; torch pipelining's:
:mod:`onnx_partition.runtime.train.torch_engine`).

A micro-batch's loss is its mean times its weight, so summing gradients over micro-batches and
replicas gives the gradient of the mean over the whole batch, as single-process training with
gradient accumulation does. Replicas of a stage all-reduce (sum) their gradients in their own
group; a tied parameter (``StageModule.tied``) is left out of that and summed instead over every
rank of every stage holding it (Megatron's embedding group), which counts each rank's
contribution exactly once. The norm counts each parameter once: replica 0's copy, a tied one on
the first stage holding it."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from onnx_partition.pipeline.layout import Layout
from onnx_partition.runtime.train.rank_io import StageLike

__all__ = ["all_reduce_grads", "clip_gradients", "owned_for_norm", "replica_group",
           "stage_ranks", "sum_gradients", "tied_groups", "tied_groups_here"]


def tied_groups(stages: Sequence[StageLike]) -> list[tuple[int, ...]]:
    """The distinct sets of stages sharing a parameter, sorted (one process group each)."""
    return sorted({tuple(sorted(s)) for st in stages for s in st.tied.values() if len(s) > 1})


def stage_ranks(lay: Layout, stage: int) -> list[int]:
    """The ranks of ``stage``'s replicas (consecutive)."""
    return list(range(lay.first[stage], lay.first[stage] + lay.replicas[stage]))


def replica_group(lay: Layout, stages: Sequence[int], mine: int) -> Any:
    """One group per stage with replicas (created on every rank); this rank's, or None."""
    own = None
    for s in stages:
        if lay.replicas[s] > 1:
            group = dist.new_group(ranks=stage_ranks(lay, s))
            if s == mine:
                own = group
    return own


def tied_groups_here(lay: Layout, stages: Sequence[StageLike],
                     k: int) -> list[tuple[Any, list[str]]]:
    """Create every tied group (on every rank); those of stage ``k``, each with the names of the
    parameters it sums."""
    mine = []
    for stage_set in tied_groups(stages):
        group = dist.new_group(ranks=[q for s in stage_set for q in stage_ranks(lay, s)])
        if k in stage_set:
            names = sorted(n for n, s in stages[k].tied.items() if tuple(sorted(s)) == stage_set)
            mine.append((group, names))
    return mine


def sum_gradients(params: Mapping[str, torch.nn.Parameter], tied: set[str], stage_group: Any,
                   tied_here: Sequence[tuple[Any, list[str]]]) -> None:
    """Sum gradients over the stage's replicas (tied parameters left out) and, per tied
    group, over every rank holding the parameter."""
    if stage_group is not None:
        all_reduce_grads([p for n, p in sorted(params.items()) if n not in tied], stage_group)
    for group, names in tied_here:
        all_reduce_grads([params[n] for n in names], group)


def all_reduce_grads(params: Sequence[torch.nn.Parameter], group: Any) -> None:
    """One flat all-reduce (sum) of the parameters' gradients (None counts as zeros)."""
    params = [p for p in params if p.requires_grad]
    if not params:
        return
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    for p, piece in zip(params, flat.split([g.numel() for g in grads])):
        p.grad = piece.view_as(p).clone()


def owned_for_norm(stages: Sequence[StageLike], k: int, replica: int,
                    params: Mapping[str, torch.nn.Parameter]) -> list[str]:
    """The parameters whose gradient this rank counts in the whole model's norm: replica 0's,
    a tied parameter only on the first stage holding it (after the gradient sums every
    replica and every holder has the same gradient)."""
    if replica != 0:
        return []
    tied = stages[k].tied
    return [n for n in sorted(params) if n not in tied or min(tied[n]) == k]


def clip_gradients(params: Mapping[str, torch.nn.Parameter], owned: Sequence[str],
                   max_norm: float | None, device: torch.device) -> float:
    """The whole model's gradient norm (squared norms all-reduced over every rank) and, with
    ``max_norm``, the gradients scaled as ``torch.nn.utils.clip_grad_norm_`` scales them."""
    sq = torch.zeros((), dtype=torch.float64, device=device)
    for n in owned:
        grad = params[n].grad
        if grad is not None:
            sq += grad.detach().double().pow(2).sum()
    dist.all_reduce(sq)
    norm = float(sq.sqrt())
    if max_norm is not None:
        coef = min(1.0, max_norm / (norm + 1e-6))
        for p in params.values():
            if p.grad is not None:
                p.grad.mul_(coef)
    return norm
