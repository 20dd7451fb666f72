"""Per-node costs measured with onnxruntime on the real device, written as costs.json.

Method:

1. **Signatures.** Nodes are grouped by signature: domain, op type, opset, attributes, input and
   output dtypes and concrete shapes, and which inputs are initializers (``init``), outputs of
   constant-only nodes (``const``) or computed values (``flow``); small initializers add their
   values. Only one node per signature is measured, so a transformer's repeated layers cost one
   layer's profiling. Signature times are cached on disk (``cache_dir``, default
   ``$ONNX_PARTITION_CACHE`` or ``~/.cache/onnx-partition/profiles``), keyed by signature, device,
   onnxruntime version, threads and method.
2. **Measurement.** The nodes still to measure go into one *signature model*: each node once, its
   real initializers (external data resolved from the model's folder), copies of the constant
   nodes it needs, and its computed inputs as graph inputs (random floats of the right shape;
   integer, boolean and unknown-shape values captured from one run of the whole model).
   On CPU the model is profiled (``enable_profiling``) with the runtime's optimizations, so that
   rewrites of single nodes that the real run also makes (NCHWc Conv, constant folding) count;
   nothing can fuse across nodes there, and events map back to keys by name or output name.
   Each node's shortest ``<key>_kernel_time`` over the repeats is taken (events are wall-clock;
   other processes only ever stretch them). On CUDA the
   profiler sees only host time around asynchronous launches, so each signature is timed by wall
   clock with IOBinding instead: ``(T(K copies) - T(1 copy)) / (K - 1)``, which cancels the fixed
   cost of a run (optimizations off, so that the copies are not merged). ``method="whole"``
   profiles the whole model with optimizations off (fusions rename nodes) and shares times
   between identical signatures (also the fallback when the signature model cannot be built).
3. **Calibration.** The profiler adds its own few microseconds to every event, which swamps tiny
   operators (a 4-element Add shows 5 us and really costs 0.5 us). So a node's weight is its
   event time minus the profiler's time per event (that of one-element Add probes profiled
   alongside), plus what a tiny node really costs unprofiled (the time difference of
   two Add chains of different lengths, per node). Nodes with no measurement get their analytic
   (roofline) cost as weight. The weights are then scaled to sum to the median *unprofiled*
   whole-model time, measured with the runtime's own session options (on one CPU thread as
   thread CPU time, which other processes on a shared machine do not inflate).

Each measuring phase repeats ``repeats`` times but stops early after a time budget once a few
runs are in (large models); ``settings`` records the runs made.

Modules, by role: :mod:`.signatures` (operator signatures), :mod:`.sigmodel` (the signature
model), :mod:`.cpu` (CPU event timing), :mod:`.cuda` (CUDA timing), :mod:`.measure` (which of
them runs, and the whole-model time), :mod:`.calibrate` (the signature cost model), :mod:`.cache`
(the on-disk cache), :mod:`.harness` (the measuring context and its settings) and :mod:`.api`
(the entry points re-exported here). ``profile --mode train`` is :mod:`.train`: each torch op's
forward and backward in torch eager on the exported program (imported on its own: torch).
"""

from __future__ import annotations

from onnx_partition.cost.profile.api import (
    ProfileResult,
    parse_device,
    profile_model,
    profile_to_file,
    save_profile,
)
from onnx_partition.cost.profile.cache import CACHE_ENV
from onnx_partition.cost.profile.harness import Progress, input_feeds

__all__ = [
    "CACHE_ENV",
    "ProfileResult",
    "Progress",
    "input_feeds",
    "parse_device",
    "profile_model",
    "profile_to_file",
    "save_profile",
]
