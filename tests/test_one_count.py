"""One memory count (issue 20, item 5): a plain pipeline (``--stages``) and a cluster plan
(``--devices``) of the same stages state the same memory, counted from what each stage runs:
every initializer it holds as weights (constants and buffers too; a tied parameter in each
stage reading it), gradients and optimizer state for the program's parameters only, stage 0's
graph inputs as received per micro-batch. And ``train_plan`` defaults to what the plan was
priced for, with ``train``'s rule and warning."""

from __future__ import annotations

import inspect
import json
import warnings
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch

from onnx_partition.cli import main
from onnx_partition.errors import PartitionError
from onnx_partition.plan import read_plan
from onnx_partition.runtime.train.choices import TRAIN_FALLBACKS, planned_choices
from onnx_partition.runtime.train.trainer import train_plan

PIN = ["--cpu-tflops", "0.05", "--cpu-gbps", "8"]  # the same plan on any machine
PARTS = ("weights_bytes", "grad_bytes", "optimizer_bytes", "activation_bytes", "inflight",
         "buffer_bytes", "memory_bytes")


class Tied(torch.nn.Module):
    """An embedding tied to the head, and a buffer (a constant: no gradient)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(32, 8)
        self.mids = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(2))
        self.head = torch.nn.Linear(8, 32, bias=False)
        self.head.weight = self.emb.weight
        self.register_buffer("scale", torch.full((8,), 0.5))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids) * self.scale
        for mid in self.mids:
            h = torch.relu(mid(h))
        return self.head(h)


@pytest.fixture(scope="module")
def tied(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import onnx_partition

    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tied") / "tied.onnx"
    return onnx_partition.export(Tied(), (torch.zeros(2, 4, dtype=torch.int64),), path,
                                 input_names=["ids"])


def _plan(model: Path, out: Path, *options: str) -> dict:
    argv = ["partition", model, "--batch-size", "2", "--mode", "train", "--microbatches", "4",
            *PIN, *options, "-o", out]
    assert main([str(a) for a in argv]) == 0
    return json.loads((out / "plan.json").read_text())


def _parts(body: dict) -> list[dict]:
    return [{k: s["predicted"][k] for k in PARTS} for s in body["stages"]]


@pytest.mark.parametrize("name", ["gpt", "tied"])
def test_plain_and_cluster_plans_count_memory_alike(name: str, exported, tied: Path,
                                                    tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    model = exported("gpt") if name == "gpt" else tied
    plain = _plan(model, tmp_path / "plain", "--stages", "2")
    cluster = _plan(model, tmp_path / "cluster", "--devices", "2", "--stages", "2")
    capsys.readouterr()
    assert [s["nodes"] for s in plain["stages"]] == [s["nodes"] for s in cluster["stages"]]
    assert [s["replicas"] for s in cluster["stages"]] == [1, 1]
    assert _parts(plain) == _parts(cluster)
    # simulate replays the cluster plan's own count
    assert main(["simulate", str(tmp_path / "cluster"), "--json"]) == 0
    sim = json.loads(capsys.readouterr().out)
    assert [s["memory_bytes"] for s in sim["stages"]] == [p["memory_bytes"]
                                                          for p in _parts(cluster)]


def _initializer_bytes(path: Path) -> dict[str, int]:
    model = onnx.load(str(path), load_external_data=False)
    return {t.name: int(np.prod(t.dims, dtype=np.int64)) * onnx.helper.tensor_dtype_to_np_dtype(
        t.data_type).itemsize for t in model.graph.initializer}


def test_memory_counts_what_each_stage_holds(tied: Path, tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    """Exact parts from the stage files: the tied embedding in both stages (each rank holds
    and trains its copy), the buffer a weight without gradient or optimizer state, the token
    ids (2 x 4 int64) stage 0's received bytes per micro-batch in flight."""
    body = _plan(tied, tmp_path / "p", "--stages", "2")
    capsys.readouterr()
    trainable = set(torch.export.load(str(tied.with_suffix(".pt2"))).graph_signature.parameters)
    assert "scale" not in trainable and "head.weight" in trainable
    held = [_initializer_bytes(tmp_path / "p" / s["file"]) for s in body["stages"]]
    assert all("head.weight" in h for h in held)  # tied (ONNX names it so): both stages
    assert any("scale" in h for h in held)
    for stage, inits in zip(body["stages"], held, strict=True):
        parts = stage["predicted"]
        weights = sum(inits.values())
        grads = sum(b for n, b in inits.items() if n in trainable)
        assert (parts["weights_bytes"], parts["grad_bytes"], parts["optimizer_bytes"]) == (
            weights, grads, 2 * grads)
        if stage["index"] == 0:  # the token ids in flight, and the activations sent on
            assert parts["buffer_bytes"] > parts["inflight"] * 2 * 4 * 8
        else:  # the last stage sends nothing: its buffers are what it received
            assert parts["buffer_bytes"] % parts["inflight"] == 0
        assert parts["memory_bytes"] == (weights + 3 * grads + parts["buffer_bytes"]
                                         + parts["inflight"] * parts["activation_bytes"])


def test_one_rule_for_the_optimizer_precision_and_schedule() -> None:
    recorded = {"optimizer": "adamw", "precision": "bf16", "schedule": "zb-h1"}
    none = dict.fromkeys(TRAIN_FALLBACKS)
    assert planned_choices(recorded, none) == (recorded, None)
    assert planned_choices({}, none) == (TRAIN_FALLBACKS, None)
    # torch pipelining has no ZB-H1: 1F1B, said
    chosen, warning = planned_choices(recorded, none, engine="torch")
    assert chosen["schedule"] == "1f1b" and warning is not None
    chosen, warning = planned_choices(recorded, {**none, "optimizer": "sgd"},
                                      spelled="{key}={value!r}")
    assert chosen == {**recorded, "optimizer": "sgd"}
    assert warning == ("warning: training with optimizer='sgd'; the plan was priced for "
                       "optimizer adamw (plan.json): its predicted time and memory assume those")


def test_train_plan_defaults_to_the_plan(tied: Path, tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    """``train_plan`` leaves optimizer, precision and schedule to the plan (None) and warns,
    before anything runs, when told otherwise; ``steps=0`` stops it there."""
    defaults = inspect.signature(train_plan).parameters
    assert all(defaults[k].default is None for k in TRAIN_FALLBACKS)
    folder = tmp_path / "p"
    _plan(tied, folder, "--stages", "2")
    capsys.readouterr()
    assert read_plan(folder).extra["optimizer"] == "adamw"
    told = r"optimizer='sgd'; the plan was priced for optimizer adamw"
    with pytest.warns(UserWarning, match=told), pytest.raises(PartitionError):
        train_plan(folder, steps=0, optimizer="sgd")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the plan's own choices: no warning
        with pytest.raises(PartitionError):
            train_plan(folder, steps=0)


def test_a_cluster_plan_over_its_memory_says_so(tied: Path, tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    """The planner checks memory on its per-node sums (a tied parameter once, nothing received
    at stage 0); a plan whose stages, counted as they run, exceed the device memory says so."""
    body = _plan(tied, tmp_path / "p", "--devices", "2", "--stages", "2",
                 "--device-memory", "0.0000062")  # 6,200 bytes
    assert "hold more than the device memory" in capsys.readouterr().out
    over = [s["index"] for s in body["stages"] if s["predicted"]["memory_bytes"] > 6200]
    assert over and body["devices_notes"][-1].startswith(
        f"warning: stage(s) {', '.join(map(str, over))} hold more than the device memory")
