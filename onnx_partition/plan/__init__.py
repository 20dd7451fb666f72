"""The plan contract: what ``partition`` writes and every other verb reads.

:mod:`.contracts` (the fields, defaults and format strings of every JSON contract, declared
once), :mod:`.schema` (their pydantic schemas: plan.json, cluster.json, costs.json, the run and
stage-costs files), :mod:`.planfile` (:class:`Plan` and plan.json), :mod:`.folder` (a plan
folder: manifest, lock, atomic publish, verification). The names of :mod:`.planfile` are the
package's own.
"""

from onnx_partition.plan.planfile import (
    DEFAULT_MICROBATCHES,
    FORMAT,
    MANIFEST,
    PLAN_FILE,
    REPORT_FILE,
    IOSpec,
    Plan,
    Predicted,
    Stage,
    plan_text,
    read_plan,
    write_plan,
)

__all__ = ["DEFAULT_MICROBATCHES", "FORMAT", "MANIFEST", "PLAN_FILE", "REPORT_FILE", "IOSpec",
           "Plan", "Predicted", "Stage", "plan_text", "read_plan", "write_plan"]
