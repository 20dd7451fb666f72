"""The ONNX adapter: the only package that reads or writes ONNX protos.

:mod:`.load` (a model file as an :class:`OpGraph`), :mod:`.protos` (proto helpers),
:mod:`.fxtag` (FX unit tags the exporter leaves on nodes), :mod:`.emit` (stage files),
:mod:`.export` (a torch module to ONNX plus its train-mode program). The names of :mod:`.load`
are the package's own.
"""

from onnx_partition.graph.load import (
    NONDETERMINISTIC,
    Node,
    OpGraph,
    TensorInfo,
    from_model,
    load,
    node_keys,
)

__all__ = ["NONDETERMINISTIC", "Node", "OpGraph", "TensorInfo", "from_model", "load", "node_keys"]
