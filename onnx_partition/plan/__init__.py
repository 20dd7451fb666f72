"""The plan contract: what ``partition`` writes and every other verb reads.

:mod:`.contracts` and :mod:`.extras` (every JSON contract declared once, as the dataclasses the
code uses: plan.json with each extra typed, cluster.json, costs.json, the run and stage-costs
files; :mod:`.declare` the markers they carry), :mod:`.schema` (their check, pydantic loaded when
a file is first read), :mod:`.planfile` (:class:`Plan` and plan.json; :mod:`.legacy` the old dict
of the extras), :mod:`.folder` (a plan folder: manifest, lock, atomic publish, verification). The
names of :mod:`.planfile` are the package's own.
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
