"""A training rank's state as data: its stage's tensors keyed by the model's own parameter names,
written as safetensors and read back by any plan of the same model (:mod:`checkpoint` lays out
the folder and its manifest).

Keys of a rank's file (``rank-NNNNN.safetensors``)::

    module/NAME          a parameter or buffer of the stage (state_dict names: the model's own)
    optim/NAME/KEY       the optimizer's state of parameter NAME (AdamW: step, exp_avg,
                         exp_avg_sq; SGD: momentum_buffer)
    rng/cpu, rng/cuda    this rank's RNG states (uint8 tensors)

Only a stage's first replica writes ``module/`` and ``optim/`` (its replicas hold the same
values); every rank writes its RNG states. A rank that resumes reads, from whichever files the
manifest's index names, only the tensors of its own stage (``safe_open``), so the stage cut,
the replica counts and the number of stages may differ from the plan that wrote it. The RNG
states come back only on the same plan (rank ``r`` is then the same stage replica); on another
plan each rank's generator is seeded from its own seed and the step (dropout masks differ from
an uninterrupted run's; without dropout nothing does).

Checkpoints of format 1 (one ``torch.save`` pickle per rank) load only through
``torch.load(weights_only=True)``: tensors, numbers, strings and containers of them; a file
holding anything else is refused before any rank starts (:func:`check_legacy_file`), and
nothing in it runs.
"""

from __future__ import annotations

import json
import pickle
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from onnx_partition.errors import PartitionError
from onnx_partition.safe_tensors import read_tensors, save_tensors

__all__ = ["MODULE", "OPTIM", "check_legacy_file", "load_legacy_rank", "load_rank_state",
           "save_rank_state"]

MODULE, OPTIM, RNG = "module/", "optim/", "rng/"


def save_rank_state(path: Path, module: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    device: torch.device, *, first_replica: bool,
                    state: Mapping[str, Any] | None = None) -> None:
    """This rank's file (the module docstring's keys) at ``path``; ``state``: the optimizer's
    state dict when not its own (a sharded optimizer's, consolidated on the first replica)."""
    out: dict[str, torch.Tensor] = {}
    if first_replica:
        out.update({MODULE + n: t for n, t in module.state_dict().items()})
        names = list(dict(module.named_parameters()))
        whole = state if state is not None else optimizer.state_dict()
        for index, held in whole["state"].items():
            for key, value in held.items():
                if value is None:
                    continue
                if not isinstance(value, torch.Tensor):
                    value = torch.tensor(value, dtype=torch.float64)
                out[f"{OPTIM}{names[index]}/{key}"] = value
    out[RNG + "cpu"] = torch.get_rng_state()
    if device.type == "cuda":
        out[RNG + "cuda"] = torch.cuda.get_rng_state(device)
    save_tensors(path, out)


def load_rank_state(folder: Path, rank: int, module: torch.nn.Module,
                    optimizer: torch.optim.Optimizer, device: torch.device, *,
                    same_plan: bool) -> None:
    """This rank's parameters, buffers and optimizer state from a format-2 checkpoint, by
    name, from whichever files hold them; the RNG states when ``same_plan``."""
    manifest = json.loads((folder / "manifest.json").read_text())
    index: Mapping[str, Mapping[str, Any]] = manifest["tensors"]
    names = list(dict(module.named_parameters()))
    wanted = [MODULE + n for n in module.state_dict()]
    missing = [k[len(MODULE):] for k in wanted if k not in index]
    if missing:
        raise PartitionError(f"--resume {folder}: holds no {missing[0]!r} (another model)")
    body, own = _optimizer_frame(optimizer, names)
    wanted += [k for k in index if k.startswith(OPTIM)
               and k[len(OPTIM):].rsplit("/", 1)[0] in own]
    by_file: dict[str, list[str]] = {}
    for key in wanted:
        by_file.setdefault(str(index[key]["file"]), []).append(key)
    got: dict[str, torch.Tensor] = {}
    for file, keys in by_file.items():
        got.update(read_tensors(folder / file, keys, f"--resume {folder / file}"))
    module.load_state_dict({k[len(MODULE):]: v for k, v in got.items() if k.startswith(MODULE)})
    position = {n: i for i, n in enumerate(names)}
    state: dict[int, dict[str, torch.Tensor]] = {}
    for key, value in got.items():
        if key.startswith(OPTIM):
            name, what = key[len(OPTIM):].rsplit("/", 1)
            state.setdefault(position[name], {})[what] = value
    body["state"] = state
    optimizer.load_state_dict(body)
    if same_plan:
        rng = read_tensors(folder / f"rank-{rank:05d}.safetensors", None,
                           f"--resume {folder}")
        torch.set_rng_state(rng[RNG + "cpu"])
        if device.type == "cuda" and RNG + "cuda" in rng:
            torch.cuda.set_rng_state(rng[RNG + "cuda"], device)
    else:
        torch.manual_seed(torch.initial_seed() + 7919 * int(manifest["step"]))


def _optimizer_frame(optimizer: torch.optim.Optimizer, names: list[str]
                     ) -> tuple[dict[str, Any], set[str]]:
    """The state dict ``optimizer`` loads (its parameter groups, as ``state_dict`` numbers
    them; the state to fill in) and the parameters whose state this rank keeps: all of them,
    or a ``ZeroRedundancyOptimizer``'s own shard, so a sharded rank reads only its 1/r of the
    state (never the whole, which is what sharding saves)."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    ordered = [p for group in optimizer.param_groups for p in group["params"]]
    number = {id(p): i for i, p in enumerate(ordered)}
    groups = [{**{k: v for k, v in group.items() if k != "params"},
               "params": [number[id(p)] for p in group["params"]]}
              for group in optimizer.param_groups]
    if not isinstance(optimizer, ZeroRedundancyOptimizer):
        return {"state": {}, "param_groups": groups}, set(names)
    local = [p for group in optimizer.optim.param_groups for p in group["params"]]
    return {"state": {}, "param_groups": groups}, {names[number[id(p)]] for p in local}


def check_legacy_file(path: Path) -> None:
    """A format-1 rank file loads as data (``weights_only=True``) with the keys it had; a
    PartitionError naming the file otherwise (and nothing in it ran)."""
    _legacy(path)


def _legacy(path: Path) -> dict[str, Any]:
    how = ("only tensors, numbers and strings load; a file written by onnx-partition's format 1 "
           "holds only those, so this one was changed: resume from a checkpoint you wrote, or "
           "re-save its tensors with safetensors where you trust the file")
    try:
        saved = torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, OSError, AttributeError,
            ValueError, TypeError, ImportError) as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:160]
        raise PartitionError(f"--resume {path}: refused, not plain data ({first}); "
                             f"{how}") from None
    if not isinstance(saved, dict) or not {"module", "optimizer", "rng"} <= set(saved):
        raise PartitionError(f"--resume {path}: not a rank file of format 1 (needs module, "
                             f"optimizer and rng); {how}")
    return saved


def load_legacy_rank(path: Path, module: torch.nn.Module, optimizer: torch.optim.Optimizer,
                     device: torch.device) -> None:
    """A format-1 rank file (its own plan), read as data, its RNG state kept on the CPU."""
    saved = _legacy(path)
    module.load_state_dict(saved["module"])
    optimizer.load_state_dict(saved["optimizer"])
    torch.set_rng_state(saved["rng"].cpu())
    if device.type == "cuda" and saved.get("cuda_rng") is not None:
        torch.cuda.set_rng_state(saved["cuda_rng"].cpu(), device)
