"""Alias kept for ``python -m onnx_partition.runtime.distributed PLAN`` (a torchrun rank of
``run``: :func:`onnx_partition.cli.torchrun.infer_main`) and
``from onnx_partition.runtime.distributed import run_distributed``; the code lives in
:mod:`onnx_partition.runtime.infer.processes`."""

from __future__ import annotations

import sys

from onnx_partition.runtime.infer.processes import run_distributed

__all__ = ["run_distributed"]

if __name__ == "__main__":
    from onnx_partition.cli.torchrun import infer_main

    sys.exit(infer_main())
