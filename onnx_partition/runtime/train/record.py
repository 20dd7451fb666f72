"""``train --record FILE``: the measured per-stage forward and backward times of a run, in
plan.json's ``simulator_costs`` form, and the check that the file may be written."""

from __future__ import annotations

import json
from pathlib import Path

from onnx_partition.errors import PartitionError
from onnx_partition.fileio import atomic_write
from onnx_partition.plan.contracts import STAGE_COSTS_FORMAT
from onnx_partition.runtime.train.results import TrainStats

__all__ = ["RECORD_FORMAT", "check_record", "write_record"]


RECORD_FORMAT = STAGE_COSTS_FORMAT  # declared in plan.schema.StageCostsSchema


def check_record(path: Path) -> None:
    """``--record FILE`` may replace only an earlier record."""
    if path.exists():
        try:
            ours = json.loads(path.read_text()).get("format") == RECORD_FORMAT
        except (OSError, ValueError, AttributeError):
            ours = False
        if not ours:
            raise PartitionError(f"--record {path}: the file exists and is not an earlier "
                                 f"record ({RECORD_FORMAT}); choose another name")


def write_record(path: Path, stats: TrainStats, rows: int, device: str) -> None:
    """The measured per-stage times (per micro-batch of ``rows`` rows on one replica) in the
    ``simulator_costs`` form that plan.json accepts (``onnx_partition.pipeline.from_plan``), written
    atomically; the body is checked against its schema
    (:class:`~onnx_partition.plan.schema.StageCostsSchema`) first."""
    from onnx_partition.plan.schema import validate_stage_costs

    body = {"format": RECORD_FORMAT, "unit": "ms", "device": device,
            "rows_per_microbatch": rows, "microbatches": stats.microbatches,
            "schedule": stats.schedule, "measured_iteration_ms": stats.measured_ms,
            "simulator_costs": {"forward_ms": stats.forward_ms,
                                "backward_ms": stats.backward_ms}}
    validate_stage_costs(body, f"--record {path}")
    atomic_write(path, json.dumps(body, indent=1) + "\n")
