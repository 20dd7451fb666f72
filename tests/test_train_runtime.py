"""The training engine on real gloo process groups, with stage modules cut by hand from a small
torch model that has a skip tensor, a late model input and a tied parameter."""

from __future__ import annotations

import copy
import functools
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
import torch
from support.clock import ForwardClock, read_clock
from support.faults import ExitAt
from support.training import rank_run
from torch import nn

from onnx_partition.pipeline import schedules
from onnx_partition.pipeline.simulate import PipelineCosts, StageCosts, simulate
from onnx_partition.plan import IOSpec, Plan, Stage
from onnx_partition.runtime import StageFailed
from onnx_partition.runtime.train.optim import make_optimizer
from onnx_partition.runtime.train.rank_io import RankRun, microbatch
from onnx_partition.runtime.train.spawn import launch_training

ROWS = 3  # per micro-batch


class Whole(nn.Module):
    """y = ((lin2(relu(lin1(a))) + a) @ w) * z with a = tanh(x @ w.T + b0): ``w`` is read
    by the first and the last piece (tied), ``a`` skips the middle, ``z`` is read last."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 4))
        self.b0 = nn.Parameter(torch.randn(4))
        self.lin1 = nn.Linear(4, 4)
        self.lin2 = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> tuple[torch.Tensor]:
        a = torch.tanh(x @ self.w.T + self.b0)
        h = torch.relu(self.lin1(a))
        return (((self.lin2(h) + a) @ self.w) * z,)


class Piece(nn.Module):
    """Some of ``Whole``'s parameters (same names, copied) and a function over them."""

    def __init__(self, whole: Whole, names: list[str], fn: Callable[..., tuple]) -> None:
        super().__init__()
        for n in names:
            setattr(self, n, copy.deepcopy(getattr(whole, n)))
        self.fn = fn

    def forward(self, *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.fn(self, *xs)


@dataclass
class HandStage:  # the fields of onnx_partition.runtime.train.modules.StageModule
    index: int
    module: nn.Module
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    tied: dict[str, tuple[int, ...]] = field(default_factory=dict)


def _first(p, x):
    return (torch.tanh(x @ p.w.T + p.b0),)


def _middle(p, a):
    return (torch.relu(p.lin1(a)),)


def _last(p, h, a, z):
    return (((p.lin2(h) + a) @ p.w) * z,)


def _first_two(p, x):
    a = torch.tanh(x @ p.w.T + p.b0)
    return a, torch.relu(p.lin1(a))


def _raising(p, h, a, z):
    raise ValueError("this stage cannot run")


def cut(whole: Whole, stages: int, *, raising: bool = False) -> list[HandStage]:
    last = _raising if raising else _last
    if stages == 3:
        return [HandStage(0, Piece(whole, ["w", "b0"], _first), ("x",), ("a",), {"w": (0, 2)}),
                HandStage(1, Piece(whole, ["lin1"], _middle), ("a",), ("h",)),
                HandStage(2, Piece(whole, ["lin2", "w"], last), ("h", "a", "z"), ("y",),
                          {"w": (0, 2)})]
    return [HandStage(0, Piece(whole, ["w", "b0", "lin1"], _first_two), ("x",), ("a", "h"),
                      {"w": (0, 1)}),
            HandStage(1, Piece(whole, ["lin2", "w"], last), ("h", "a", "z"), ("y",),
                      {"w": (0, 1)})]


def hand_plan(stages: list[HandStage], replicas: list[int], recompute: bool = False) -> Plan:
    return Plan(model="hand", stages=[
        Stage(s.index, f"stage_{s.index}", [], list(s.inputs), list(s.outputs), replicas=d,
              devices=["cpu"] * d, recompute=recompute or None)
        for s, d in zip(stages, replicas)],
        inputs=[IOSpec("x", "float32", ["N", 4]), IOSpec("z", "float32", ["N", 4])],
        outputs=[IOSpec("y", "float32", ["N", 4])], mode="train")


def batch(step: int, rows: int) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(100 + step)
    x, z, y = (torch.randn(rows, 4, generator=gen) for _ in range(3))
    return {"x": x, "z": z}, {"y": y}


def mse(outputs: dict[str, torch.Tensor], targets: dict[str, torch.Tensor]) -> torch.Tensor:
    return nn.functional.mse_loss(outputs["y"], targets["y"])


def build(stages: int, replicas: list[int], rows: int, raising: bool = False,
          recompute: bool = False):
    torch.manual_seed(0)
    pieces = cut(Whole(), stages, raising=raising)
    return (pieces, mse, hand_plan(pieces, replicas, recompute),
            functools.partial(batch, rows=rows))


def reference(steps: int, microbatches: int, optimizer: str, lr: float,
              clip: float | None = None, norms: list[float] | None = None
              ) -> dict[str, torch.Tensor]:
    """The whole model, one process, gradients accumulated over the micro-batches; ``clip``:
    ``clip_grad_norm_`` (its norms appended to ``norms``)."""
    torch.manual_seed(0)
    whole = Whole()
    opt = make_optimizer(optimizer, list(whole.parameters()), lr)
    for step in range(steps):
        inputs, targets = batch(step, ROWS * microbatches)
        opt.zero_grad()
        for m in range(microbatches):
            got = whole(**microbatch(inputs, m, microbatches))
            (mse({"y": got[0]}, microbatch(targets, m, microbatches)) / microbatches).backward()
        if clip is not None:
            norm = torch.nn.utils.clip_grad_norm_(whole.parameters(), clip)
            if norms is not None:
                norms.append(float(norm))
        opt.step()
    return {n: p.detach() for n, p in whole.named_parameters()}


def train(stages: int, replicas: list[int], config: RankRun, raising: bool = False,
          recompute: bool = False):
    job = functools.partial(build, stages, replicas, ROWS * config.microbatches, raising,
                            recompute)
    return launch_training(job()[2], job, config, timeout_s=60)


def assert_trained_like_reference(results, config: RankRun, rtol: float) -> None:
    for step in config.check_steps:
        want = reference(step, config.microbatches, config.optimizer, config.job.optimizer.lr)
        for res in results:
            for name, got in res.states[step].items():
                torch.testing.assert_close(got, want[name], rtol=rtol, atol=1e-6,
                                           msg=lambda m, s=res.stage, n=name: f"stage {s} {n}: {m}")


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe", "zb-h1"])
def test_three_stages_equal_single_process_sgd(schedule):
    config = rank_run(steps=1, microbatches=4, schedule=schedule, optimizer="sgd", lr=0.1,
                         check_steps=(1,))
    results = train(3, [1, 1, 1], config)
    assert_trained_like_reference(results, config, rtol=1e-4)
    sim = simulate(schedules.build(schedule, [1, 1, 1], 4),
                   PipelineCosts([StageCosts(1.0, 2.0)] * 3, [0.0, 0.0]))
    want = schedules.build(schedule, [1, 1, 1], 4)
    for res in results:
        assert res.actions == [str(a) for a in want[(res.stage, res.replica)]]
        assert res.peak_inflight == sim.peak_inflight[(res.stage, res.replica)]
    assert results[0].loss[0] > 0 and len(results[0].table) == 1


def test_unequal_replicas_equal_single_process_adamw():
    """Stages with 2 and 1 replicas on 3 ranks: replica all-reduce, tied sum across the stage
    with replicas and the one without, three AdamW steps."""
    config = rank_run(steps=3, microbatches=4, schedule="1f1b", optimizer="adamw", lr=0.01,
                         check_steps=(1, 3))
    results = train(2, [2, 1], config)
    assert [(r.stage, r.replica) for r in results] == [(0, 0), (0, 1), (1, 0)]
    assert_trained_like_reference(results, config, rtol=1e-3)
    want = schedules.build("1f1b", [2, 1], 4)
    sim = simulate(want, PipelineCosts([StageCosts(1.0, 2.0, 2), StageCosts(1.0, 2.0)], [0.0]))
    for res in results:
        assert res.actions == [str(a) for a in want[(res.stage, res.replica)]] * 3
        assert res.peak_inflight == sim.peak_inflight[(res.stage, res.replica)]


@pytest.mark.parametrize("schedule", ["zb-h1", "1f1b"])
def test_recomputing_stages_with_replicas_equal_single_process_adamw(schedule):
    """Every stage recomputing (stage 0 on 2 replicas, the tied ``w`` across both stages,
    clipping): AdamW steps equal single-process training. Under ZB-H1 each rank ran its
    planned actions, the weight pass of every micro-batch after its input pass."""
    config = rank_run(steps=2, microbatches=4, schedule=schedule, optimizer="adamw",
                         lr=0.01, check_steps=(1, 2))
    results = train(2, [2, 1], config, recompute=True)
    assert_trained_like_reference(results, config, rtol=1e-3)
    want = schedules.build(schedule, [2, 1], 4)
    for res in results:
        done = res.actions[:len(res.actions) // 2]
        assert done == [str(a) for a in want[(res.stage, res.replica)]]
        # the saved bytes counted are the rebuild's, one figure per micro-batch served
        assert len(res.activation_bytes) == sum("F" in a for a in done)
        assert all(b > 0 for b in res.activation_bytes)
        if schedule == "zb-h1":
            for m in {int(a[2:]) for a in done}:
                assert done.index(f"{res.stage}I{m}") < done.index(f"{res.stage}W{m}")


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_clipping_counts_tied_parameters_once_and_replicas_once(schedule):
    """Stage 0 on 2 replicas and stage 1 share ``w``: the whole model's gradient norm over the
    3 ranks equals clip_grad_norm_'s in one process, and so do the clipped SGD steps."""
    config = rank_run(steps=2, microbatches=4, schedule=schedule, optimizer="sgd", lr=0.1,
                         check_steps=(1, 2), clip_grad_norm=0.05)
    results = train(2, [2, 1], config)
    norms: list[float] = []
    for step in config.check_steps:
        want = reference(step, 4, "sgd", 0.1, clip=0.05, norms=norms if step == 2 else None)
        for res in results:
            for name, got in res.states[step].items():
                torch.testing.assert_close(got, want[name], rtol=1e-4, atol=1e-6)
    assert min(norms) > 0.05  # every step clipped
    for res in results:
        assert res.grad_norm == pytest.approx(norms, rel=1e-5)


def test_a_raising_stage_ends_the_job_naming_it():
    began = time.perf_counter()
    with pytest.raises(StageFailed, match=r"stage 1 replica 0 \(rank 1, cpu\) failed: 1F0: "
                                          r"this stage cannot run"):
        train(2, [1, 1], rank_run(steps=1, microbatches=2), raising=True)
    assert time.perf_counter() - began < 30


def test_a_rank_killed_mid_step_ends_the_job():
    began = time.perf_counter()
    with pytest.raises(StageFailed, match=r"stage 0 replica 1 \(rank 1, cpu\) exited with code 1"):
        train(2, [2, 1], rank_run(steps=2, microbatches=4, hook=ExitAt(1, "forward")))
    assert time.perf_counter() - began < 30



@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_forward_sends_leave_when_their_forward_ends(schedule, tmp_path):
    """Stage 0's forwards are slowed (0.4 s after each): stage 1 must finish its first forward
    before stage 0 finishes its second, so micro-batch 0's activations left when its forward
    ended, not with stage 0's next receive (its first backward, after every forward in GPipe;
    the queued sends measured 6.5 -> 13.0 ms late before)."""
    clock = tmp_path / "clock"
    config = rank_run(steps=1, microbatches=4, schedule=schedule, lr=0.1, check_steps=(1,),
                         hook=ForwardClock(str(clock), slow=0, delay_s=0.4))
    results = train(2, [1, 1], config)
    assert_trained_like_reference(results, config, rtol=1e-4)
    ends = read_clock(clock)
    assert len(ends[0]) == len(ends[1]) == 4
    assert ends[1][0] < ends[0][1], (ends[1][0] - ends[0][0], ends[0][1] - ends[0][0])
