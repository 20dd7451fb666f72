"""The rank's memory tracker (:mod:`onnx_partition.runtime.memtrack`): on CPU every live
tensor storage counted once, from its creation to its free, in forward and backward alike;
VmHWM read from /proc."""

from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np
import pytest
import torch

from onnx_partition.runtime.memtrack import StorageTracker, resident_bytes, tracking
from onnx_partition.runtime.train.rank_io import RankResult
from onnx_partition.runtime.train.results import _stage_max


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


def test_storages_made_outside_the_ops_are_counted_at_first_use() -> None:
    """``torch.from_numpy`` (the data's rows: numpy made the storage, torch's ``lift_fresh``
    view is the only op to see it) and a tensor made before tracking started are no op's
    outputs; the tracker counts their storages when an op first reads them."""
    before = torch.ones(125_000)  # 500,000 bytes, made before the tracker
    with StorageTracker() as tracker:
        base = tracker.live
        rows = torch.from_numpy(np.ones((500, 500), dtype=np.float32))  # 1,000,000 bytes
        assert tracker.live - base == 1_000_000
        doubled = rows[10:] * 2  # read through a view: the storage is counted once
        assert tracker.live - base == 1_000_000 + doubled.untyped_storage().nbytes()
        before.add_(1)  # an in-place op counts its input too
        assert tracker.live - base == 1_500_000 + doubled.untyped_storage().nbytes()
        del rows, doubled
        assert tracker.live - base == 500_000  # freed: released
        del before
        assert tracker.live == base


def _malloc_in_use() -> int | None:
    """glibc's bytes handed out and not freed (``mallinfo2``: ``uordblks + hblkhd``), None
    where there is no glibc 2.33+."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        info = libc.mallinfo2
    except (OSError, AttributeError):
        return None

    class Info(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
            "uordblks", "fordblks", "keepcost")]

    info.restype = Info
    got = info()
    return int(got.uordblks + got.hblkhd)


@pytest.mark.skipif(_malloc_in_use() is None, reason="needs glibc's mallinfo2")
def test_growth_agrees_with_what_malloc_holds() -> None:
    """Micro-batches held as GPipe holds them (each one's graph and saved tensors, its rows
    from numpy as data files give them): the tracker's growth from few to many is malloc's
    growth in live bytes, within 10% (an under-count of live storages shows; freed memory
    glibc keeps resident does not count here, see docs/benchmarks.md)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.GELU(),
                                torch.nn.Linear(256, 256))
    rng = np.random.default_rng(0)

    def hold(count: int) -> tuple[int, int]:
        with tracking(torch.device("cpu"), model.parameters()) as memory:
            start = _malloc_in_use() or 0
            held = [model(torch.from_numpy(rng.standard_normal((128, 256), dtype=np.float32)))
                    .square().mean() for _ in range(count)]
            grown = (_malloc_in_use() or 0) - start
            peak = memory().peak_bytes
            for loss in held:
                loss.backward()
        return peak, grown

    hold(2)  # torch's first-use allocations (kernels, thread pools) out of the figures
    few, many = hold(2), hold(12)
    tracked, malloc = many[0] - few[0], many[1] - few[1]
    assert 0.9 * malloc <= tracked <= 1.1 * malloc, (tracked, malloc)


def test_a_stage_reports_its_highest_replica() -> None:
    """``memory_bytes``, ``resident_bytes`` and ``reserved_bytes`` per stage are the maximum
    over the stage's replicas (a rank without the figure is skipped; a stage with none: None)."""
    def rank(stage: int, peak: int | None, resident: int | None) -> RankResult:
        got = RankResult(0, stage, 0, [], 0, [], [], [], [])
        got.memory_bytes, got.resident_bytes = peak, resident
        return got

    ranks = [rank(0, 5, 50), rank(0, 9, 40), rank(1, 7, None), rank(1, None, 30),
             rank(2, None, None)]
    assert _stage_max(ranks, 3, "memory_bytes") == [9, 7, None]
    assert _stage_max(ranks, 3, "resident_bytes") == [50, 30, None]
    assert _stage_max(ranks, 3, "reserved_bytes") == [None, None, None]


def test_a_stopped_tracking_keeps_its_peak_and_counts_no_more() -> None:
    """``Tracking.stop`` takes the CPU tracker's mode off the dispatch: a 4 MB tensor made
    before it is in the peak, a 40 MB one made after is not, and the reading stays."""
    with tracking(torch.device("cpu")) as memory:
        kept = torch.ones(1024, 1024)  # 4 MiB
        memory.stop()
        later = torch.ones(10 * 1024, 1024)  # 40 MiB, not tracked
        reading = memory()
    assert reading.peak_bytes == kept.untyped_storage().nbytes()
    assert memory().peak_bytes == reading.peak_bytes and later.numel()


def test_timed_steps_follow_the_tracked_ones() -> None:
    """Memory is measured over the first two steps; a longer run times only the steps after
    them, a shorter one all but its first (warm-up), one step itself."""
    from onnx_partition.runtime.train.overheads import TRACKED_STEPS, timed_from

    assert TRACKED_STEPS == 2
    assert [timed_from(n) for n in (1, 2, 3, 6)] == [0, 1, 2, 2]
