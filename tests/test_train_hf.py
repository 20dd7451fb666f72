"""Hugging Face GPT-2 (tied embeddings), BERT, Llama and ViT, built from tiny configs with
random weights (no downloads) and exported as they are (``ModelOutput``, cache on) through
onnx_partition.export: stage modules of 2- and 3-stage train plans chained equal the whole
program, forward and gradients, and training over gloo equals one process; with ``labels`` as
an input, the model's own loss (its first output) trains the same way."""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from pathlib import Path

import onnx
import pytest
import torch
from support.hf import HF_MODELS, build_hf, hf_example
from support.training import (
    assert_stages_equal_whole,
    assert_stages_run_on_meta,
    own_loss_job,
    own_loss_task,
    rank_run,
    train_checked,
)

from onnx_partition import export
from onnx_partition.errors import PartitionError
from onnx_partition.partition import partition
from onnx_partition.runtime.train.data_plan import synthetic_batch
from onnx_partition.runtime.train.modules import lazy_stages, stage_modules, whole_module
from onnx_partition.runtime.train.reference import reference_train
from onnx_partition.runtime.train.spawn import launch_training

HF = Callable[..., Path]


def _io(model: Path) -> tuple[list[str], list[str]]:
    proto = onnx.load(str(model), load_external_data=False)
    return [i.name for i in proto.graph.input], [o.name for o in proto.graph.output]


@pytest.mark.parametrize("name", HF_MODELS)
def test_model_outputs_flattened_to_named_tensors(name: str, hf_exported: HF) -> None:
    inputs = "pixel_values" if name == "vit" else "input_ids"
    assert _io(hf_exported(name)) == ([inputs], ["logits"])
    if name in ("gpt2", "vit"):
        assert _io(hf_exported(name, labels=True)) == ([inputs, "labels"], ["loss", "logits"])


def test_cache_turned_off_with_one_note(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    model = build_hf("gpt2")
    assert model.config.use_cache
    args, _ = hf_example("gpt2")
    export(model, args, tmp_path / "g.onnx")
    err = capfd.readouterr().err
    assert err.count("\n") == 1 and "use_cache=False" in err, err
    assert model.config.use_cache  # restored


class DataDependent(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x if bool(x.sum() > 0) else -x


class CacheOut(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> dict[str, object]:
        return {"y": x * 2, "cache": object()}


@pytest.mark.parametrize("module, says", [
    (DataDependent(), "cannot export DataDependent: "),
    (CacheOut(), "output 'cache' of CacheOut is a object, not a tensor"),
])
def test_export_errors_are_one_line(module: torch.nn.Module, says: str, tmp_path: Path) -> None:
    with pytest.raises(PartitionError) as info:
        export(module, (torch.randn(2, 3),), tmp_path / "m.onnx")
    text = str(info.value)
    assert says in text and "\n" not in text and not re.search(r"\x1b", text), text
    assert list(tmp_path.iterdir()) == []  # nothing written


@pytest.mark.parametrize("stages", [2, 3])
@pytest.mark.parametrize("name", HF_MODELS)
def test_hf_stage_modules_equal_whole(name: str, stages: int, hf_exported: HF,
                                      tmp_path: Path) -> None:
    plan = partition(hf_exported(name), stages, tmp_path / "plan", mode="train", batch_size=2,
                     ordering="topo")
    assert_stages_equal_whole(tmp_path / "plan")
    if stages == 3:
        assert_stages_run_on_meta(tmp_path / "plan")
    if name == "gpt2":  # lm_head is wte: one parameter, held by the first and last stages
        tied = stage_modules(tmp_path / "plan")[0].tied
        assert tied == {"transformer.wte.weight": (0, len(plan.stages) - 1)}
        # a training rank's stages: every stage's ties known, only the module read is built
        lazy = lazy_stages(tmp_path / "plan")
        assert [s.tied for s in lazy] == [s.tied for s in stage_modules(tmp_path / "plan")]
        assert lazy[-1].module is lazy[-1].module
        assert [s.built is not None for s in lazy] == [False] * (stages - 1) + [True]


@pytest.mark.parametrize("name", HF_MODELS)
def test_hf_trains_over_gloo_like_one_process(name: str, hf_exported: HF,
                                              tmp_path: Path) -> None:
    """2 stages, 2 ranks, 2 SGD steps: every rank's parameters (GPT-2's tied ``wte`` summed
    across its first and last stage) equal single-process training."""
    train_checked(hf_exported(name), tmp_path / "plan", 2, ordering="topo")


@pytest.mark.parametrize("name", ["gpt2", "vit"])
def test_own_loss_stages_equal_whole(name: str, hf_exported: HF, tmp_path: Path) -> None:
    """With labels an input, the first output is the model's scalar loss: the whole module and
    the chained stages compute it equal (and its gradients), and it is the loss a Hugging Face
    model computes itself."""
    plan_dir = tmp_path / "plan"
    partition(hf_exported(name, labels=True), 3, plan_dir, mode="train", batch_size=2,
              ordering="topo")
    task = own_loss_task(plan_dir)
    assert_stages_equal_whole(plan_dir, task=task)
    inputs, _ = task.make_batch(2, torch.Generator().manual_seed(1))
    model = build_hf(name).eval()  # dropout off, as deterministic stages have it
    feeds = {k: inputs[k] for k in ("input_ids", "pixel_values", "labels") if k in inputs}
    want = model(**feeds).loss
    got = whole_module(plan_dir, deterministic=True)(*feeds.values())[0]
    assert got.shape == () and torch.allclose(got, want, rtol=1e-5), (got, want)


def test_own_loss_trains_over_gloo_like_one_process(hf_exported: HF, tmp_path: Path) -> None:
    """GPT-2 given labels, 2 stages on gloo, 2 SGD steps of 2 micro-batches on its own loss
    (each micro-batch weighted 1/M): every rank's parameters equal single-process training."""
    plan_dir = tmp_path / "plan"
    plan = partition(hf_exported("gpt2", labels=True), 2, plan_dir, mode="train", batch_size=2,
                     ordering="topo")
    rows, seed = 4, 0
    job = functools.partial(own_loss_job, str(plan_dir), rows, seed, True)
    config = rank_run(steps=2, microbatches=2, lr=0.05, check_steps=(2,))
    results = launch_training(plan, job, config, timeout_s=60)
    task = own_loss_task(plan_dir)
    batches = [synthetic_batch(task.make_batch, rows, seed, s) for s in range(2)]
    want = reference_train(plan_dir, batches, lr=0.05, microbatches=2, task=task)
    first = whole_module(plan_dir, deterministic=True)
    for result in results:
        for name, got in result.states[2].items():
            torch.testing.assert_close(got, want[name], rtol=1e-4, atol=1e-6)
            assert not torch.equal(got, dict(first.named_parameters())[name]), name  # trained
    inputs = batches[0][0]  # step 1's loss: the mean of the micro-batches' own losses
    own = [first(*[inputs[s.name][lo:hi] for s in plan.inputs])[0] for lo, hi in ((0, 2), (2, 4))]
    assert results[0].loss[0] == pytest.approx(float(sum(own).detach()) / 2, rel=1e-5)


def test_run_check_of_a_model_computing_its_own_loss(hf_exported: HF, tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """``run --check`` of GPT-2 given labels: its scalar loss has no batch axis, so the pipeline
    returns the first micro-batch's; the whole model is run per micro-batch too and the check
    passes (it compared the whole batch's loss before: 1.2e-2, a false MISMATCH)."""
    from onnx_partition.cli import main

    partition(hf_exported("gpt2", labels=True), 2, tmp_path / "plan", batch_size=2)
    assert main(["run", str(tmp_path / "plan"), "--check", "--iterations", "1",
                 "--microbatches", "4"]) == 0
    assert "(OK)" in capsys.readouterr().out


@pytest.mark.parametrize("name", ["gpt2", "bert", "llama"])
def test_a_language_models_ids_are_bounded_by_its_vocabulary(name: str, hf_exported: HF
                                                              ) -> None:
    """Hugging Face indexes its embedding with ``input_ids.view(-1, n)``: the bound follows the
    reshape to the Gather, so synthetic ids span the vocabulary (not ``[0, 2)``) and
    ``--loss auto`` without data is cross-entropy over it (was mean squared error against
    random logits)."""
    from support.hf import VOCAB

    from onnx_partition.graph import load
    from onnx_partition.graph.emit import io_specs
    from onnx_partition.runtime.train.task import auto_kind

    inputs, outputs = io_specs(load(hf_exported(name), batch_size=2))
    assert inputs[0].name == "input_ids" and inputs[0].high == VOCAB
    assert auto_kind(inputs, outputs) == "cross_entropy"
