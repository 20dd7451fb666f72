"""Per-node costs: :mod:`.annotate` (costs.json or the analytic model, per node),
:mod:`.analytic` (the roofline, over the counts of :mod:`.op_counts`, an ONNX operator's FLOPs
and bytes, and :mod:`.aten_backward`, an aten op's backward), :mod:`.devices` (GPU datasheets,
the measured CPU), :mod:`.cluster` (devices, links, cluster.json), :mod:`.costs_file` (a costs
file's provenance checks), :mod:`.saved` (bytes autograd saves for backward, per FX unit),
:mod:`.engine_price` (the training engine's own work priced) and :mod:`.profile` (measuring on
the device; :mod:`.profile.torch_ops`: torch eager forward and backward per op;
:mod:`.profile.engine`: the engine's work measured). Names are used from those modules.
"""

__all__ = ["analytic", "annotate", "aten_backward", "cluster", "costs_file", "counting",
           "devices", "engine_price", "op_counts", "profile", "saved"]
