"""Alias kept for ``python -m onnx_partition.train.runtime PLAN`` (a torchrun rank of ``train``:
:func:`onnx_partition.cli.torchrun.train_main`) and
``from onnx_partition.train.runtime import train_plan``; the code lives in
:mod:`onnx_partition.runtime.train.trainer`."""

from __future__ import annotations

import sys

from onnx_partition.runtime.train.trainer import train_plan

__all__ = ["train_plan"]

if __name__ == "__main__":
    from onnx_partition.cli.torchrun import train_main

    sys.exit(train_main())
