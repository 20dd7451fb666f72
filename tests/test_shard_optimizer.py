"""Issue 34, item 3: the optimizer state sharded over a stage's replicas (``partition
--shard-optimizer``, ZeRO-1). The memory model's term counted by hand; the hybrid DP finding a
plan that fits only sharded; plan.json's ``stages[i].shard``; ``train`` following it with
``ZeroRedundancyOptimizer`` over real gloo groups: ``--check`` (SGD with momentum after steps 1
and 3) equal to single-process training, AdamW within a stated tolerance of it and equal to the
same plan trained unsharded; a checkpoint of a sharded run resumes; ``--engine torch`` and an
inference plan refuse it in one line."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from support.checkpoints import rank_tensors
from torch import nn

from onnx_partition import export
from onnx_partition.cli import main
from onnx_partition.cost.cluster import Cluster
from onnx_partition.errors import PartitionError
from onnx_partition.partition import partition
from onnx_partition.pipeline.memory import (
    StageBytes,
    memory_parts,
    memory_per_device,
    optimizer_state,
    static_bytes,
)
from onnx_partition.plan import read_plan
from onnx_partition.request.train import PlannedChoiceWarning
from onnx_partition.runtime.train.data_plan import synthetic_batch
from onnx_partition.runtime.train.reference import reference_train
from onnx_partition.runtime.train.results import TrainStats
from onnx_partition.runtime.train.task import task_for
from onnx_partition.runtime.train.trainer import train_plan
from onnx_partition.solve.hybrid import plan_hybrid
from onnx_partition.solve.hybrid_model import HybridConfig, SequenceCosts

#: AdamW after 3 steps against the single-process run: the ranks' sums in another order move
#: a parameter by rounding, which AdamW's g / sqrt(v) scales up to at most this (lr 0.01)
ADAMW_ATOL = 1e-5


def test_a_sharded_stage_holds_its_share_of_the_optimizer_state() -> None:
    """static = weights + grads + optimizer / r + the gradient receive buffer, by hand: 1000
    bytes of initializers of which 600 trained, AdamW (factor 4: two moments of 600), 4
    replicas: 1000 + 600 + 1200 / 4 + 7; the stash (10 + 5) once (1F1B, last stage)."""
    stage = StageBytes(params=1000.0, activations=10.0, received=5.0, sent=7.0,
                       trainable=600.0)
    assert optimizer_state(600.0, 4.0) == 1200.0
    assert optimizer_state(600.0, 4.0, 4, "optimizer") == 300.0
    assert optimizer_state(600.0, 4.0, 4, "none") == 1200.0
    assert static_bytes(stage, train=True, optimizer_factor=4.0, replicas=4,
                        shard="optimizer") == 1000 + 600 + 300 + 7
    assert static_bytes(stage, train=True, optimizer_factor=4.0,
                        replicas=4) == 1000 + 600 + 1200 + 7
    assert memory_per_device([stage], [4], 4, schedule="1f1b", shard="optimizer") == [
        1907.0 + 15.0]
    assert memory_per_device([stage], [1], 4, schedule="1f1b", shard="optimizer") == [
        2807.0 + 15.0]  # one replica: nothing to shard over
    parts = memory_parts(stage, 1, train=True, replicas=4, shard="optimizer")
    assert (parts["weights_bytes"], parts["grad_bytes"], parts["optimizer_bytes"],
            parts["memory_bytes"]) == (1000, 600, 300, 1922)
    # SGD with momentum (factor 3): one copy, halved on two replicas
    sgd = StageBytes(params=800.0, activations=0.0)
    assert static_bytes(sgd, train=True, optimizer_factor=3.0, replicas=2,
                        shard="optimizer") == 800 + 800 + 400


def _two_positions(**config: object) -> tuple[SequenceCosts, HybridConfig]:
    costs = SequenceCosts(forward_ms=[1.0, 1.0], backward_ms=[2.0, 2.0],
                          param_bytes=[100.0, 100.0], activation_bytes=[1.0, 1.0],
                          cut_bytes=[0.0, 1.0, 0.0])
    return costs, HybridConfig(devices=4, memory_bytes=390.0, microbatches=4, train=True,
                               **config)  # type: ignore[arg-type]


def test_the_hybrid_dp_fits_a_model_only_with_its_optimizer_state_sharded() -> None:
    """Two positions of 100 parameter bytes, 390 bytes per device, AdamW (factor 4):
    unsharded every stage holds at least 4 x 100 + 1 sent, over 390 whatever its replicas;
    sharded over 2 replicas a position holds 100 + 100 + 200 / 2 + 1 sent, and its micro-batches
    (1 byte each) fit: a plan of single positions on 2 or more replicas each."""
    costs, plain = _two_positions()
    with pytest.raises(PartitionError, match="no plan fits"):
        plan_hybrid(costs, plain)
    _, sharded = _two_positions(shard="optimizer")
    plans = plan_hybrid(costs, sharded)
    assert plans
    for stages in plans:
        assert all(s.memory_bytes <= 390.0 for s in stages)
        assert all(s.replicas >= 2 for s in stages)  # it fits only sharded over replicas
    best = plans[0]
    assert [(s.start, s.end) for s in best] == [(0, 1), (1, 2)]
    sizes = [StageBytes(100.0, 1.0, 0.0, 1.0), StageBytes(100.0, 1.0, 1.0, 0.0)]
    assert [s.memory_bytes for s in best] == memory_per_device(
        sizes, [s.replicas for s in best], 4, schedule="1f1b", shard="optimizer")


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(torch.relu(self.b(torch.relu(self.a(x)))))


@pytest.fixture(scope="module")
def sharded_plan(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An MLP planned for 2 stages on 3 devices: one stage on 2 replicas, its state sharded."""
    root = tmp_path_factory.mktemp("shard")
    torch.manual_seed(0)
    model = export(_Net(), (torch.randn(4, 8),), root / "m.onnx")
    partition(model, 2, root / "plan", batch_size=4, mode="train", microbatches=4,
              cluster=Cluster(devices_per_machine=3), shard_optimizer=True)
    return root / "plan"


def test_plan_json_records_each_stage_shard(sharded_plan: Path, tmp_path: Path) -> None:
    plan = read_plan(sharded_plan)
    assert sorted(s.replicas for s in plan.stages) == [1, 2]
    assert [s.shard for s in plan.stages] == [
        "optimizer" if s.replicas > 1 else "none" for s in plan.stages]
    body = json.loads((sharded_plan / "plan.json").read_text())
    wide = next(s for s in plan.stages if s.replicas == 2)
    parts = wide.predicted
    assert parts is not None and parts.grad_bytes is not None
    # AdamW's two moments of the trained bytes, halved over the 2 replicas
    assert parts.optimizer_bytes == parts.grad_bytes
    # the same plan unsharded holds the whole state on each replica: the simulator's static
    # bytes (what simulate and report replay) and the predicted memory by the other half
    plain = partition(sharded_plan.parent / "m.onnx", 2, tmp_path / "plain", batch_size=4,
                      mode="train", microbatches=4, cluster=Cluster(devices_per_machine=3))
    assert all(s.shard is None for s in plain.stages)
    assert [s.replicas for s in plain.stages] == [s.replicas for s in plan.stages]
    twin = plain.stages[wide.index].predicted
    assert twin is not None and twin.optimizer_bytes == 2 * parts.optimizer_bytes
    assert twin.memory_bytes - parts.memory_bytes == parts.optimizer_bytes
    other = json.loads((tmp_path / "plain" / "plan.json").read_text())
    statics = [body["simulator_costs"]["static_bytes"], other["simulator_costs"]["static_bytes"]]
    assert statics[1][wide.index] - statics[0][wide.index] == pytest.approx(
        parts.optimizer_bytes, abs=1)


def _reference(plan_dir: Path, steps: int, **optim: object) -> dict[str, torch.Tensor]:
    task = task_for(plan_dir, "mse")
    batches = [synthetic_batch(task.make_batch, 16, 0, s) for s in range(steps)]
    return reference_train(plan_dir, batches, microbatches=4, steps=steps, task=task,
                           lr=0.01, total_steps=steps, **optim)  # type: ignore[arg-type]


_COMMON = dict(loss="mse", batch_size=4, microbatches=4)


def test_train_check_on_a_sharded_plan_with_sgd(sharded_plan: Path) -> None:
    """SGD with momentum: --check's parameters after steps 1 and 3 equal single-process
    training (the sharded replica's included)."""
    with pytest.warns(PlannedChoiceWarning):
        sgd = train_plan(sharded_plan, optimizer="sgd", momentum=0.9, steps=3, check=True,
                         **_COMMON)  # type: ignore[arg-type]
    assert sgd.checked_steps == (1, 3) and sgd.mismatches == []
    assert sorted(r.replica for r in sgd.ranks) == [0, 0, 1]


@pytest.fixture(scope="module")
def adamw_run(sharded_plan: Path, tmp_path_factory: pytest.TempPathFactory
              ) -> tuple[TrainStats, Path]:
    """3 AdamW steps of the sharded plan under --check, checkpointed after steps 2 and 3."""
    out = tmp_path_factory.mktemp("ckpt") / "ckpt"
    stats = train_plan(sharded_plan, optimizer="adamw", steps=3, check=True,
                       checkpoint_dir=out, checkpoint_every=2, **_COMMON)  # type: ignore[arg-type]
    return stats, out


def test_adamw_on_a_sharded_plan_equals_the_reference_and_the_unsharded_run(
        sharded_plan: Path, adamw_run: tuple[TrainStats, Path], tmp_path: Path) -> None:
    """AdamW after step 3: within ADAMW_ATOL of single-process training, and equal (to
    float32 rounding) to the same plan trained with the whole state on every replica."""
    adamw = adamw_run[0]
    want = _reference(sharded_plan, 3, optimizer="adamw")
    for r in adamw.ranks:
        for name, got in r.states[3].items():
            assert float((got - want[name]).abs().max()) <= ADAMW_ATOL, (r.rank, name)
    unsharded = tmp_path / "plan"
    shutil.copytree(sharded_plan, unsharded)
    body = json.loads((unsharded / "plan.json").read_text())
    for stage in body["stages"]:
        stage.pop("shard", None)
    body["model"] = str((sharded_plan / body["model"]).resolve())
    body["program"] = str((sharded_plan / body["program"]).resolve())
    (unsharded / "plan.json").write_text(json.dumps(body))
    plain = train_plan(unsharded, optimizer="adamw", steps=3, check=True,
                       **_COMMON)  # type: ignore[arg-type]
    for a, b in zip(adamw.ranks, plain.ranks, strict=True):
        for name, got in a.states[3].items():
            torch.testing.assert_close(got, b.states[3][name], rtol=1e-6, atol=1e-7)


def test_a_sharded_checkpoint_resumes(sharded_plan: Path,
                                      adamw_run: tuple[TrainStats, Path]) -> None:
    """The first replica's file holds the whole consolidated optimizer state, the other's
    none; resumed from step 2 the run ends where 3 straight steps do."""
    adamw, out = adamw_run
    plan = read_plan(sharded_plan)
    wide = next(s for s in plan.stages if s.replicas == 2)
    first = sum(s.replicas for s in plan.stages[: wide.index])
    folder = out / "step-00000002"
    held = [[k for k in rank_tensors(folder, first + j) if k.startswith("optim/")]
            for j in range(2)]
    assert held[0] and not held[1]
    shutil.rmtree(out / "step-00000003")  # resume from step 2
    resumed = train_plan(sharded_plan, steps=3, resume=out, optimizer="adamw",
                         **_COMMON)  # type: ignore[arg-type]
    assert resumed.loss[-1] == pytest.approx(adamw.loss[-1], rel=1e-5)


def test_a_sharded_plan_is_refused_where_it_cannot_hold(
        sharded_plan: Path, tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    assert main(["train", str(sharded_plan), "--engine", "torch", "--steps", "1"]) == 2
    err = capfd.readouterr().err
    assert "--engine torch does not shard optimizer state" in err and len(
        err.strip().splitlines()) == 1
    assert main(["partition", str(sharded_plan.parent / "m.onnx"), "--devices", "2",
                 "--shard-optimizer", "-o", str(tmp_path / "p")]) == 2
    assert "--shard-optimizer shards a training stage's optimizer state: it needs --mode " \
           "train" in capfd.readouterr().err


def test_a_weightless_llama_from_its_config_trains_sharded_as_one_process(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 34's end to end: a small Llama from a config, exported without weights, planned
    on 3 devices in 2 stages with ``--shard-optimizer`` (a stage on 2 replicas, its optimizer
    state sharded), trained with ``--check``: each rank makes its own stage's weights and the
    sharded SGD-with-momentum steps equal single-process training's."""
    transformers = pytest.importorskip("transformers")
    transformers.LlamaConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                             num_key_value_heads=2, intermediate_size=128, vocab_size=128,
                             max_position_embeddings=16,
                             architectures=["LlamaForCausalLM"]).save_pretrained(tmp_path / "c")
    model, plan = tmp_path / "llama.onnx", tmp_path / "plan"
    assert main(["export", "--hf-config", str(tmp_path / "c"), "--no-weights", "--seq-len",
                 "16", "-o", str(model)]) == 0
    assert main(["partition", str(model), "--mode", "train", "--devices", "3", "--stages", "2",
                 "--batch-size", "2", "--microbatches", "4", "--shard-optimizer", "-o",
                 str(plan)]) == 0
    stages = read_plan(plan).stages
    assert read_plan(plan).weights == "none"
    assert any(s.replicas > 1 and s.sharded for s in stages), stages
    capsys.readouterr()
    assert main(["train", str(plan), "--steps", "3", "--check", "--optimizer", "sgd",
                 "--momentum", "0.9", "--lr", "0.05"]) == 0
    checks = [line for line in capsys.readouterr().out.splitlines()
              if line.startswith("check against single-process training")]
    assert checks and all(line.endswith(": OK") for line in checks), checks
