"""The command line: :mod:`.args` (the parser, one function per verb's options) and
:mod:`.verbs` (``main`` and the verbs); the console script is :func:`main`."""

from onnx_partition.cli.verbs import main

__all__ = ["main"]
