"""The runtimes: :mod:`.infer` (serving a plan: threads or one process per stage replica),
:mod:`.train` (training a train plan), both on :mod:`.launch` (launching and supervising
ranks) and :mod:`.wire` (tensors between them). ``PipelineSession`` and ``RunStats`` are
imported on first use, so a training rank or a launcher does not load onnxruntime's pipeline
for them."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from onnx_partition.errors import StageFailed

if TYPE_CHECKING:
    from onnx_partition.runtime.infer.pipeline import PipelineSession, RunStats

__all__ = ["PipelineSession", "RunStats", "StageFailed"]


def __getattr__(name: str) -> Any:
    if name in ("PipelineSession", "RunStats"):
        from onnx_partition.runtime.infer import pipeline

        return getattr(pipeline, name)
    raise AttributeError(f"module 'onnx_partition.runtime' has no attribute {name!r}")
