"""``--check``'s comparison: a tolerance of the dtype's precision (and of TF32 math) relative
to each tensor's own scale, or an absolute allowance for a tensor that is rounding around zero.
A reference perturbed by rounding (a few ulps, summation order) is not flagged in any float
dtype; a real error (a lost micro-batch, one wrong element) is."""

from __future__ import annotations

import pytest
import torch

from onnx_partition.runtime.train.reference import check_tolerance, mismatch

DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16]


def _gradient(dtype: torch.dtype) -> torch.Tensor:
    """A gradient-like tensor: a wide range of magnitudes, some elements near zero."""
    gen = torch.Generator().manual_seed(0)
    return (torch.randn(64, 32, generator=gen, dtype=torch.float64)
            * torch.logspace(-6, 0, 32, dtype=torch.float64)).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rounding_is_not_flagged(dtype: torch.dtype) -> None:
    want = _gradient(dtype)
    gen = torch.Generator().manual_seed(1)
    eps = torch.finfo(dtype).eps
    # every element moved by up to 4 ulps of the tensor's largest element (summation order)
    noise = torch.rand(want.shape, generator=gen, dtype=torch.float64) * 2 - 1
    scale = float(want.abs().max())
    got = (want.to(torch.float64) + noise * 4 * eps * scale).to(dtype)
    assert mismatch(got, want) is None
    if dtype in (torch.float16, torch.bfloat16):  # the old elementwise check flags it
        assert not torch.allclose(got.float(), want.float(), rtol=1e-4, atol=1e-6)
    assert mismatch(want.clone(), want) is None


@pytest.mark.parametrize("dtype", DTYPES)
def test_real_errors_are_flagged(dtype: torch.dtype) -> None:
    want = _gradient(dtype)
    lost = (want.to(torch.float64) * 3 / 4).to(dtype)  # one of four micro-batches lost
    off = mismatch(lost, want)
    assert off is not None and off == pytest.approx(0.25, rel=0.05)
    wrong = want.clone()
    top = int(want.abs().argmax())
    wrong.view(-1)[top] = -wrong.view(-1)[top]  # one element with the wrong sign
    assert mismatch(wrong, want) == pytest.approx(2.0, rel=0.01)
    # a gradient that is zero in exact arithmetic (a key bias's, under softmax) and rounding
    # as computed: within the allowance its own rounding earns, beyond its own scale
    noise = torch.full((4,), 1e-12)
    assert mismatch(noise, torch.zeros(4), allowance=1e-11) is None
    assert mismatch(noise, torch.zeros(4)) == float("inf")
    assert mismatch(noise * 100, torch.zeros(4), allowance=1e-11) == float("inf")
    # an allowance of the rounding level does not hide a real error of a real tensor
    assert mismatch(lost, want, allowance=1e-3 * float(want.abs().max())) is not None
    zero = torch.zeros_like(want)
    assert mismatch(zero, zero) is None
    assert mismatch(want, zero) == float("inf")


def test_tolerance_follows_the_precision() -> None:
    assert check_tolerance(torch.float32) == pytest.approx(72 * 2.0 ** -23)
    assert check_tolerance(torch.bfloat16) == pytest.approx(8 * 2.0 ** -7 + 64 * 2.0 ** -23)
    assert check_tolerance(torch.float64) < 1e-13
    # a float32 error of 1e-5 of the scale: rounding for bfloat16, a mismatch for float32
    want = torch.ones(4)
    got = want + torch.tensor([1e-5, 0, 0, 0])
    assert mismatch(got, want) is not None
    assert mismatch(got.bfloat16(), want.bfloat16()) is None
    # TF32 math: ROUNDING_ULPS of its 10-bit mantissa more; rounding there, a lost
    # micro-batch still flagged
    assert check_tolerance(torch.float32, "tf32") == pytest.approx(
        72 * 2.0 ** -23 + 8 * 2.0 ** -10)
    assert check_tolerance(torch.bfloat16, "tf32") == check_tolerance(torch.bfloat16)
    tf32 = want + torch.tensor([3e-3, 0, 0, 0])
    assert mismatch(tf32, want) is not None and mismatch(tf32, want, math="tf32") is None
    assert mismatch(want * 0.75, want, math="tf32") is not None
