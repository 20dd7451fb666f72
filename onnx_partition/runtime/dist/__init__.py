"""Process machinery shared by the inference and training runtimes: :mod:`.launcher` (start and
supervise local ranks), :mod:`.lifeline` (a rank notices its parent is gone), :mod:`.wire`
(tensors between ranks), :mod:`.torchrun` (a rank under torchrun)."""

__all__ = ["launcher", "lifeline", "torchrun", "wire"]
