"""Run a plan folder: stage sessions per device, pipelined execution."""

from onnx_partition.errors import StageFailed
from onnx_partition.runtime.pipeline import PipelineSession, RunStats

__all__ = ["PipelineSession", "RunStats", "StageFailed"]
