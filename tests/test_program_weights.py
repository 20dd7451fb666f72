"""A model exported with external data keeps its weights once, in ``model.onnx.data``: the
program ``model.pt2`` holds meta tensors and a manifest, and :func:`load_program` reads them
back, so the program, its stage modules and training equal those of the old layout (weights
inside the program), which still loads."""

from __future__ import annotations

import shutil
import zipfile
from pathlib import Path

import pytest
import torch
from support.hf import build_hf, hf_example
from support.training import own_loss_task

from onnx_partition import export
from onnx_partition.cli.verbs import main
from onnx_partition.errors import PartitionError
from onnx_partition.graph.export import weight_bytes
from onnx_partition.graph.program import MANIFEST_KEY, load_program
from onnx_partition.partition import partition
from onnx_partition.runtime.train.data_plan import synthetic_batch
from onnx_partition.runtime.train.reference import reference_train


@pytest.fixture(scope="module")
def layouts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """GPT-2 (tied embeddings) with labels, exported in the old layout (weights inline in the
    ONNX file and in the program) and the new (weights only in ``.onnx.data``)."""
    root = tmp_path_factory.mktemp("layouts")
    args, kwargs = hf_example("gpt2")
    return {kind: export(build_hf("gpt2"), args, root / kind / "g.onnx", kwargs=kwargs,
                         external_data=kind == "new")
            for kind in ("old", "new")}


def _tensor_bytes(program: Path) -> int:
    """Bytes of the tensors stored in a .pt2 archive."""
    with zipfile.ZipFile(program) as archive:
        return sum(i.file_size for i in archive.infolist()
                   if "/data/weights/weight_" in i.filename or "/data/constants/tensor_"
                   in i.filename)


def test_the_weights_are_written_once(layouts: dict[str, Path]) -> None:
    weights = weight_bytes(build_hf("gpt2"))
    old, new = layouts["old"].with_suffix(".pt2"), layouts["new"].with_suffix(".pt2")
    assert _tensor_bytes(old) >= weights
    assert _tensor_bytes(new) < weights / 100  # meta tensors: no data
    data = layouts["new"].with_name("g.onnx.data")
    assert data.stat().st_size >= 0.9 * weights  # buffers left out of the graph aside
    with zipfile.ZipFile(new) as archive:
        assert any(n.endswith(MANIFEST_KEY) for n in archive.namelist())
    with zipfile.ZipFile(old) as archive:
        assert not any(n.endswith(MANIFEST_KEY) for n in archive.namelist())


def _storage_groups(table: dict[str, torch.Tensor]) -> list[list[str]]:
    groups: dict[int, list[str]] = {}
    for name, tensor in table.items():
        groups.setdefault(tensor.untyped_storage().data_ptr(), []).append(name)
    return sorted(sorted(g) for g in groups.values())


def test_the_program_loads_as_the_old_layout_does(layouts: dict[str, Path]) -> None:
    old = load_program(layouts["old"].with_suffix(".pt2"))  # no manifest: as torch loads it
    new = load_program(layouts["new"].with_suffix(".pt2"))
    assert torch.export.load(str(layouts["new"].with_suffix(".pt2"))).state_dict[
        "lm_head.weight"].is_meta
    for table in ("state_dict", "constants"):
        want, got = getattr(old, table), getattr(new, table)
        assert sorted(want) == sorted(got)
        for name, tensor in want.items():
            assert type(got[name]) is type(tensor) and got[name].dtype == tensor.dtype
            assert torch.equal(got[name], tensor), name
            assert got[name].requires_grad == tensor.requires_grad, name
    assert _storage_groups(new.state_dict) == _storage_groups(old.state_dict)  # tied: shared
    assert ["lm_head.weight", "transformer.wte.weight"] in _storage_groups(new.state_dict)


def test_training_numbers_equal_the_old_layouts(layouts: dict[str, Path], tmp_path: Path
                                                ) -> None:
    trained = {}
    for kind, model in layouts.items():
        plan_dir = tmp_path / kind
        partition(model, 2, plan_dir, mode="train", batch_size=2, ordering="topo")
        task = own_loss_task(plan_dir)
        batches = [synthetic_batch(task.make_batch, 4, 0, s) for s in range(2)]
        trained[kind] = reference_train(plan_dir, batches, lr=0.05, microbatches=2, task=task)
    assert sorted(trained["old"]) == sorted(trained["new"])
    for name, value in trained["old"].items():
        assert torch.equal(trained["new"][name], value), name


def test_a_program_without_its_weights_file_is_one_line(layouts: dict[str, Path],
                                                        tmp_path: Path) -> None:
    alone = tmp_path / "g.pt2"
    shutil.copy(layouts["new"].with_suffix(".pt2"), alone)
    with pytest.raises(PartitionError, match=r"g\.onnx, which is missing beside it"):
        load_program(alone)
    shutil.copy(layouts["new"], tmp_path / "g.onnx")
    data = layouts["new"].with_name("g.onnx.data").read_bytes()
    (tmp_path / "g.onnx.data").write_bytes(data[: len(data) // 2])
    with pytest.raises(PartitionError, match="too short") as info:
        load_program(alone)
    assert "\n" not in str(info.value)


def test_a_program_that_is_no_archive_is_one_line_and_exit_2(
        layouts: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = tmp_path / "g.onnx"
    shutil.copy(layouts["old"], model)
    model.with_suffix(".pt2").write_text("not a program")
    code = main(["partition", str(model), "--stages", "2", "--mode", "train", "--analytic",
                 "--batch-size", "2", "-o", str(tmp_path / "plan")])
    err = capsys.readouterr().err
    assert code == 2
    assert err.strip().splitlines() == [f"error: could not read program {tmp_path / 'g.pt2'}: "
                                        "BadZipFile"]
    assert not (tmp_path / "plan").exists()


def test_a_trained_plan_keeps_its_weights_once(layouts: dict[str, Path], tmp_path: Path
                                               ) -> None:
    """``train --save`` (save_trained) of a model with external data: the trained program
    refers to the trained whole model's initializers, as the export does, and loads the
    trained values (tied weights shared again)."""
    from onnx_partition.runtime.train.modules import stage_modules, whole_module
    from onnx_partition.runtime.train.save import save_trained

    plan_dir = tmp_path / "plan"
    partition(layouts["new"], 2, plan_dir, mode="train", batch_size=2, ordering="topo")
    stages = stage_modules(plan_dir)
    with torch.no_grad():
        for stage in stages:  # a step that keeps tied copies equal, as training does
            for parameter in stage.module.parameters():
                parameter.mul_(1.5).add_(0.25)
    out = save_trained(plan_dir, [s.module.state_dict() for s in stages], tmp_path / "trained")
    weights = weight_bytes(build_hf("gpt2"))
    assert _tensor_bytes(out / "g.pt2") < weights / 100
    trained = {n: v for s in stages for n, v in s.module.state_dict().items()}
    program = load_program(out / "g.pt2")
    assert ["lm_head.weight", "transformer.wte.weight"] in _storage_groups(program.state_dict)
    for name, value in dict(whole_module(out).named_parameters()).items():
        torch.testing.assert_close(value, trained[name], rtol=0, atol=0)
