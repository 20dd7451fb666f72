"""Per-node costs: :mod:`.annotate` (costs.json or the analytic model, per node),
:mod:`.analytic` (the roofline), :mod:`.devices` (GPU datasheets, the measured CPU),
:mod:`.cluster` (devices, links, cluster.json), :mod:`.costs_file` (a costs file's provenance
checks), :mod:`.saved` (bytes autograd saves for backward, per FX unit), :mod:`.engine_price`
(the training engine's own work priced) and :mod:`.profile` (measuring on the device;
:mod:`.profile.torch_ops`: torch eager forward and backward per op; :mod:`.profile.engine`: the
engine's work measured). Names are used from those modules.
"""

__all__ = ["analytic", "annotate", "cluster", "costs_file", "devices", "engine_price", "profile",
           "saved"]
