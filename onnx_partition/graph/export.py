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
A model whose weights go to ``model.onnx.data`` has them written once: the program keeps meta
tensors in their place and reads them back from there (:mod:`onnx_partition.graph.program`).
See docs/design.md, "Training: FX mapping, relay, tied weights".

Hugging Face models are exported as they are: a module whose output is a mapping (a
``ModelOutput``), a nested tuple or holds ``None`` is exported through a view of it that returns
the flat tuple of its tensors, named by their keys (``loss``, ``logits``; ``hidden_states.0`` in
nested ones), with the original parameter names; keyword inputs (``labels``) are named after
their keys. A model whose ``config.use_cache`` is on is exported with it off (one note on
stderr): a key/value cache is neither a trainable output nor a tensor. (The module is not named
``export``: a submodule of that name would shadow the function ``onnx_partition.export``.)
"""

from __future__ import annotations

import contextlib
import inspect
import io
import json
import logging
import os
import re
import sys
import warnings
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import onnx
import onnx_ir as ir
import torch

from onnx_partition.errors import PartitionError, one_line
from onnx_partition.fileio import atomic_path
from onnx_partition.graph.program import held_tensors, save_program
from onnx_partition.graph.weightless import (
    ORIGIN_KEY,
    WEIGHTS_KEY,
    mark_model,
    weightless_tensor,
)

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
    kwargs: Mapping[str, torch.Tensor] | None = None,
    weights: str | None = None,
    origin: Mapping[str, Any] | None = None,
) -> Path:
    """Export ``module`` called on ``args`` to the ONNX file ``path`` and its train-mode program
    to ``path.with_suffix(".pt2")``; weights go to ``<path>.data`` above 100 MB, and then only
    there (load the program with :func:`onnx_partition.graph.program.load_program`).

    ``dynamic_batch`` makes dim 0 of every tensor input symbolic (named ``batch``; trace with
    at least 2 rows). The module's train/eval mode is restored afterwards. Both files are
    written into a temporary folder beside ``path`` under their final names, then moved with
    `os.replace` (data file first, program last). ``external_data`` forces weights out of (True)
    or into (False) the ONNX file. Raises :class:`PartitionError` when the module
    does not export. ``kwargs``: keyword tensor inputs after ``args`` (``labels`` of a Hugging
    Face model, which then returns its own loss first); a model returning a mapping or nested
    outputs is exported with its outputs flattened to named tensors (module docstring).

    A module on ``torch.device("meta")`` (example inputs real or meta) exports weightless
    (:mod:`onnx_partition.graph.weightless`): every parameter and buffer keeps its name, dtype
    and shape and no data, in the ONNX file and in the program. ``weights="random"`` records
    that a module with data holds random weights (built from a config); ``origin`` (JSON) where
    the model came from (``{"hf": {"class": ..., "config": {...}}}``), so a plan can
    make its weights later.
    """
    path = Path(path)
    if path.suffix == PROGRAM_SUFFIX:
        raise PartitionError(f"the ONNX path {path} must not end in {PROGRAM_SUFFIX}")
    if weights not in (None, "random"):
        raise PartitionError(f"weights={weights!r}: only 'random' is recorded (a module on "
                             "meta is weightless by itself)")
    args = tuple(args)
    if is_meta(module):  # floating inputs meet the weights on meta; indices stay as given
        args = _on_meta(args)
        kwargs = dict(zip(kwargs or {}, _on_meta(tuple((kwargs or {}).values())), strict=True))
    path.parent.mkdir(parents=True, exist_ok=True)
    # the program is published last: inner blocks exit first (the ONNX file's .data, then it)
    with (_no_cache(module), atomic_path(program_path(path)) as staged_program,
          atomic_path(path) as staged):
        was_training = module.training
        target: torch.nn.Module = module
        out = _probe(module, args, kwargs or {})
        if kwargs or not _is_flat(out):
            target = _FlatOutputs(module, args, dict(kwargs or {}), out)
            input_names = list(input_names) if input_names is not None else target.input_names
            output_names = (list(output_names) if output_names is not None
                            else target.output_names)
            args = (*args, *(kwargs or {}).values())
        args = _unaliased(args)
        module.train()
        try:
            with quiet():
                program = _export_program(target, args, input_names, output_names,
                                          dynamic_batch=dynamic_batch, opset=opset)
                _serve_in_eval_mode(program.model)
                if external_data is None:
                    external_data = weight_bytes(module) > EXTERNAL_DATA_BYTES
                held = held_tensors(program.model) if external_data else {}
                _save_onnx(program, staged, external_data=external_data,
                           weights=weights, origin=origin)
                save_program(program.exported_program, staged_program, held, staged)
        finally:
            module.train(was_training)
        sidecars = [p for p in staged.parent.iterdir() if p != staged]
    stale = path.with_name(path.name + ".data")
    if not sidecars and stale.exists():
        stale.unlink()  # left by an earlier export of this path with external data
    return path


def _save_onnx(program: Any, path: Path, *, external_data: bool, weights: str | None,
               origin: Mapping[str, Any] | None) -> None:
    """Write the exported model: initializers holding meta tensors as weightless ones (name,
    dtype, shape, no data), and the weights' kind and origin in the model's metadata."""
    model: ir.Model = program.model
    empty = []
    for value in model.graph.initializers.values():
        tensor = value.const_value
        raw = getattr(tensor, "raw", None)
        if tensor is not None and isinstance(raw, torch.Tensor) and raw.is_meta:
            empty.append(weightless_tensor(value.name or "", raw.shape, int(tensor.dtype)))
            value.const_value = None
    if not empty:
        if weights is not None:
            model.metadata_props[WEIGHTS_KEY] = weights
        if origin is not None:
            model.metadata_props[ORIGIN_KEY] = json.dumps(origin, sort_keys=True,
                                                          allow_nan=False)
        program.save(path, external_data=external_data)
        return
    with _quiet_serde():
        proto = ir.serde.serialize_model(model)
    proto.graph.initializer.extend(empty)
    mark_model(proto, "none", origin)
    onnx.save_model(proto, str(path))


@contextlib.contextmanager
def _quiet_serde() -> Iterator[None]:
    """onnx_ir warns for each initializer without a value (the weightless ones)."""
    logger = logging.getLogger("onnx_ir.serde")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


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
    dynamic: Any = (tuple({0: batch} if isinstance(a, torch.Tensor) and a.dim() >= 1 else None
                     for a in args) if dynamic_batch else None)
    if dynamic is not None and isinstance(module, _FlatOutputs):
        dynamic = (dynamic,)  # the shapes of its one ``*values`` parameter
    try:
        return torch.onnx.export(
            module, args, None,
            input_names=list(input_names) if input_names is not None else None,
            output_names=list(output_names) if output_names is not None else None,
            opset_version=opset, dynamo=True, optimize=False, dynamic_shapes=dynamic,
            verbose=False,
        )
    except Exception as exc:  # the exporters raise many types; report one line
        name = type(getattr(module, "inner", module)).__name__
        raise PartitionError(f"cannot export {name}: {_cause(exc)}") from None


_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def _cause(exc: BaseException) -> str:
    """The innermost cause of an exporter's error as one line without terminal colour codes
    (the exporter's own message only says which of its steps failed)."""
    seen = {id(exc)}
    while True:
        inner = exc.__cause__ or exc.__context__
        if inner is None or id(inner) in seen:
            break
        seen.add(id(inner))
        exc = inner
    return _ANSI.sub("", one_line(exc))


@contextlib.contextmanager
def _no_cache(module: torch.nn.Module) -> Iterator[None]:
    """``config.use_cache`` off while exporting (a Hugging Face model's key/value cache is no
    tensor output), with a one-line note; restored afterwards."""
    config = getattr(module, "config", None)
    if not getattr(config, "use_cache", False):
        yield
        return
    print(f"note: exporting {type(module).__name__} with use_cache=False (a key/value cache is "
          "not a trainable output)", file=sys.stderr)
    config.use_cache = False  # type: ignore[union-attr]
    try:
        yield
    finally:
        config.use_cache = True  # type: ignore[union-attr]


def _unaliased(args: tuple[Any, ...]) -> tuple[Any, ...]:
    """``args`` with a tensor given twice (``labels=ids``) copied: the tracer takes one tensor
    object for one input, so both inputs would read the first."""
    seen: set[int] = set()
    out = []
    for a in args:
        if isinstance(a, torch.Tensor):
            a = a.clone() if id(a) in seen else a
            seen.add(id(a))
        out.append(a)
    return tuple(out)


def _probe(module: torch.nn.Module, args: tuple[Any, ...],
           kwargs: Mapping[str, torch.Tensor]) -> Any:
    """The module's output on the example inputs: one eval-mode forward without gradients
    (no batch-norm update, no dropout draw)."""
    was_training = module.training
    module.eval()
    try:
        with torch.no_grad(), quiet(), _fake_if_meta(module, args, kwargs):
            return module(*args, **kwargs)
    except Exception as exc:
        raise PartitionError(f"cannot run {type(module).__name__} on the example inputs: "
                             f"{_cause(exc)}") from None
    finally:
        module.train(was_training)


def is_meta(module: torch.nn.Module) -> bool:
    """Some parameter or buffer of ``module`` lives on ``torch.device("meta")``."""
    return any(t.is_meta for t in (*module.parameters(), *module.buffers()))


def _fake_if_meta(module: torch.nn.Module, args: tuple[Any, ...],
                  kwargs: Mapping[str, torch.Tensor]) -> contextlib.AbstractContextManager[Any]:
    """A meta module (or meta inputs) runs under a FakeTensorMode: meta tensors have no
    values, so eager code that reads one (``.item()``, a data-dependent branch) would fail,
    while fake tensors let such code see it is being traced."""
    tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
    if not is_meta(module) and not any(t.is_meta for t in tensors):
        return contextlib.nullcontext()
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode(allow_non_fake_inputs=True)


def _on_meta(values: tuple[Any, ...]) -> tuple[Any, ...]:
    """Floating inputs of a weightless module on meta (a real one would meet meta weights);
    integer ones (token ids, labels) as given, so what the program makes from them keeps
    their device."""
    return tuple(v.to("meta") if isinstance(v, torch.Tensor) and v.is_floating_point() else v
                 for v in values)


def _is_flat(out: Any) -> bool:
    """A tensor or a flat tuple of tensors: exported as it is."""
    return isinstance(out, torch.Tensor) or (
        isinstance(out, tuple | list) and all(isinstance(o, torch.Tensor) for o in out))


def _flatten(prefix: str, value: Any) -> list[tuple[str, Any]]:
    """(name, leaf) of every tensor in ``value``: mapping keys and tuple positions joined with
    dots, ``None`` left out; any other leaf kept for :class:`_FlatOutputs` to refuse."""
    def join(key: object) -> str:
        return f"{prefix}.{key}" if prefix else str(key)
    if value is None:
        return []
    if isinstance(value, Mapping):
        return [item for key, v in value.items() for item in _flatten(join(key), v)]
    if isinstance(value, tuple | list):
        return [item for i, v in enumerate(value) for item in _flatten(join(i), v)]
    return [(prefix or "output", value)]


class _FlatOutputs(torch.nn.Module):
    """``module`` seen as ``forward(*args, *kwargs values) -> flat tuple of tensors``. It shares
    the module's submodules, parameters and buffers (not a child), so the exported names are
    the module's own."""

    inner: torch.nn.Module

    def __init__(self, module: torch.nn.Module, args: tuple[Any, ...],
                 kwargs: dict[str, torch.Tensor], out: Any) -> None:
        super().__init__()
        self.__dict__["inner"] = module
        self._modules = module._modules
        self._parameters = module._parameters
        self._buffers = module._buffers
        self._non_persistent_buffers_set = module._non_persistent_buffers_set
        self.keys = list(kwargs)
        try:
            params = list(inspect.signature(module.forward).parameters)
        except (TypeError, ValueError):
            params = []
        self.input_names = [params[i] if i < len(params) else f"input_{i}"
                            for i in range(len(args))] + self.keys
        leaves = _flatten("", out)
        for name, leaf in leaves:
            if not isinstance(leaf, torch.Tensor):
                raise PartitionError(f"output {name!r} of {type(module).__name__} is a "
                                     f"{type(leaf).__name__}, not a tensor: return tensors only")
        self.output_names = [name for name, _ in leaves]

    def forward(self, *values: Any) -> tuple[torch.Tensor, ...]:
        split = len(values) - len(self.keys)
        out = self.inner(*values[:split], **dict(zip(self.keys, values[split:], strict=True)))
        return tuple(leaf for _, leaf in _flatten("", out))


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
