"""Scaled dot-product attention counted as the fused kernel a device runs, also on ``meta``.

``aten.scaled_dot_product_attention`` picks its kernel by device. On CPU and CUDA a training
call goes to a fused kernel (``_scaled_dot_product_flash_attention_for_cpu``; flash or
memory-efficient attention on CUDA) that saves the query, key, value, output and the rows'
log-sum-exp, never the ``heads x seq x seq`` scores. On the ``meta`` device (a weightless
model's parameters, :mod:`onnx_partition.graph.weightless`) no fused kernel is chosen and the
math fallback runs: a matrix product, a softmax and a second product, whose probabilities are
saved and whose gradients are held in backward. At Llama-3's 8,192 tokens that is 2.1 GB per
head group of 8 heads per layer, counted where no device would hold it.

:func:`device_attention` runs what CPU's dispatcher runs (torch's
``aten/src/ATen/native/transformers/attention.cpp``): a boolean mask turned into an additive
one (``where(mask, 0, -inf)``), grouped key/value heads repeated under ``enable_gqa``, then the
CPU flash kernel, which has a meta implementation, and its backward. The counter of saved bytes
(:mod:`onnx_partition.cost.saved`) calls it in place of the op on meta tensors, so a weightless
model counts what its real CPU run, and a GPU's fused kernel, saves.
"""

from __future__ import annotations

from typing import Any

__all__ = ["device_attention", "meta_attention"]


def meta_attention(target: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """``target`` is ``aten.scaled_dot_product_attention`` and reads a tensor on ``meta``."""
    import torch
    from torch.utils._pytree import tree_leaves

    return (target is torch.ops.aten.scaled_dot_product_attention.default
            and any(isinstance(t, torch.Tensor) and t.is_meta
                    for t in tree_leaves((args, kwargs))))


def device_attention(query: Any, key: Any, value: Any, attn_mask: Any = None,
                     dropout_p: float = 0.0, is_causal: bool = False, *,
                     scale: float | None = None, enable_gqa: bool = False) -> Any:
    """``scaled_dot_product_attention(...)`` as CPU's fused kernel computes it (the module
    docstring): the same output, the same tensors saved for backward."""
    import torch

    if enable_gqa and key.shape[-3] != query.shape[-3]:
        groups = query.shape[-3] // key.shape[-3]
        key = key.repeat_interleave(groups, dim=-3)
        value = value.repeat_interleave(groups, dim=-3)
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        zero = torch.zeros((), dtype=query.dtype, device=query.device)
        ninf = torch.full((), float("-inf"), dtype=query.dtype, device=query.device)
        attn_mask = torch.where(attn_mask, zero, ninf)
    elif attn_mask is not None and attn_mask.dtype != query.dtype:
        attn_mask = attn_mask.to(query.dtype)
    out = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default(
        query, key, value, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)
    return out[0]
