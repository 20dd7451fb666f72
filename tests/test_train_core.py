"""Training core on small hand-made models: export keeps the program, FX units stay whole,
train semantics (dropout, batch norm), the reference trainer, refusals, and save_trained."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import helper, numpy_helper
from torch import nn

from onnx_partition import export
from onnx_partition.cli import main
from onnx_partition.errors import PartitionError
from onnx_partition.graph.fxtag import fx_node_name, fx_unit
from onnx_partition.partition import partition
from onnx_partition.plan import read_plan
from onnx_partition.runtime.train.modules import (
    eval_module,
    require_trainable,
    stage_modules,
    whole_module,
)
from onnx_partition.runtime.train.optim import make_optimizer
from onnx_partition.runtime.train.reference import reference_train, split_rows
from onnx_partition.runtime.train.save import _replace, save_trained
from onnx_partition.runtime.train.task import task_for
from onnx_partition.runtime.train.trainer import train_plan


class Net(nn.Module):
    """Conv -> batch norm -> pool -> dropout -> linear -> layer norm -> linear, with a skip."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.bn = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.drop = nn.Dropout(0.5)
        self.fc, self.ln, self.out = nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.bn(self.conv(x)).relu().mean((2, 3))
        h = self.ln(self.fc(self.drop(h)))
        return self.out(h + h.tanh())


@pytest.fixture(scope="module")
def net(tmp_path_factory: pytest.TempPathFactory) -> tuple[Net, Path]:
    torch.manual_seed(0)
    module = Net()
    with torch.no_grad():
        module.bn.running_mean.normal_()
        module.bn.running_var.uniform_(0.5, 2.0)
    module.eval()
    path = tmp_path_factory.mktemp("net") / "net.onnx"
    assert export(module, (torch.randn(2, 3, 6, 6),), path, input_names=["x"],
                  output_names=["y"]) == path
    return module, path


@pytest.fixture(scope="module")
def plan3(net: tuple[Net, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("plans") / "p3"
    partition(net[1], 3, out, mode="train", batch_size=4, ordering="topo")
    return out


def test_export_writes_program_and_serves_eval_mode(net: tuple[Net, Path]) -> None:
    module, path = net
    assert sorted(p.name for p in path.parent.iterdir()) == ["net.onnx", "net.pt2"]
    assert not module.training  # mode restored
    x = torch.randn(5, 3, 6, 6)
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    (got,) = session.run(["y"], {"x": x.numpy()})
    with torch.no_grad():
        np.testing.assert_allclose(got, module(x).numpy(), rtol=1e-5, atol=1e-6)
    model = onnx.load(str(path))
    program = torch.export.load(path.with_suffix(".pt2"))
    fx_names = {n.name for n in program.graph.nodes}
    tags = [fx_node_name(n) for n in model.graph.node]
    assert all(t in fx_names for t in tags)  # every ONNX node names a train-program node
    targets = {str(n.target) for n in program.graph.nodes}
    assert "aten.native_dropout.default" in targets  # the program is the train-mode one
    assert "aten._native_batch_norm_legit_functional.default" in targets
    assert {i.name for i in model.graph.initializer} >= {"conv.weight", "bn.weight", "fc.weight"}


def test_plan_records_program_and_no_unit_is_split(net: tuple[Net, Path], plan3: Path) -> None:
    plan = read_plan(plan3)
    program = net[1].with_suffix(".pt2")
    assert (plan3 / plan.program).resolve() == program.resolve()
    import hashlib

    assert plan.program_sha256 == hashlib.sha256(program.read_bytes()).hexdigest()
    stage_of_unit: dict[str, int] = {}
    for stage in plan.stages:
        model = onnx.load(str(plan3 / stage.file))
        for node in model.graph.node:
            if node.name in stage.nodes:
                unit = fx_unit(node)
                assert unit is not None
                assert stage_of_unit.setdefault(unit, stage.index) == stage.index, unit


def test_units_stay_whole_at_every_cut(tmp_path: Path) -> None:
    """Layer norm and attention lower to several ONNX nodes (unoptimized export): at every
    stage count the plain DP can make, no FX node's ONNX nodes straddle a cut."""
    torch.manual_seed(1)
    attention = nn.MultiheadAttention(8, 2, batch_first=True)

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln, self.attn, self.fc = nn.LayerNorm(8), attention, nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.ln(x)
            return self.fc(x + self.attn(h, h, h, need_weights=False)[0])

    path = export(Block().eval(), (torch.randn(2, 4, 8),), tmp_path / "block.onnx",
                  input_names=["x"], output_names=["y"])
    model = onnx.load(str(path))
    sizes: dict[str, int] = {}
    for node in model.graph.node:
        if node.op_type != "Constant":
            sizes[fx_unit(node) or ""] = sizes.get(fx_unit(node) or "", 0) + 1
    assert max(sizes.values()) >= 3  # some torch op really is several ONNX nodes
    for stages in (2, 3, 4):
        out = tmp_path / f"p{stages}"
        plan = partition(path, stages, out, mode="train", batch_size=2, ordering="topo")
        seen: dict[str, int] = {}
        for stage in plan.stages:
            for node in onnx.load(str(out / stage.file)).graph.node:
                if node.name in stage.nodes:
                    assert seen.setdefault(fx_unit(node) or "", stage.index) == stage.index
        stage_modules(out, deterministic=True)  # and the program cuts the same way


def test_train_semantics_dropout_and_batch_norm(plan3: Path) -> None:
    x = torch.randn(4, 3, 6, 6)
    whole = whole_module(plan3)
    torch.manual_seed(5)
    a = whole(x)[0]
    torch.manual_seed(5)
    b = whole(x)[0]
    torch.manual_seed(6)
    c = whole(x)[0]
    assert torch.equal(a, b) and not torch.equal(a, c)  # dropout active, seeded
    fixed = whole_module(plan3, deterministic=True)
    assert torch.equal(fixed(x)[0], fixed(x)[0])
    # batch norm normalizes with batch statistics and updates its running statistics
    before = dict(fixed.named_buffers())["bn.running_mean"].clone()
    fixed(x)
    buffers = dict(fixed.named_buffers())
    mean = nn.functional.conv2d(x, dict(fixed.named_parameters())["conv.weight"],
                                dict(fixed.named_parameters())["conv.bias"], padding=1)
    torch.testing.assert_close(buffers["bn.running_mean"],
                               0.9 * before + 0.1 * mean.mean((0, 2, 3)).detach(),
                               rtol=1e-5, atol=1e-6)
    assert int(buffers["bn.num_batches_tracked"]) == 3
    # the stage holding the batch norm updates its buffers as the whole module does
    once = whole_module(plan3, deterministic=True)
    initial = dict(once.named_buffers())["bn.running_mean"].clone()
    once(x)
    env = {"x": x}
    for stage in stage_modules(plan3, deterministic=True):
        env.update(zip(stage.outputs, stage.module(*[env[n] for n in stage.inputs])))
        for name, value in stage.module.named_buffers():
            torch.testing.assert_close(value, dict(once.named_buffers())[name])
    assert not torch.equal(dict(once.named_buffers())["bn.running_mean"], initial)


def test_validation_runs_the_model_as_eval_mode_does(net: tuple[Net, Path], plan3: Path) -> None:
    """``eval_module``: the train-mode program as ``model.eval()`` runs it (dropout off, batch
    norm on its running statistics, which stay as they were), whole and stage by stage, on the
    same parameters; and a run that evaluates every step trains exactly as one that does not
    (its dropout draws from the same random stream; evaluation dropped masks before)."""
    x = torch.randn(4, 3, 6, 6)
    whole = whole_module(plan3)
    before = {n: b.clone() for n, b in whole.named_buffers()}
    judge = eval_module(whole)
    with torch.no_grad():
        want = net[0](x)
        torch.testing.assert_close(judge(x)[0], want, rtol=1e-5, atol=1e-6)
        assert torch.equal(judge(x)[0], judge(x)[0])
        env = {"x": x}
        for stage in stage_modules(plan3):
            env.update(zip(stage.outputs,
                           eval_module(stage.module)(*[env[n] for n in stage.inputs])))
        torch.testing.assert_close(env["y"], want, rtol=1e-5, atol=1e-6)
    assert all(torch.equal(before[n], b) for n, b in whole.named_buffers())
    assert dict(judge.named_parameters()).keys() == dict(whole.named_parameters()).keys()
    assert all(p is dict(whole.named_parameters())[n] for n, p in judge.named_parameters())
    plain = train_plan(plan3, steps=3, microbatches=2, batch_size=2, optimizer="sgd", lr=0.1)
    evaluated = train_plan(plan3, steps=3, microbatches=2, batch_size=2, optimizer="sgd",
                           lr=0.1, eval_every=1)
    assert len(evaluated.eval_loss) == 3 and evaluated.loss == plain.loss


def test_only_some_stages(plan3: Path) -> None:
    every = stage_modules(plan3)
    (one,) = stage_modules(plan3, only=[1])
    assert (one.index, one.inputs, one.outputs, one.tied) == (
        1, every[1].inputs, every[1].outputs, every[1].tied)
    assert one.module.state_dict().keys() == every[1].module.state_dict().keys()
    with pytest.raises(PartitionError, match="stage 3 is not in the plan"):
        stage_modules(plan3, only=[3])


def test_reference_trainer_accumulates_like_one_batch(plan3: Path) -> None:
    """The reference (whole module, micro-batches, loss weighted by rows) equals the stage
    modules chained by hand over the same micro-batches, for SGD and AdamW, two steps."""
    task = task_for(plan3)
    assert task.kind == "mse"
    batch = task.make_batch(6, torch.Generator().manual_seed(0))
    assert batch[0]["x"].shape == (6, 3, 6, 6) and batch[1]["y"].shape == (6, 4)
    for optimizer, lr in (("sgd", 0.1), ("adamw", 0.01)):
        got = reference_train(plan3, [batch], optimizer=optimizer, lr=lr, steps=2,
                              microbatches=3)
        stages = stage_modules(plan3, deterministic=True)
        params = [p for s in stages for p in s.module.parameters()]
        opt = make_optimizer(optimizer, params, lr)
        plan = read_plan(plan3)
        for _ in range(2):
            opt.zero_grad()
            for lo, hi in split_rows(6, 3):
                env = {k: v[lo:hi] for k, v in batch[0].items()}
                for stage in stages:
                    env.update(zip(stage.outputs, stage.module(*[env[n] for n in stage.inputs])))
                loss = task.loss_fn({o.name: env[o.name] for o in plan.outputs},
                                    {k: v[lo:hi] for k, v in batch[1].items()})
                (loss * (hi - lo) / 6).backward()
            opt.step()
        trained = {n: p for s in stages for n, p in s.module.named_parameters()}
        assert set(trained) == set(got)
        for name, value in got.items():
            torch.testing.assert_close(trained[name], value, rtol=1e-5, atol=1e-6)
        initial = dict(whole_module(plan3).named_parameters())
        assert any(not torch.equal(initial[n], v) for n, v in got.items())


def test_split_rows_matches_runtime_split() -> None:
    from onnx_partition.pipeline.microbatch import split

    for rows, chunks in ((7, 3), (4, 8), (6, 6)):
        parts = split({"x": np.arange(rows)}, chunks)
        assert [(int(p["x"][0]), int(p["x"][-1]) + 1) for p in parts] == split_rows(rows, chunks)


def test_untrainable_plans_are_refused(net: tuple[Net, Path], plan3: Path,
                                       tmp_path: Path) -> None:
    infer = tmp_path / "infer"
    partition(net[1], 2, infer, batch_size=2)
    with pytest.raises(PartitionError, match=r"--mode infer.*partition .*--mode train"):
        require_trainable(infer)
    bare = tmp_path / "bare" / "net.onnx"
    bare.parent.mkdir()
    shutil.copy(net[1], bare)  # the ONNX file alone, no program beside it
    partition(bare, 2, tmp_path / "noprog", mode="train", batch_size=2)
    with pytest.raises(PartitionError, match=r"no exported program.*onnx-partition export"):
        stage_modules(tmp_path / "noprog")
    copy = tmp_path / "copy"
    shutil.copytree(plan3.parent, copy)
    shutil.copy(net[1].with_suffix(".pt2"), copy / "net.pt2")
    body = json.loads((copy / "p3" / "plan.json").read_text())
    body["program"] = "../net.pt2"
    (copy / "p3" / "plan.json").write_text(json.dumps(body))
    require_trainable(copy / "p3")
    with open(copy / "net.pt2", "ab") as f:
        f.write(b"\0")  # an altered program
    with pytest.raises(PartitionError, match="altered"):
        whole_module(copy / "p3")
    assert main(["partition", str(net[1]), "-s", "2", "--mode", "train", "--batch-size", "2",
                 "-o", str(tmp_path / "cli")]) == 0
    assert read_plan(tmp_path / "cli").mode == "train"


def test_save_trained_round_trip_through_run_check(plan3: Path, tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    task = task_for(plan3)
    stages = stage_modules(plan3, deterministic=True)
    opt = make_optimizer("sgd", [p for s in stages for p in s.module.parameters()], 0.5)
    inputs, targets = task.make_batch(4, torch.Generator().manual_seed(1))
    env = dict(inputs)
    for stage in stages:
        env.update(zip(stage.outputs, stage.module(*[env[n] for n in stage.inputs])))
    task.loss_fn({"y": env["y"]}, targets).backward()
    opt.step()
    out = save_trained(plan3, [s.module.state_dict() for s in stages], tmp_path / "trained")
    plan = read_plan(out)
    assert plan.model == "net.onnx" and plan.program == "net.pt2"
    assert main(["run", str(out), "--check", "--iterations", "1", "--warmup", "0"]) == 0
    assert "(OK)" in capsys.readouterr().out
    # the trained weights are served: eval-mode torch with the trained state == the ONNX file
    trained = {n: v for s in stages for n, v in s.module.state_dict().items()}
    x = torch.randn(3, 3, 6, 6)
    session = ort.InferenceSession(str(out / "net.onnx"), providers=["CPUExecutionProvider"])
    (got,) = session.run(["y"], {"x": x.numpy()})
    ref = Net()
    ref.load_state_dict(trained, strict=False)
    with torch.no_grad():
        np.testing.assert_allclose(got, ref.eval()(x).numpy(), rtol=1e-4, atol=1e-5)
    # ... and the saved plan trains on from the trained program
    again = whole_module(out)
    for name, value in dict(again.named_parameters()).items():
        torch.testing.assert_close(value, trained[name])
    with pytest.raises(PartitionError, match="not an earlier plan"):
        (tmp_path / "busy").mkdir()
        (tmp_path / "busy" / "mine.txt").write_text("x")
        save_trained(plan3, [s.module.state_dict() for s in stages], tmp_path / "busy")
    assert (tmp_path / "busy" / "mine.txt").read_text() == "x"
    save_trained(plan3, [s.module.state_dict() for s in stages], out)  # over an earlier save


def test_hybrid_train_plan_gives_stage_modules(net: tuple[Net, Path], tmp_path: Path) -> None:
    """The hybrid planner's train plans (replicas per stage) cut along FX units too."""
    from support.training import assert_stages_equal_whole

    from onnx_partition.cost.cluster import Cluster

    plan = partition(net[1], 2, tmp_path / "hybrid", batch_size=4, mode="train",
                     microbatches=4, cluster=Cluster(devices_per_machine=3))
    assert len(plan.stages) == 2 and plan.program
    assert_stages_equal_whole(tmp_path / "hybrid")


def test_export_refuses_a_program_path(tmp_path: Path) -> None:
    with pytest.raises(PartitionError, match=r"must not end in \.pt2"):
        export(nn.Linear(2, 2), (torch.randn(2, 2),), tmp_path / "b.pt2")
    assert not any(tmp_path.iterdir())


def test_an_export_that_fails_midway_leaves_the_earlier_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The ONNX file and its program are published together or not at all (fileio)."""
    path = export(nn.Linear(2, 2), (torch.randn(2, 2),), tmp_path / "m.onnx")
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    assert sorted(before) == ["m.onnx", "m.pt2"]

    def half_then_fail(program: object, where: object, **keywords: object) -> None:
        Path(str(where)).write_bytes(b"half a program")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch.export, "save", half_then_fail)
    with pytest.raises(OSError, match="No space left"):
        export(nn.Linear(2, 3), (torch.randn(2, 2),), path)
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before


def test_trained_weights_keep_their_shape_and_dtype_even_0d() -> None:
    """A scalar initializer stays 0-d (np.ascontiguousarray made it shape [1]); dtypes are the
    initializer's own; names not trained are left alone."""
    graph = helper.make_graph(
        [], "g", [], [],
        initializer=[numpy_helper.from_array(np.array(1.0, np.float16), "scale"),
                     numpy_helper.from_array(np.zeros((2, 3), np.float32), "w"),
                     numpy_helper.from_array(np.ones(2, np.float32), "kept")])
    model = helper.make_model(graph)
    trained = {"scale": torch.tensor(2.5), "w": torch.arange(6.0).reshape(2, 3)}
    assert _replace(model, trained) == 2
    out = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    assert out["scale"].shape == () and out["scale"].dtype == np.float16 and out["scale"] == 2.5
    np.testing.assert_array_equal(out["w"], np.arange(6.0).reshape(2, 3))
    np.testing.assert_array_equal(out["kept"], np.ones(2))
    onnx.checker.check_model(model)
