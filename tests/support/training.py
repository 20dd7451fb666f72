"""Checks of the training path shared by the recipe and Hugging Face tests: stage modules
against the whole module, and a plan trained with ``--check``."""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from onnx_partition.partition import partition
from onnx_partition.plan import read_plan
from onnx_partition.request.train import resolve_job, train_job
from onnx_partition.runtime.launch.hooks import RankHook
from onnx_partition.runtime.train.data_plan import plan_job, synthetic_batch
from onnx_partition.runtime.train.modules import StageModule, stage_modules, whole_module
from onnx_partition.runtime.train.rank_io import RankRun
from onnx_partition.runtime.train.task import TrainTask, task_for
from onnx_partition.runtime.train.trainer import train_plan

Tensors = dict[str, torch.Tensor]

__all__ = ["OutputLoss", "assert_stages_equal_whole", "assert_stages_run_on_meta", "chain_stages",
           "own_loss_job", "own_loss_task", "rank_run", "train_checked"]


def rank_run(*, check_steps: tuple[int, ...] = (), hook: RankHook | None = None,
             **keywords: object) -> RankRun:
    """What every rank runs for ``train_plan``'s ``keywords``, resolved as for a plan that
    records no choices (train's fallbacks: SGD, fp32, 1F1B), with ``check_steps`` and ``hook``:
    the engine driven without ``train_plan``'s checks."""
    job, _ = resolve_job(train_job(**keywords), None)
    return RankRun(job, check_steps=check_steps, hook=hook)


@dataclass(frozen=True)
class OutputLoss:
    """The loss a model computes itself: its output ``name`` (a scalar), targets unused. A
    dataclass of this module, so it pickles to the ranks by reference."""

    name: str

    def __call__(self, outputs: Mapping[str, torch.Tensor],
                 targets: Mapping[str, torch.Tensor]) -> torch.Tensor:
        return outputs[self.name]


def own_loss_task(plan_dir: Path) -> TrainTask:
    """The plan's synthetic batches, trained on the model's first output (its own loss)."""
    make = task_for(plan_dir).make_batch

    def inputs_only(rows: int, generator: torch.Generator) -> tuple[Tensors, Tensors]:
        return make(rows, generator)[0], {}  # the labels are an input

    return TrainTask(OutputLoss(read_plan(plan_dir).outputs[0].name), inputs_only,
                     kind="output")


def own_loss_job(plan_dir: str, rows: int, seed: int, deterministic: bool):  # type: ignore[no-untyped-def]
    """:func:`plan_job` with the model's own loss (a launch ``Build``)."""
    stages, _, plan, _, _ = plan_job(plan_dir, rows, seed, deterministic)
    task = own_loss_task(Path(plan_dir))
    return (stages, task.loss_fn, plan,
            functools.partial(synthetic_batch, task.make_batch, rows, seed), None)


def chain_stages(stages: list[StageModule],
                 feeds: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Run the stages one after another, each reading its inputs by name from all before it."""
    env = dict(feeds)
    for stage in stages:
        outputs = stage.module(*[env[name] for name in stage.inputs])
        assert isinstance(outputs, tuple) and len(outputs) == len(stage.outputs)
        env.update(zip(stage.outputs, outputs, strict=True))
    return env


def assert_stages_equal_whole(plan_dir: Path, rows: int = 3, seed: int = 0,
                              task: TrainTask | None = None) -> None:
    """Chained stages == whole module: outputs, loss (``task``'s, default the plan's), and
    every parameter's gradient (the sum over the stages holding a copy of a tied parameter)."""
    plan = read_plan(plan_dir)
    task = task or task_for(plan_dir)
    inputs, targets = task.make_batch(rows, torch.Generator().manual_seed(seed))
    whole = whole_module(plan_dir, deterministic=True)
    stages = stage_modules(plan_dir, deterministic=True)
    assert [s.inputs for s in stages] == [tuple(s.inputs) for s in plan.stages]
    assert [s.outputs for s in stages] == [tuple(s.outputs) for s in plan.stages]

    want = dict(zip([o.name for o in plan.outputs],
                    whole(*[inputs[s.name] for s in plan.inputs]), strict=True))
    env = chain_stages(stages, inputs)
    for name, value in want.items():
        torch.testing.assert_close(env[name], value, rtol=1e-5, atol=1e-6)
    task.loss_fn(want, targets).backward()
    task.loss_fn({n: env[n] for n in want}, targets).backward()

    expected = {n: p.grad for n, p in whole.named_parameters()}
    got: dict[str, torch.Tensor] = {}
    holders: dict[str, list[int]] = {}
    for stage in stages:
        for name, param in stage.module.named_parameters():
            assert name in expected, name
            grad = param.grad if param.grad is not None else torch.zeros_like(param)
            got[name] = got[name] + grad if name in got else grad
            holders.setdefault(name, []).append(stage.index)
        assert all(stage.index in ks for ks in stage.tied.values())
    for name, want_grad in expected.items():
        if want_grad is None:
            continue
        torch.testing.assert_close(got[name], want_grad, rtol=1e-4, atol=1e-6)
    tied = {n: tuple(ks) for n, ks in holders.items() if len(ks) > 1}
    assert {n: ks for s in stages for n, ks in s.tied.items()} == tied


def train_checked(model: Path, plan: Path, stages: int, **options: str) -> None:
    """Partition ``model`` in train mode and train it 2 steps with ``--check``."""
    partition(model, stages, plan, batch_size=2, mode="train", **options)
    stats = train_plan(plan, steps=2, microbatches=2, batch_size=2, check=True)
    assert stats.mismatches == [], stats.mismatches


def assert_stages_run_on_meta(plan_dir: Path) -> None:
    """Every stage module moved to the ``meta`` device runs on meta inputs and makes only meta
    tensors (no node keeps the device the program was exported on); a symbolic size crossing
    a cut stays a host integer."""
    plan = read_plan(plan_dir)
    inputs, _ = task_for(plan_dir).make_batch(2, torch.Generator().manual_seed(0))
    env = {n: v.to("meta") for n, v in inputs.items()}
    for stage in stage_modules(plan_dir):
        outputs = stage.module.to("meta")(*[env[n] for n in stage.inputs])
        env.update(zip(stage.outputs, outputs, strict=True))
    for spec in plan.outputs:
        assert env[spec.name].device.type == "meta", spec.name
    for name, value in env.items():
        assert value.device.type == "meta" or value.dim() == 0, name


def saved_bytes(run: Callable[[], object]) -> tuple[int, object]:
    """Bytes autograd saves for backward while ``run()`` runs (every saved tensor as packed by
    ``saved_tensors_hooks``, no storage deduplication), and what ``run`` returned."""
    total = [0]

    def pack(t: torch.Tensor) -> torch.Tensor:
        total[0] += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = run()
    return total[0], out
