"""``train --data`` and ``--loss``: the order contract, the losses and their micro-batch weights,
a small GPT trained on real text through 2 gloo ranks against single-process training, a model's
own loss, a batch factory with a Python loss, and every refusal of bad data before any process."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from support.data import (
    OwnLoss,
    byte_rows,
    factory_batches,
    recorded_batches,
    twice_the_output,
)

from onnx_partition import export
from onnx_partition.cli import main
from onnx_partition.errors import PartitionError
from onnx_partition.partition import partition
from onnx_partition.plan import read_plan
from onnx_partition.runtime.train.data import (
    ArrayBatches,
    ArraySource,
    check_data,
    rows_read,
    step_rows,
)
from onnx_partition.runtime.train.loss import make_loss, microbatch_weights, resolve_loss
from onnx_partition.runtime.train.modules import whole_module
from onnx_partition.runtime.train.reference import reference_train
from onnx_partition.runtime.train.task import task_for
from onnx_partition.runtime.train.trainer import train_plan

SEQ = 16  # the gpt tiny recipe's sequence length (vocabulary 128)
LR = 0.5  # SGD (AdamW would amplify rounding noise: attention's key bias has a zero gradient)


@pytest.fixture(scope="module")
def gpt_plan(exported: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("data") / "gpt-plan"
    partition(exported("gpt"), 2, out, mode="train", batch_size=2)
    return out


@pytest.fixture(scope="module")
def own_plan(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A model whose only output is its own scalar loss, cut in 2 stages."""
    root = tmp_path_factory.mktemp("own")
    torch.manual_seed(0)
    export(OwnLoss(), (torch.randn(2, 4),), root / "own.onnx", input_names=["x"],
           output_names=["loss"])
    partition(root / "own.onnx", 2, root / "plan", mode="train", batch_size=2)
    return root / "plan"


# ---------------------------------------------------------------- the order contract


def test_step_rows_in_order_wrap_and_shuffle_per_epoch() -> None:
    assert [step_rows(10, 4, s, None).tolist() for s in range(3)] == [
        [0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 0, 1]]
    epoch0 = np.concatenate([step_rows(10, 5, s, 7) for s in (0, 1)])
    epoch1 = np.concatenate([step_rows(10, 5, s, 7) for s in (2, 3)])
    assert sorted(epoch0.tolist()) == sorted(epoch1.tolist()) == list(range(10))
    assert epoch0.tolist() != epoch1.tolist() and epoch0.tolist() != list(range(10))
    assert step_rows(10, 5, 1, 7).tolist() == epoch0[5:].tolist()  # reproducible
    # a step across the epoch boundary: the end of epoch 0's order, then epoch 1's start
    assert step_rows(10, 4, 2, 7).tolist() == [*epoch0[8:].tolist(), *epoch1[:2].tolist()]
    assert rows_read(10, 4, 2, None) is not None
    assert rows_read(10, 4, 2, None).tolist() == list(range(8))  # type: ignore[union-attr]
    assert rows_read(10, 4, 3, None) is None  # every row
    assert rows_read(10, 3, 2, 7).tolist() == sorted(epoch0[:6].tolist())  # type: ignore


def test_npz_and_memory_mapped_folder_give_the_same_rows(tmp_path: Path) -> None:
    ids, labels = byte_rows(10, SEQ)
    np.savez(tmp_path / "d.npz", input_ids=ids, labels=labels)
    (tmp_path / "d").mkdir()
    np.save(tmp_path / "d" / "input_ids.npy", ids)
    np.save(tmp_path / "d" / "labels.npy", labels)
    folder = ArraySource(tmp_path / "d")
    assert isinstance(folder.array("input_ids"), np.memmap)
    assert folder.headers() == ArraySource(tmp_path / "d.npz").headers() == {
        "input_ids": ((10, SEQ), np.dtype(np.int64)), "labels": ((10, SEQ), np.dtype(np.int64))}
    for source in (folder, ArraySource(tmp_path / "d.npz")):
        batches = ArrayBatches(source, ["input_ids"], ["labels"], 10, 4, None)
        inputs, targets = batches(2)
        assert list(inputs) == ["input_ids"] and list(targets) == ["labels"]
        assert inputs["input_ids"].tolist() == ids[[8, 9, 0, 1]].tolist()
        assert targets["labels"].tolist() == labels[[8, 9, 0, 1]].tolist()


# ---------------------------------------------------------------- losses and weights


def test_cross_entropy_weights_make_a_step_equal_one_over_the_concatenation() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 5, 7, generator=gen)
    labels = torch.randint(0, 7, (6, 5), generator=gen)
    labels[0:2] = -100  # micro-batch 0 counts no token at all
    labels[3, :4] = -100
    loss = make_loss("cross_entropy", ["logits"])
    want = F.cross_entropy(logits.reshape(-1, 7), labels.reshape(-1), ignore_index=-100)
    assert float(loss({"logits": logits}, {"labels": labels})) == pytest.approx(float(want))
    weights = microbatch_weights(loss, {"labels": labels}, 3)
    assert weights == pytest.approx([0.0, 6 / 16, 10 / 16])
    got = sum(w * loss({"logits": logits[2 * m:2 * m + 2]}, {"labels": labels[2 * m:2 * m + 2]})
              for m, w in enumerate(weights))
    assert float(got) == pytest.approx(float(want), rel=1e-6)
    mse = make_loss("mse", ["y", "z"])
    y, t = torch.randn(4, 3, generator=gen), torch.randn(4, 3, generator=gen)
    assert microbatch_weights(mse, {"labels": t}, 2) == [0.5, 0.5]
    assert float(mse({"y": y, "z": y}, {"labels": t})) == pytest.approx(
        float(F.mse_loss(y, t)))
    own = make_loss("output", ["loss"])
    assert float(own({"loss": torch.tensor(2.5)}, {})) == 2.5
    assert microbatch_weights(own, {}, 4) == [0.25] * 4


def test_auto_loss() -> None:
    assert resolve_loss("auto", [], None) == "output"
    assert resolve_loss("auto", ["batch", 16, 128], True) == "cross_entropy"
    assert resolve_loss("auto", ["batch", 4], False) == "mse"
    assert resolve_loss("mse", [], True) == "mse"
    with pytest.raises(PartitionError, match="unknown loss 'l1'"):
        resolve_loss("l1", [], None)


# ---------------------------------------------------------------- training on data


def test_gpt_on_python_source_equals_single_process_and_learns(gpt_plan: Path,
                                                               tmp_path: Path) -> None:
    """20 steps of 2 micro-batches x 2 rows through 2 gloo ranks (the data wraps after 6):
    each step's loss equals single-process training on the same rows within 1e-5 relative,
    the first equals cross-entropy over the step's 4 rows computed directly, and it falls."""
    ids, labels = byte_rows(24, SEQ)
    np.savez(tmp_path / "text.npz", input_ids=ids, labels=labels)
    stats = train_plan(gpt_plan, steps=20, microbatches=2, batch_size=2, lr=LR,
                       data=tmp_path / "text.npz", check=True, optimizer="sgd")
    assert stats.mismatches == [] and stats.loss_kind == "cross_entropy"
    assert stats.data.endswith("text.npz (24 rows, in order)")
    assert len(stats.loss) == 20
    rows = [np.arange(4 * s, 4 * s + 4) % 24 for s in range(20)]  # the order contract
    batches = [({"input_ids": torch.from_numpy(ids[r])}, {"labels": torch.from_numpy(labels[r])})
               for r in rows]
    want: list[float] = []
    reference_train(gpt_plan, batches, lr=LR, microbatches=2,
                    task=task_for(gpt_plan, kind="cross_entropy"), losses=want)
    assert stats.loss == pytest.approx(want, rel=1e-5)
    with torch.no_grad():
        (logits,) = whole_module(gpt_plan, deterministic=True)(batches[0][0]["input_ids"])
    first = F.cross_entropy(logits.reshape(-1, 128), batches[0][1]["labels"].reshape(-1),
                            ignore_index=-100)
    assert stats.loss[0] == pytest.approx(float(first), rel=1e-5)
    assert sum(stats.loss[-5:]) < 0.9 * sum(stats.loss[:5])  # 4.85 at first, ~3.7 at the end


def test_own_loss_from_npz_then_factory_with_python_loss(own_plan: Path, tmp_path: Path) -> None:
    """A scalar output is the loss (auto: output), checked against single-process training; a
    batch factory of the same rows with ``loss_fn = 2 x output`` gives twice the first loss
    (both checked against single-process training on the same batches)."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((10, 4)).astype(np.float32)
    np.savez(tmp_path / "x.npz", x=x)
    stats = train_plan(own_plan, steps=3, microbatches=2, batch_size=2, lr=0.01,
                       data=tmp_path / "x.npz", check=True, optimizer="sgd")
    assert stats.mismatches == [] and stats.loss_kind == "output"
    factory = functools.partial(factory_batches, {"x": x}, 4)
    doubled = train_plan(own_plan, steps=3, microbatches=2, batch_size=2, lr=0.01, data=factory,
                         loss_fn=twice_the_output, check=True, optimizer="sgd")
    assert doubled.mismatches == [] and doubled.loss_kind == "custom"
    assert doubled.data == "batches from the data factory"
    assert doubled.loss[0] == pytest.approx(2 * stats.loss[0], rel=1e-6)


def test_only_the_first_and_last_stage_read_data(exported: Callable[..., Path],
                                                 tmp_path: Path) -> None:
    """3 stages: the factory is called in 2 ranks (stage 0 and stage 2) and the parent
    (``--loss auto`` peeks at the first batch), never in the middle stage."""
    partition(exported("gpt"), 3, tmp_path / "plan3", mode="train", batch_size=2)
    ids, labels = byte_rows(8, SEQ)
    calls = tmp_path / "calls"
    calls.mkdir()
    factory = functools.partial(recorded_batches, calls, {"input_ids": ids, "labels": labels},
                                4)
    stats = train_plan(tmp_path / "plan3", steps=1, microbatches=2, batch_size=2, data=factory)
    assert stats.loss_kind == "cross_entropy" and len(stats.ranks) == 3
    assert len([p for p in calls.iterdir() if p.name != str(os.getpid())]) == 2


def test_validation_loss_is_over_every_whole_step_of_the_eval_data(gpt_plan: Path,
                                                                     tmp_path: Path) -> None:
    """Training data given as a mapping of arrays; --eval-data of 14 rows at 4 rows a step:
    the validation loss after step 1 is the mean of its 3 whole steps' cross-entropy (rows
    0-11; rows 12-13 left out), under the parameters single-process training reaches after the
    same step (not the first step's rows alone)."""
    ids, labels = byte_rows(30, SEQ)
    np.savez(tmp_path / "valid.npz", input_ids=ids[16:], labels=labels[16:])
    stats = train_plan(gpt_plan, steps=1, microbatches=2, batch_size=2, lr=LR,
                       data={"input_ids": ids[:16], "labels": labels[:16]},
                       eval_data=tmp_path / "valid.npz", eval_every=1, optimizer="sgd",
                       check=True)
    assert stats.mismatches == [] and stats.data == "the arrays given (16 rows, in order)"
    batch = ({"input_ids": torch.from_numpy(ids[:4])}, {"labels": torch.from_numpy(labels[:4])})
    trained = reference_train(gpt_plan, [batch], lr=LR, microbatches=2,
                              task=task_for(gpt_plan, kind="cross_entropy"))
    whole = whole_module(gpt_plan, deterministic=True)
    with torch.no_grad():
        for name, param in whole.named_parameters():
            param.copy_(trained[name])
        losses = []
        for k in range(3):
            rows = slice(16 + 4 * k, 20 + 4 * k)
            (logits,) = whole(torch.from_numpy(ids[rows]))
            losses.append(float(F.cross_entropy(logits.reshape(-1, 128),
                                                torch.from_numpy(labels[rows]).reshape(-1),
                                                ignore_index=-100)))
    assert [s for s, _ in stats.eval_loss] == [1]
    assert stats.eval_loss[0][1] == pytest.approx(sum(losses) / 3, rel=1e-5)
    assert stats.eval_loss[0][1] != pytest.approx(losses[0], rel=1e-3)


# ---------------------------------------------------------------- bad input


def _gpt_data(tmp_path: Path, **change: np.ndarray) -> Path:
    ids, labels = byte_rows(8, SEQ)
    arrays = {"input_ids": ids, "labels": labels, **change}
    path = tmp_path / "bad.npz"
    np.savez(path, **{k: v for k, v in arrays.items() if v.size})
    return path


@pytest.mark.parametrize(("change", "options", "message"), [
    ({"input_ids": np.zeros(0)}, [], "no array 'input_ids' (a model input)"),
    ({"input_ids": np.zeros((8, SEQ), np.int32)}, [], "is int32, the model input is int64"),
    ({"input_ids": np.zeros((8, 8), np.int64)}, [], "has shape [8, 8]; the input wants [rows, 16]"),
    ({"labels": np.zeros((8, SEQ), np.int64)}, ["--microbatches", "8"],
     "8 rows, fewer than one step's 16"),
    ({"labels": np.full((8, SEQ), 128)}, [], "labels outside the vocabulary 0..127"),
    ({"input_ids": np.full((8, SEQ), 128)}, [], "holds ids outside 0..127, the rows of the "
                                                "table it indexes (tok.weight)"),
    ({"input_ids": np.full((8, SEQ), -1)}, [], "holds ids outside 0..127"),
    ({"labels": np.zeros((8, SEQ), np.float32)}, ["--loss", "cross_entropy"],
     "cross-entropy takes integer labels"),
    ({"labels": np.zeros((7, SEQ), np.int64)}, [], "disagree on the rows"),
    ({"labels": np.zeros(0)}, [], "no array 'labels' (nor one named as an output: logits) to "
                                  "train against"),
    ({"labels": np.zeros(0)}, ["--loss", "mse"], "no array 'labels' (nor one named as an output:"
                                                 " logits) for --loss mse"),
])
def test_bad_data_refused_before_any_process(gpt_plan: Path, tmp_path: Path,
                                             capfd: pytest.CaptureFixture[str],
                                             change: dict[str, np.ndarray], options: list[str],
                                             message: str) -> None:
    data = _gpt_data(tmp_path, **change)
    saved = tmp_path / "out"
    code = main(["train", str(gpt_plan), "--data", str(data), "--batch-size", "2",
                 "--microbatches", "2", "--save", str(saved), *options])
    err = capfd.readouterr().err
    assert code == 2, err
    assert err.startswith("error: ") and len(err.splitlines()) == 1 and message in err, err
    assert not saved.exists()


def test_bad_paths_and_options_refused(gpt_plan: Path, tmp_path: Path,
                                       capfd: pytest.CaptureFixture[str]) -> None:
    model = (gpt_plan / read_plan(gpt_plan).model).resolve()
    before = sorted(p.name for p in gpt_plan.iterdir())
    model_bytes = model.read_bytes()
    for options, message in (
            (["--save", str(gpt_plan / "trained")], "inside the plan folder"),
            (["--save", str(model)], "that is the plan's model file"),
            (["--checkpoint-dir", str(gpt_plan / "ckpt"), "--checkpoint-every", "1"],
             "--checkpoint-dir {}: inside the plan folder".format(gpt_plan / "ckpt")),
            (["--checkpoint-dir", str(model), "--checkpoint-every", "1"],
             "exists and is not a folder"),
            (["--shuffle", "3"], "--shuffle orders the rows of --data; there is no --data"),
            (["--data", str(tmp_path / "none.npz")], "no such file or folder"),
            (["--data", str(model)], "expected a .npz file or a folder of .npy")):
        assert main(["train", str(gpt_plan), *options]) == 2
        err = capfd.readouterr().err
        assert err.startswith("error: ") and len(err.splitlines()) == 1 and message in err, err
    assert sorted(p.name for p in gpt_plan.iterdir()) == before
    assert model.read_bytes() == model_bytes


def test_auto_loss_and_targets_from_the_data(gpt_plan: Path) -> None:
    """auto: integer labels -> cross-entropy; float targets -> mse; a target may be named as
    the output instead of ``labels``."""
    plan = read_plan(gpt_plan)
    ids, labels = byte_rows(8, SEQ)
    floats = np.zeros((8, SEQ, 128), np.float32)
    for arrays, want in (({"labels": labels}, ("cross_entropy", ["labels"])),
                         ({"logits": labels}, ("cross_entropy", ["logits"])),
                         ({"labels": floats}, ("mse", ["labels"])),
                         ({"logits": floats}, ("mse", ["logits"]))):
        info = check_data(plan, ArraySource({"input_ids": ids, **arrays}), per_step=4, steps=2,
                          shuffle=None, loss="auto")
        assert (info.loss, info.targets, info.rows) == (*want, 8)
    with pytest.raises(PartitionError, match=r"'labels' has shape \[8, 16\]; the target of "
                                             r"'logits' wants \[rows, 16, 128\]"):
        check_data(plan, ArraySource({"input_ids": ids, "labels": labels.astype(np.float32)}),
                   per_step=4, steps=2, shuffle=None, loss="auto")


def test_nan_refused_only_in_the_rows_the_run_reads(own_plan: Path, tmp_path: Path,
                                                    capfd: pytest.CaptureFixture[str]) -> None:
    x = np.zeros((40, 4), np.float32)
    x[30, 2] = np.nan
    np.save(tmp_path / "x.npy", x)  # a folder of .npy: memory-mapped, scanned in chunks
    plan = read_plan(own_plan)
    source = ArraySource(tmp_path)
    info = check_data(plan, source, per_step=4, steps=7, shuffle=None, loss="auto")
    assert (info.loss, info.targets, info.rows) == ("output", [], 40)
    with pytest.raises(PartitionError, match="'x' holds NaN in the rows this run reads"):
        check_data(plan, source, per_step=4, steps=8, shuffle=None, loss="auto")
    read = rows_read(40, 4, 2, 5)
    assert read is not None
    verdict = 30 in read.tolist()
    try:
        check_data(plan, source, per_step=4, steps=2, shuffle=5, loss="auto")
        refused = False
    except PartitionError:
        refused = True
    assert refused == verdict
    assert main(["train", str(own_plan), "--data", str(tmp_path), "--steps", "8",
                 "--batch-size", "2", "--microbatches", "2"]) == 2
    err = capfd.readouterr().err
    assert err.startswith("error: ") and len(err.splitlines()) == 1 and "NaN" in err


def test_a_factory_run_resumes_where_it_stopped(own_plan: Path, tmp_path: Path) -> None:
    """Issue 35's review finding: a run fed by a data factory, resumed from its checkpoint at
    step 2, reads the factory's batches 3 and 4 (it skips the first two) and continues as the
    uninterrupted run: the same losses (it used to fail inside the ranks, "asked for step 3
    after step 0")."""
    x = np.random.default_rng(1).standard_normal((10, 4)).astype(np.float32)
    factory = functools.partial(factory_batches, {"x": x}, 4)
    common: dict = dict(microbatches=2, batch_size=2, lr=0.01, data=factory,
                        optimizer="adamw")
    straight = train_plan(own_plan, steps=4, **common)
    train_plan(own_plan, steps=2, checkpoint_dir=tmp_path / "ck", checkpoint_every=2, **common)
    resumed = train_plan(own_plan, steps=4, resume=tmp_path / "ck", **common)
    assert resumed.loss == pytest.approx(straight.loss[2:], rel=1e-6)
