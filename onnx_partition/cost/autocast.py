"""An autocast policy applied by hand, op by op, so a GPU's policy can be counted without a GPU.

``torch.autocast(device_type="cuda")`` is disabled where CUDA is not available, and autograd
cannot build the graph of a fake CUDA tensor there, so :mod:`onnx_partition.cost.saved` cannot
count what a GPU run under autocast saves by running it. What autocast does is simple enough to
apply in the FX interpreter instead: at each op of the program that autocast registers, cast the
floating tensor arguments (``torch/csrc/autocast_mode.h`` ``cached_cast``; the policies of
``aten/src/ATen/autocast_mode.cpp``):

* ``lower``: to the half dtype (matrix products, convolutions, ``linear``);
* ``fp32``: to float32 (softmax, log-softmax, layer norm, ``exp``, ``pow``, ``rsqrt``, the
  losses, ...);
* ``promote``: to the widest floating dtype among the arguments;

every other op runs on what it is given (type promotion only). A cast of a leaf that needs a
gradient (a weight) is made once per region and reused (autocast's cast cache), so a weight's
half copy is saved once per micro-batch. Casting is recorded by autograd as ``_to_copy``, which
saves nothing; the op then saves the cast tensors, exactly as under autocast.

The op lists are torch's own test lists of what each device's autocast casts
(``torch/testing/_internal/autocast_test_lists.py``: ``AutocastTestLists`` for CUDA,
``AutocastCPUTestLists`` for CPU; ``tests/test_autocast_policy.py`` checks ours contain theirs),
plus the losses autocast casts that those lists leave out. The CPU policy is here to check the
mechanism: counted by hand it must equal a real ``torch.autocast("cpu")`` run.

**Dropout on CUDA** (``fused_dropout``): ``aten.dropout`` on a CUDA tensor runs the fused
``native_dropout`` kernel, which saves a bool mask (1 byte an element); on CPU it multiplies by
a mask in the input's dtype. The CUDA policy runs ``native_dropout`` for it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

__all__ = ["CPU_POLICY", "CUDA_POLICY", "POLICIES", "PRECISIONS", "AutocastPolicy", "cast_call"]

#: The precisions a train plan is priced for (fp32, or autocast to a half dtype).
PRECISIONS = ("fp32", "bf16", "fp16")


@dataclass(frozen=True)
class AutocastPolicy:
    """The aten op names (overload packets) autocast casts, per cast rule, for one device."""

    device: str
    lower: frozenset[str]
    fp32: frozenset[str]
    promote: frozenset[str]
    fused_dropout: bool = False


_LOSSES_FP32 = ("cross_entropy_loss", "nll_loss_nd", "huber_loss")

#: CUDA (``AutocastTestLists``: torch_fp16, nn_fp16, linalg_fp16 lower; torch_fp32, nn_fp32
#: float32; torch_need_autocast_promote promote; and the fused attention kernels lower).
CUDA_POLICY = AutocastPolicy(
    "cuda",
    lower=frozenset({
        "_convolution", "addbmm", "addmm", "addmv", "addr", "baddbmm", "bmm", "chain_matmul",
        "conv1d", "conv2d", "conv3d", "conv_tbc", "conv_transpose1d", "conv_transpose2d",
        "conv_transpose3d", "convolution", "cudnn_convolution", "cudnn_convolution_transpose",
        "einsum", "gru_cell", "lstm_cell", "matmul", "mm", "mv", "prelu", "rnn_relu_cell",
        "rnn_tanh_cell", "_thnn_fused_lstm_cell", "_thnn_fused_gru_cell", "linear",
        "linalg_multi_dot", "linalg_vecdot", "scaled_dot_product_attention"}),
    fp32=frozenset({
        "acos", "asin", "binary_cross_entropy_with_logits", "cdist", "cosh",
        "cosine_embedding_loss", "cosine_similarity", "cumprod", "cumsum", "dist", "erfinv",
        "exp", "expm1", "group_norm", "hinge_embedding_loss", "kl_div", "layer_norm", "log",
        "log10", "log1p", "log2", "log_softmax", "logsumexp", "margin_ranking_loss", "norm",
        "pdist", "poisson_nll_loss", "pow", "prod", "reciprocal", "renorm", "rms_norm", "rsqrt",
        "sinh", "softmax", "sum", "tan", "triplet_margin_loss", "l1_loss", "mse_loss",
        "multi_margin_loss", "multilabel_margin_loss", "nll_loss", "nll_loss2d",
        "smooth_l1_loss", "soft_margin_loss", "softplus", *_LOSSES_FP32}),
    promote=frozenset({"addcdiv", "addcmul", "atan2", "bilinear", "cross", "dot",
                       "grid_sampler", "index_put", "scatter_add", "tensordot", "vdot", "cat",
                       "stack"}),
    fused_dropout=True,
)

#: CPU (``AutocastCPUTestLists``: torch_16, nn_16 lower; torch_fp32, nn_fp32 float32;
#: torch_need_autocast_promote promote).
CPU_POLICY = AutocastPolicy(
    "cpu",
    lower=frozenset({
        "_addmm_activation", "_native_multi_head_attention", "addbmm", "addmm", "baddbmm",
        "bmm", "conv1d", "conv2d", "conv3d", "conv_tbc", "conv_transpose1d", "conv_transpose2d",
        "conv_transpose3d", "matmul", "mm", "prelu", "linear", "scaled_dot_product_attention"}),
    fp32=frozenset({
        "binary_cross_entropy_with_logits", "cosine_embedding_loss", "hinge_embedding_loss",
        "margin_ranking_loss", "poisson_nll_loss", "triplet_margin_loss", "avg_pool3d",
        "binary_cross_entropy", "l1_loss", "mse_loss", "multi_margin_loss",
        "multilabel_margin_loss", "nll_loss", "nll_loss2d", "reflection_pad1d",
        "smooth_l1_loss", "soft_margin_loss", *_LOSSES_FP32}),
    promote=frozenset({"cat", "stack"}),
)

POLICIES = {"cpu": CPU_POLICY, "cuda": CUDA_POLICY}


def cast_call(policy: AutocastPolicy, half: torch.dtype,
              cache: dict[tuple[int, torch.dtype], torch.Tensor], target: Any,
              args: tuple[Any, ...], kwargs: dict[str, Any], call: Callable[..., Any]) -> Any:
    """``call(target, args, kwargs)`` as autocast to ``half`` under ``policy`` runs aten op
    ``target``: its floating tensor arguments cast by the op's rule (module docstring), a
    leaf's cast that needs a gradient taken from ``cache`` (one region: one cast per leaf)."""
    import torch
    from torch.utils._pytree import tree_map

    name = getattr(getattr(target, "overloadpacket", None), "__name__", None)
    if name is None:
        return call(target, args, kwargs)
    if name == "dropout" and policy.fused_dropout and len(args) >= 3 and args[2] \
            and 0.0 < float(args[1]) < 1.0 and args[0].numel() > 0:
        return torch.ops.aten.native_dropout.default(args[0], float(args[1]), True)[0]
    floats = [a for a in (*args, *kwargs.values())
              for a in (a if isinstance(a, (list, tuple)) else (a,))
              if isinstance(a, torch.Tensor) and a.dtype in (torch.float32, half)]
    if name in policy.lower:
        want = half
    elif name in policy.fp32:
        want = torch.float32
    elif name in policy.promote and floats:
        want = torch.float32 if any(a.dtype == torch.float32 for a in floats) else half
    else:
        return call(target, args, kwargs)

    def cast(value: Any) -> Any:
        if not isinstance(value, torch.Tensor) or value.dtype not in (torch.float32, half) \
                or value.dtype == want:
            return value
        if value.is_leaf and value.requires_grad:
            key = (id(value), want)  # the cache holds the leaf's cast, so its id is not reused
            if key not in cache:
                cache[key] = value.to(want)
            return cache[key]
        return value.to(want)

    return call(target, tree_map(cast, args), tree_map(cast, kwargs))
