"""A step's rows taken a micro-batch at a time (issue 33, :mod:`onnx_partition.runtime.train.
rows`): synthetic rows the same under any split and in any process, a micro-batch reading only
its rows (of a memory map, of an uncompressed ``.npz``), the micro-batch weights counted one
micro-batch at a time equal to the whole batch's."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from onnx_partition.runtime.train.data import ArrayBatches, ArraySource
from onnx_partition.runtime.train.data_plan import synthetic_batch
from onnx_partition.runtime.train.loss import make_loss, microbatch_weights
from onnx_partition.runtime.train.rank_io import microbatch
from onnx_partition.runtime.train.rows import StepRows, batch_rows, batch_shapes

Tensors = dict[str, torch.Tensor]


def _make(rows: int, generator: torch.Generator) -> tuple[Tensors, Tensors]:
    """A batch as a task's ``make_batch`` draws it: an id input, a float input, labels."""
    ids = torch.randint(0, 50, (rows, 3), generator=generator)
    x = torch.randn(rows, 2, generator=generator)
    return {"ids": ids, "x": x}, {"labels": torch.randint(-1, 5, (rows, 3), generator=generator)}


class _Maker:
    """``_make``, recording the rows each call draws."""

    def __init__(self, made: list[int]) -> None:
        self.made = made

    def __call__(self, rows: int, generator: torch.Generator) -> tuple[Tensors, Tensors]:
        self.made.append(rows)
        return _make(rows, generator)


def test_synthetic_rows_are_the_same_under_any_split() -> None:
    inputs, targets = synthetic_batch(_make, 12, 3, 1)
    assert isinstance(inputs, StepRows) and list(inputs) == ["ids", "x"]
    assert batch_rows(inputs) == 12 and batch_shapes(targets) == {
        "labels": ((12, 3), torch.int64)}
    whole = {n: inputs[n] for n in inputs}
    for count in (1, 3, 4, 12):
        for m in range(count):
            lo, hi = m * 12 // count, (m + 1) * 12 // count
            part = microbatch(inputs, m, count)
            assert all(torch.equal(part[n], whole[n][lo:hi]) for n in whole)
    again, _ = synthetic_batch(_make, 12, 3, 1)  # another process draws the same rows
    assert torch.equal(microbatch(again, 2, 4)["x"], whole["x"][6:9])
    other, _ = synthetic_batch(_make, 12, 3, 2)  # another step other rows
    assert not torch.equal(other["x"], whole["x"])
    assert microbatch(inputs, 0, 4, ["x"]).keys() == {"x"}
    with pytest.raises(KeyError):
        microbatch(inputs, 0, 4, ["nope"])


def test_a_microbatch_draws_only_its_rows() -> None:
    made: list[int] = []
    inputs, targets = synthetic_batch(_Maker(made), 32, 0, 0)
    made.clear()  # (the first row, drawn once for the names and shapes)
    microbatch(inputs, 5, 8)
    assert sum(made) == 4  # a micro-batch's 4 rows of the step's 32
    made.clear()
    loss = make_loss("cross_entropy", ["logits"])
    weights = microbatch_weights(loss, targets, 8)  # counted micro-batch by micro-batch
    assert max(made) == 1 and sum(made) == 32
    whole = targets["labels"]
    assert weights == pytest.approx(microbatch_weights(loss, {"labels": whole}, 8))
    assert microbatch_weights(make_loss("mse", ["y"]), targets, 8) == [1 / 8] * 8


@pytest.mark.parametrize("compressed", [False, True])
def test_npz_arrays_are_mapped_when_stored(tmp_path: Path, compressed: bool) -> None:
    ids = np.arange(40 * 3, dtype=np.int64).reshape(40, 3)
    labels = np.asfortranarray(np.arange(40 * 2, dtype=np.float32).reshape(40, 2))
    save = np.savez_compressed if compressed else np.savez
    save(tmp_path / "d.npz", input_ids=ids, labels=labels)
    source = ArraySource(tmp_path / "d.npz")
    assert isinstance(source.array("input_ids"), np.memmap) is not compressed
    np.testing.assert_array_equal(source.array("labels"), labels)
    inputs, targets = ArrayBatches(source, ["input_ids"], ["labels"], 40, 16, None)(2)
    # step 2 takes rows 32..39, 0..7 (wrapping); micro-batch 1 of 4 rows 36..39
    np.testing.assert_array_equal(microbatch(inputs, 1, 4)["input_ids"].numpy(), ids[36:40])
    np.testing.assert_array_equal(microbatch(targets, 3, 4)["labels"].numpy(), labels[4:8])
    assert batch_shapes(inputs) == {"input_ids": ((16, 3), torch.int64)}
