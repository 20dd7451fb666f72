"""``profile --plan``: a written plan calibrated on its own stages (:mod:`.recut`: stage files
timed in onnxruntime, re-priced, re-cut; :mod:`.stage_modules`: a train plan's stage modules
timed alone, side by side and in the engine)."""

from onnx_partition.calibrate.recut import calibrate_plan

__all__ = ["calibrate_plan"]
