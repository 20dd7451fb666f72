"""An inference rank's measured memory (runtime/infer/resident.py): /proc/self/status read in
bytes, and the resident growth over a span seeing a buffer the span wrote."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from onnx_partition.runtime.infer.resident import ResidentPeak, reset_peak, status_bytes


def test_status_fields_read_in_bytes(tmp_path: Path) -> None:
    status = tmp_path / "status"
    status.write_text("Name:\tpython\nVmHWM:\t  2048 kB\nVmRSS:\t1024 kB\nVmBad:\tx kB\n")
    assert status_bytes("VmHWM", status) == 2048 * 1024
    assert status_bytes("VmRSS", status) == 1024 * 1024
    assert status_bytes("VmBad", status) is None and status_bytes("VmSwap", status) is None
    assert status_bytes("VmHWM", tmp_path / "none") is None
    assert not reset_peak(tmp_path / "no" / "clear_refs")


def test_the_growth_sees_what_the_span_made_resident() -> None:
    peak = ResidentPeak.start()
    if peak.start_bytes is None:
        pytest.skip("this kernel does not let a process reset its peak resident set")
    size = 64 * 2**20
    buffer = np.ones(size, dtype=np.uint8)  # every page written: resident
    grown, resident = peak.reading()
    del buffer
    assert grown is not None and resident is not None
    assert size <= grown <= size + 16 * 2**20 and resident >= grown
