"""The rank's memory tracker (:mod:`onnx_partition.runtime.memtrack`): on CPU every live
tensor storage counted once, from its creation to its free, in forward and backward alike;
VmHWM read from /proc."""

from __future__ import annotations

from pathlib import Path

import torch

from onnx_partition.runtime.memtrack import StorageTracker, resident_bytes, tracking


def test_a_known_allocation_is_counted_once_and_released() -> None:
    with StorageTracker() as tracker:
        base = tracker.live
        big = torch.empty(250_000, dtype=torch.float32)  # 1,000,000 bytes
        view = big.view(500, 500)[1:]  # a view: the same storage, counted once
        assert tracker.live - base == 1_000_000
        assert tracker.peak >= base + 1_000_000
        del big
        assert tracker.live - base == 1_000_000  # the view still holds it
        del view
        assert tracker.live == base  # freed: live returns
        assert tracker.peak >= base + 1_000_000  # the peak stays


def test_backward_and_adopted_parameters_are_counted() -> None:
    layer = torch.nn.Linear(512, 512)
    weights = sum(p.untyped_storage().nbytes() for p in layer.parameters())
    x = torch.randn(64, 512, requires_grad=True)
    with tracking(torch.device("cpu"), layer.parameters()) as memory:
        layer(x).square().sum().backward()
        grads = sum(p.grad.untyped_storage().nbytes() for p in layer.parameters()
                    if p.grad is not None)
        reading = memory()
    assert grads == weights  # the gradients, made by backward inside the tracker
    # parameters and their gradients live together at the end; the output and x's gradient
    # (64 x 512 floats each) lived at once during backward
    assert reading.peak_bytes >= 2 * weights + 2 * 64 * 512 * 4
    assert reading.reserved_bytes is None


def test_resident_bytes_reads_vmhwm(tmp_path: Path) -> None:
    status = tmp_path / "status"
    status.write_text("Name:\tpython\nVmPeak:\t  999 kB\nVmHWM:\t  2048 kB\n")
    assert resident_bytes(status) == 2048 * 1024
    assert resident_bytes(tmp_path / "missing") is None
    status.write_text("Name:\tpython\n")
    assert resident_bytes(status) is None
    if Path("/proc/self/status").exists():
        got = resident_bytes()
        assert got is not None and got > 10_000_000  # torch is loaded
