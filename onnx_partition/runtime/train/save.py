"""Trained weights back into a plan: a new plan folder that ``onnx-partition run`` serves.

The dynamo exporter names each initializer after the parameter or buffer it holds (its
fully-qualified name; ``optimize=False`` keeps them one-to-one), so the stage modules' state,
keyed by those names, replaces the initializers of the same names in every stage file. The
folder also gets the trained whole model (``<model>.onnx``, the plan's ``model``, which
``run --check`` compares against) and the trained program (``<model>.pt2``, so the new plan can
be trained further; where the model keeps its weights in external data, the program refers
to them there, as ``export`` writes it, so the folder holds them once). Tied parameters are
written under each of their names. Everything is written into a temporary folder that then
replaces ``out_dir`` (emit.write_plan_folder).
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import torch
from onnx import numpy_helper

from onnx_partition.errors import PartitionError
from onnx_partition.fileio import sha256_file
from onnx_partition.graph.emit import save_stage, write_plan_folder
from onnx_partition.graph.program import TORCH_DTYPES, save_program, tensor_key
from onnx_partition.plan import write_plan
from onnx_partition.runtime.train.modules import load_program, program_names, require_trainable
from onnx_partition.runtime.train.weightless import fill_program
from onnx_partition.settings.train import DEFAULTS

__all__ = ["save_trained"]


def save_trained(
    plan_dir: str | Path,
    state: Sequence[Mapping[str, torch.Tensor]],
    out_dir: str | Path,
    *,
    force: bool = False,
    seed: int = DEFAULTS.seed,
) -> Path:
    """A new plan folder ``out_dir`` whose stage files carry the trained initializers
    (``state[k]`` = stage k's ``module.state_dict()`` after training), with the trained whole
    model and program; servable by ``onnx-partition run``. Returns ``out_dir``. ``seed``: the
    run's, for a weightless plan's buffers that no state dict holds."""
    plan_dir, out_dir = Path(plan_dir), Path(out_dir)
    plan = require_trainable(plan_dir)
    if len(state) != len(plan.stages):
        raise PartitionError(f"save_trained got {len(state)} stage states for "
                             f"{len(plan.stages)} stages")
    if out_dir.resolve() == plan_dir.resolve():
        raise PartitionError(f"save_trained writes a new plan folder, not over {plan_dir}")
    values = _by_original_name(plan_dir, state)
    model = (plan_dir / plan.model).resolve()
    program = load_program(plan_dir, plan)

    def write(folder: Path) -> None:
        new = copy.deepcopy(plan)
        with warnings.catch_warnings():  # deepcopy of a program warns about pytree internals
            warnings.simplefilter("ignore", FutureWarning)
            trained = copy.deepcopy(program)
        _tie_like(program, trained)
        # a weightless plan: its meta tensors take the trained values, buffers outside the
        # state dict (a rotary table) the ones its ranks made
        values.update(fill_program(trained, plan, values, seed))
        if new.weights == "none":
            new.weights = "data"
        for stage in new.stages:
            proto = onnx.load(str(plan_dir / stage.file), load_external_data=False)
            _replace(proto, values)
            stage.sha256 = save_stage(proto, folder / stage.file, plan_dir, check=False)
        whole = onnx.load(str(model), load_external_data=False)
        external = any(t.data_location == onnx.TensorProto.EXTERNAL
                       for t in whole.graph.initializer)
        if not _replace(whole, values):
            raise PartitionError("no initializer of the model is named after a trained "
                                 "parameter: was it exported by onnx_partition.export?")
        save_stage(whole, folder / model.name, model.parent, check=False)
        with torch.no_grad():
            for name, tensor in trained.state_dict.items():
                if name in values:
                    tensor.copy_(values[name])
        program_file = folder / Path(plan.program).name
        if external:  # the model's weights lie in external data: once, as export writes them
            save_program(trained, program_file, _held(trained, whole, values), folder / model.name)
        else:
            torch.export.save(trained, program_file)
        new.model, new.program = model.name, program_file.name
        new.program_sha256 = sha256_file(program_file)
        new.trained_from = str(plan_dir.resolve())
        write_plan(new, folder)

    write_plan_folder(out_dir, write, force=force)
    return out_dir


def _by_original_name(
    plan_dir: Path, state: Sequence[Mapping[str, torch.Tensor]]
) -> dict[str, torch.Tensor]:
    """Every original parameter/buffer name -> its trained value (first stage holding it)."""
    aliases = program_names(plan_dir)
    values: dict[str, torch.Tensor] = {}
    for stage_state in state:
        for name, tensor in stage_state.items():
            for original in aliases.get(name, [name]):
                values.setdefault(original, tensor.detach().cpu())
    return values


def _tie_like(program: torch.export.ExportedProgram,
              trained: torch.export.ExportedProgram) -> None:
    """Share storage in ``trained`` where ``program`` does (tied weights): ``deepcopy`` copies
    each parameter object apart, which would save a tied weight twice and untie it."""
    groups: dict[tuple[Any, ...], list[str]] = {}
    for name, tensor in program.state_dict.items():
        if isinstance(tensor, torch.Tensor) and not tensor.is_meta:
            groups.setdefault(tensor_key(tensor), []).append(name)
    for first, *rest in groups.values():
        for name in rest:
            trained.state_dict[name] = trained.state_dict[first]


def _held(program: torch.export.ExportedProgram, whole: onnx.ModelProto,
          values: Mapping[str, torch.Tensor]) -> dict[tuple[Any, ...], str]:
    """The program tensors whose trained bytes the whole model's initializers of the same name
    and dtype now hold (:func:`_replace` wrote ``values`` there), in the form of
    :func:`~onnx_partition.graph.program.held_tensors`, for ``save_program``."""
    dtypes = {t.name: TORCH_DTYPES.get(t.data_type) for t in whole.graph.initializer}
    held: dict[tuple[Any, ...], str] = {}
    for name, tensor in program.state_dict.items():
        if (name in values and dtypes.get(name) == tensor.dtype and not tensor.is_meta
                and tensor.is_contiguous()):
            held.setdefault(tensor_key(tensor), name)
    return held


def _replace(model: onnx.ModelProto, values: Mapping[str, torch.Tensor]) -> int:
    """Overwrite the initializers named in ``values`` in place (inline data); how many."""
    count = 0
    for tensor in model.graph.initializer:
        if tensor.name not in values:
            continue
        array = values[tensor.name].numpy()
        old = onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type)
        if tuple(tensor.dims) != array.shape:
            raise PartitionError(f"trained {tensor.name!r} has shape {list(array.shape)}, the "
                                 f"initializer {list(tensor.dims)}")
        tensor.CopyFrom(numpy_helper.from_array(np.require(array.astype(old), requirements="C"),
                                                tensor.name))
        count += 1
    return count
