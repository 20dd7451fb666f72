"""Run a plan folder: stage sessions per device, pipelined execution."""

from onnx_partition.runtime.pipeline import PipelineSession, RunStats, StageFailed

__all__ = ["PipelineSession", "RunStats", "StageFailed"]
