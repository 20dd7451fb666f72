"""The weights of a weightless plan, made where they are used.

A plan exported with ``--no-weights`` (plan.json ``"weights": "none"``) has stage modules whose
parameters and buffers are meta tensors. :func:`materialize` gives each of them a value on
the rank's device, a function of ``(seed, name)`` alone: the CPU generator, seeded from
``sha256(seed, name)``, draws it after the model's own initialisation rules (a Hugging Face
model's ``_init_weights`` applied to the module owning the tensor, that module alone
materialised, then put back on meta), and the value moves to the device. So every rank makes
only its own stage, a tied copy is the same on every stage holding it, and ``train --check``'s
single-process reference makes the same weights on any device. Without an origin (a module
exported on meta through the Python API), or for a tensor the model's rules leave alone:
normal(0, 0.02) for a matrix, ones for a vector named
``weight``, zeros otherwise.
"""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Mapping
from typing import Any

import torch

from onnx_partition.plan import Plan

__all__ = ["fill_program", "materialize", "seed_of"]

_STD = 0.02


def seed_of(seed: int, name: str) -> int:
    """The generator seed of tensor ``name`` under run seed ``seed`` (stable everywhere)."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def materialize(module: torch.nn.Module, device: torch.device, plan: Plan,
                seed: int) -> torch.nn.Module:
    """``module`` on ``device``, its meta tensors made there (module docstring); a plan
    with weights is only moved."""
    meta = [(name, t) for name, t in _tensors(module) if t.is_meta]
    if not meta:
        return module.to(device)
    model = _model(json.dumps(plan.origin, sort_keys=True)) if plan.origin else None
    for name, old in meta:
        *path, leaf = name.split(".")
        owner = module.get_submodule(".".join(path)) if path else module
        value = _make(model, name, old, device, seed)
        if leaf in owner._parameters:
            owner._parameters[leaf] = torch.nn.Parameter(value, requires_grad=old.requires_grad)
        else:
            owner._buffers[leaf] = value
    return module.to(device)


def fill_program(program: Any, plan: Plan, known: Mapping[str, torch.Tensor],
                 seed: int) -> dict[str, torch.Tensor]:
    """Give every meta tensor of the exported ``program`` a value on the CPU, in place: the
    trained one in ``known``, else (a buffer outside the state dict, such as a rotary table)
    the one :func:`materialize` makes. Returns the values made, by name."""
    model = _model(json.dumps(plan.origin, sort_keys=True)) if plan.origin else None
    made: dict[str, torch.Tensor] = {}
    for table in (program.state_dict, program.constants):
        for name, old in list(table.items()):
            if not isinstance(old, torch.Tensor) or not old.is_meta:
                continue
            value = known.get(name)
            if value is None:
                value = made[name] = _make(model, name, old, torch.device("cpu"), seed)
            value = value.detach().to(old.dtype).clone()
            table[name] = (torch.nn.Parameter(value, requires_grad=old.requires_grad)
                           if isinstance(old, torch.nn.Parameter) else value)
    return made


def _tensors(module: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [*module.named_parameters(), *module.named_buffers()]


@functools.lru_cache(maxsize=2)
def _model(origin: str) -> Any:
    """The origin's model on meta (built once per process and origin)."""
    from onnx_partition.models.hf import build_on_meta

    return build_on_meta(json.loads(origin))


def _make(model: Any, name: str, like: torch.Tensor, device: torch.device,
          seed: int) -> torch.Tensor:
    """Tensor ``name`` (shape and dtype of ``like``) on ``device``, drawn from its seed by the
    CPU generator (a GPU's draws differ from the CPU's: this way every device, and the CPU
    reference of ``--check``, gets the same values), one owner at a time."""
    cpu = torch.device("cpu")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed_of(seed, name))
        owned = _by_model(model, name, cpu) if model is not None else None
        value = (owned.to(like.dtype) if owned is not None and owned.shape == like.shape
                 else _default(name, like, cpu))
    return value.to(device)


def _by_model(model: Any, name: str, device: torch.device) -> torch.Tensor | None:
    """The value the model's own ``_init_weights`` gives ``name``, or None where the model has
    no such tensor or no such rule."""
    path, _, leaf = name.rpartition(".")
    try:
        owner = model.get_submodule(path) if path else model
    except AttributeError:
        return None
    here: Mapping[str, Any] = {**owner._parameters, **owner._buffers}
    if here.get(leaf) is None or not hasattr(model, "_init_weights"):
        return None
    owner.to_empty(device=device, recurse=False)
    try:
        for key, tensor in _direct(owner):  # what the rules leave alone is still defined
            with torch.no_grad():
                tensor.copy_(_default(key, tensor, device))
        with torch.no_grad():
            model._init_weights(owner)
        return getattr(owner, leaf).detach().clone()
    finally:
        owner.to_empty(device="meta", recurse=False)


def _direct(owner: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [(k, t) for k, t in (*owner._parameters.items(), *owner._buffers.items())
            if t is not None]


def _default(name: str, like: torch.Tensor, device: torch.device) -> torch.Tensor:
    """normal(0, 0.02) for a matrix, ones for a vector named ``weight``, zeros otherwise."""
    out = torch.empty(like.shape, dtype=like.dtype, device=device)
    if not (out.is_floating_point() or out.is_complex()):
        return out.zero_()
    if out.dim() >= 2:
        return out.normal_(0.0, _STD)
    return out.fill_(1.0 if name.rsplit(".", 1)[-1] == "weight" else 0.0)
