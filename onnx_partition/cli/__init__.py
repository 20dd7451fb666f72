"""The command line: :mod:`.args` (the parser, one function per verb's options),
:mod:`.verbs` (``main`` and the verbs) and :mod:`.torchrun` (one rank of ``run`` or ``train``
under torchrun); the console script is :func:`main`."""

from onnx_partition.cli.verbs import main

__all__ = ["main"]
