"""Process machinery shared by the inference and training runtimes: :mod:`.ranks` (start and
supervise local ranks; the rules a rank under torchrun shares), :mod:`.lifeline` (a rank notices
its parent is gone), :mod:`.hooks` (the ranks' fault seam). Tensors between ranks:
:mod:`onnx_partition.runtime.wire`."""

__all__ = ["hooks", "lifeline", "ranks"]
