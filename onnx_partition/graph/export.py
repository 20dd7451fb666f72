"""Export a torch module to ONNX and keep its exported program beside it (``model.pt2``).

One export serves both paths. The module is traced in **train mode** with the dynamo exporter
(``torch.onnx.export(..., dynamo=True, optimize=False)``), so every ONNX node's
``pkg.torch.onnx.fx_node`` tag names a node of the train-mode program that is saved with
``torch.export.save`` as ``path.with_suffix(".pt2")``: the map from ONNX nodes to FX nodes is the
identity on names, and training runs that very program. The ONNX file is then made to serve as
the eval-mode model: each ``Dropout`` loses its ``training_mode`` input (inference: identity);
batch norm is already exported as an inference ``BatchNormalization`` over the running statistics.
``optimize=False`` keeps every initializer equal to one parameter or buffer, named after it, and
every FX node's ONNX nodes apart (the optimizer fuses Conv with BatchNorm under one tag).
See docs/design.md, "Training: FX mapping, relay, tied weights". (The module is not named
``export``: a submodule of that name would shadow the function ``onnx_partition.export``.)
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import onnx_ir as ir
import torch

from onnx_partition.errors import PartitionError, one_line
from onnx_partition.fileio import atomic_path

__all__ = ["BATCH", "EXTERNAL_DATA_BYTES", "PROGRAM_SUFFIX", "export", "program_path", "quiet",
           "weight_bytes"]

#: Name of the symbolic batch dimension (``dim_param``) in the exported model.
BATCH = "batch"
#: Models with more weight bytes than this keep their weights in ``<path>.data``.
EXTERNAL_DATA_BYTES = 100 * 2**20
#: Suffix of the exported program saved beside the ONNX file.
PROGRAM_SUFFIX = ".pt2"
_QUIET_LOGGERS = ("torch.onnx", "torch.export", "torch._export", "onnxscript", "onnx_ir")


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """Silence the exporters' warnings, log records and Python-level prints."""
    loggers = [logging.getLogger(name) for name in _QUIET_LOGGERS]
    levels = [logger.level for logger in loggers]
    sink = io.StringIO()
    try:
        for logger in loggers:
            logger.setLevel(logging.ERROR)
        with (
            warnings.catch_warnings(),
            contextlib.redirect_stdout(sink),
            contextlib.redirect_stderr(sink),
        ):
            warnings.simplefilter("ignore")
            yield
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)


def weight_bytes(module: torch.nn.Module) -> int:
    tensors = [*module.parameters(), *module.buffers()]
    return sum(t.numel() * t.element_size() for t in tensors)


def program_path(model: str | os.PathLike[str]) -> Path:
    """Where the exported program of the ONNX file ``model`` lies."""
    return Path(model).with_suffix(PROGRAM_SUFFIX)


def export(
    module: torch.nn.Module,
    args: tuple[Any, ...],
    path: str | os.PathLike[str],
    *,
    input_names: Sequence[str] | None = None,
    output_names: Sequence[str] | None = None,
    dynamic_batch: bool = True,
    opset: int | None = None,
    external_data: bool | None = None,
) -> Path:
    """Export ``module`` called on ``args`` to the ONNX file ``path`` and its train-mode program
    to ``path.with_suffix(".pt2")``; weights go to ``<path>.data`` above 100 MB.

    ``dynamic_batch`` makes dim 0 of every tensor input symbolic (named ``batch``; trace with
    at least 2 rows). The module's train/eval mode is restored afterwards. Both files are
    written into a temporary folder beside ``path`` under their final names, then moved with
    `os.replace` (data file first, program last). ``external_data`` forces weights out of (True)
    or into (False) the ONNX file. Raises :class:`PartitionError` when the module
    does not export.
    """
    path = Path(path)
    if path.suffix == PROGRAM_SUFFIX:
        raise PartitionError(f"the ONNX path {path} must not end in {PROGRAM_SUFFIX}")
    args = tuple(args)
    path.parent.mkdir(parents=True, exist_ok=True)
    # the program is published last: inner blocks exit first (the ONNX file's .data, then it)
    with atomic_path(program_path(path)) as staged_program, atomic_path(path) as staged:
        was_training = module.training
        module.train()
        try:
            with quiet():
                program = _export_program(module, args, input_names, output_names,
                                          dynamic_batch=dynamic_batch, opset=opset)
                _serve_in_eval_mode(program.model)
                if external_data is None:
                    external_data = weight_bytes(module) > EXTERNAL_DATA_BYTES
                program.save(staged, external_data=external_data)
                torch.export.save(program.exported_program, staged_program)
        finally:
            module.train(was_training)
        sidecars = [p for p in staged.parent.iterdir() if p != staged]
    stale = path.with_name(path.name + ".data")
    if not sidecars and stale.exists():
        stale.unlink()  # left by an earlier export of this path with external data
    return path


def _export_program(
    module: torch.nn.Module,
    args: tuple[Any, ...],
    input_names: Sequence[str] | None,
    output_names: Sequence[str] | None,
    *,
    dynamic_batch: bool,
    opset: int | None,
) -> Any:
    batch = torch.export.Dim(BATCH)
    dynamic = (tuple({0: batch} if isinstance(a, torch.Tensor) and a.dim() >= 1 else None
                     for a in args) if dynamic_batch else None)
    try:
        return torch.onnx.export(
            module, args, None,
            input_names=list(input_names) if input_names is not None else None,
            output_names=list(output_names) if output_names is not None else None,
            opset_version=opset, dynamo=True, optimize=False, dynamic_shapes=dynamic,
            verbose=False,
        )
    except Exception as exc:  # the exporters raise many types; report one line
        first = one_line(exc)
        raise PartitionError(f"cannot export {type(module).__name__}: {first}") from None


def _serve_in_eval_mode(model: ir.Model) -> None:
    """Drop the ``training_mode`` input of every Dropout (and its Constant when unused): a
    Dropout without it is the identity at inference, as ``module.eval()`` is."""
    for node in list(ir.traversal.RecursiveGraphIterator(model.graph)):
        if node.op_type != "Dropout" or node.domain not in ("", "ai.onnx") or len(node.inputs) < 3:
            continue
        flag = node.inputs[2]
        node.replace_input_with(2, None)
        producer = flag.producer() if flag is not None else None
        if producer is not None and producer.op_type == "Constant" and not flag.uses():  # type: ignore[union-attr]
            graph = producer.graph
            if graph is not None:
                graph.remove(producer, safe=True)
