"""Issue 37: nothing the tool reads as data runs code. A crafted pickle in a checkpoint (format 1)
exits 2 naming the file before any rank starts and never runs; crafted safetensors headers, an
.npz holding an object array and a program outside its plan's folders exit 2 in one line; a
format-1 checkpoint of plain data still resumes (as data); a checkpoint written under a 2-stage
plan resumes under a 3-stage plan of the same model."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from support.checkpoints import rank_params, rank_tensors

from onnx_partition.cli import main
from onnx_partition.errors import PartitionError
from onnx_partition.fileio import sha256_file
from onnx_partition.plan import read_plan
from onnx_partition.runtime.train.checkpoint import (
    LEGACY_FORMAT,
    legacy_rank_file,
    plan_fingerprint,
)
from onnx_partition.runtime.train.modules import stage_modules
from onnx_partition.runtime.train.trainer import train_plan
from onnx_partition.safe_tensors import check_safetensors, read_tensors

COMMON = ["--microbatches", "2", "--batch-size", "2"]
# a constant schedule after warm-up: the first 4 steps of an 8-step run are a 4-step run's; lr 1e-3
# (issue 35's): at 1e-2 AdamW turns the float re-association of another cut into 2e-5 even
# between two uninterrupted runs of the 2- and 3-stage plans
ADAMW = dict(optimizer="adamw", lr=1e-3, warmup_steps=1, lr_schedule="constant")


@pytest.fixture(scope="module")
def plans(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """gpt tiny with its program, partitioned for training into 2 and into 3 stages."""
    root = tmp_path_factory.mktemp("trusted")
    assert main(["export", "gpt", "--size", "tiny", "-o", str(root / "gpt.onnx")]) == 0
    for n in (2, 3):
        assert main(["partition", str(root / "gpt.onnx"), "--stages", str(n), "--mode",
                     "train", "--batch-size", "2", "-o", str(root / f"plan{n}")]) == 0
    return root / "plan2", root / "plan3"


@pytest.fixture(scope="module")
def checkpoint(plans: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """2 steps on the 2-stage plan, a checkpoint after each."""
    out = tmp_path_factory.mktemp("ckpt") / "ck"
    train_plan(plans[0], steps=2, microbatches=2, batch_size=2, checkpoint_dir=out,
               checkpoint_every=1)
    return out


class _Touch:
    """Unpickling it would create a file (``open(path, "w")``)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (str(self.path), "w"))


def _legacy(src: Path, dst: Path, plan_dir: Path, rank_body: Any = None) -> Path:
    """A format-1 checkpoint (one torch.save per rank, as 5a71b85 wrote it) made from the
    format-2 checkpoint ``src``; ``rank_body`` replaces rank 0's file (its sha256 updated in
    the manifest, as anyone who can write the folder can)."""
    folder = dst / "step-00000002"
    folder.mkdir(parents=True)
    manifest = json.loads((src / "step-00000002" / "manifest.json").read_text())
    names = {s.index: list(dict(s.module.named_parameters()))  # the optimizer's order
             for s in stage_modules(plan_dir)}
    ranks = []
    group = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))]).state_dict()["param_groups"][0]
    for r in (0, 1):
        t = rank_tensors(src / "step-00000002", r)
        params = names[r]
        state = {i: {k.rsplit("/", 1)[1]: v for k, v in t.items()
                     if k.startswith(f"optim/{n}/")} for i, n in enumerate(params)}
        body = {"module": {n: t[f"module/{n}"] for n in names[r]},
                "optimizer": {"state": state, "param_groups": [
                    dict(group, params=list(range(len(params))))]},
                "rng": t["rng/cpu"], "cuda_rng": None}
        path = legacy_rank_file(folder, r)
        torch.save(rank_body if (r == 0 and rank_body is not None) else body, path)
        ranks.append({"rank": r, "stage": r, "replica": 0, "file": path.name,
                      "sha256": sha256_file(path)})
    old = {k: manifest[k] for k in ("step", "steps", "data_position", "rows_per_step",
                                    "checkpoint_every", "optimizer", "eval_loss")}
    old.update(format=LEGACY_FORMAT, plan=plan_fingerprint(read_plan(plan_dir)),
               plan_dir=str(plan_dir), ranks=ranks)
    (folder / "manifest.json").write_text(json.dumps(old))
    return dst


def _one_line_exit_2(argv: list[str], capfd: pytest.CaptureFixture[str], *words: str) -> str:
    assert main(argv) == 2
    err = capfd.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: "), err
    for word in words:
        assert word in err, err
    return err


def test_a_crafted_pickle_in_a_checkpoint_never_runs(
        plans: tuple[Path, Path], checkpoint: Path, tmp_path: Path,
        capfd: pytest.CaptureFixture[str]) -> None:
    marker = tmp_path / "ran"
    crafted = _legacy(checkpoint, tmp_path / "crafted", plans[0], rank_body=_Touch(marker))
    rank0 = legacy_rank_file(crafted / "step-00000002", 0)
    _one_line_exit_2(["train", str(plans[0]), "--steps", "3", *COMMON, "--resume",
                      str(crafted)], capfd, str(rank0), "not plain data")
    assert not marker.exists()
    # the same pickle in place of a format-2 rank file, its sha256 written into the manifest
    current = tmp_path / "current"
    shutil.copytree(checkpoint, current)
    folder = current / "step-00000002"
    torch.save(_Touch(marker), folder / "rank-00000.safetensors")
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["ranks"][0]["sha256"] = sha256_file(folder / "rank-00000.safetensors")
    (folder / "manifest.json").write_text(json.dumps(manifest))
    _one_line_exit_2(["train", str(plans[0]), "--steps", "3", *COMMON, "--resume",
                      str(current)], capfd, "rank-00000.safetensors: not a valid safetensors")
    assert not marker.exists()


def test_a_plain_data_format_1_checkpoint_resumes_as_before(
        plans: tuple[Path, Path], checkpoint: Path, tmp_path: Path) -> None:
    """A format-1 checkpoint (tensors, numbers, strings only) resumes on its own plan, read
    with weights_only=True, to the same parameters as the format-2 checkpoint it was made
    from; on another plan it is refused."""
    old = _legacy(checkpoint, tmp_path / "old", plans[0])
    with pytest.raises(PartitionError, match="only on its own plan"):
        train_plan(plans[1], steps=3, microbatches=2, batch_size=2, resume=old)
    new = tmp_path / "new"
    shutil.copytree(checkpoint, new)
    for folder in (old, new):
        train_plan(plans[0], steps=3, microbatches=2, batch_size=2, resume=folder)
    a, b = rank_params(old / "step-00000003", 1), rank_params(new / "step-00000003", 1)
    for name in b:
        torch.testing.assert_close(a[name], b[name], rtol=0, atol=0, msg=name)


def _safetensors(path: Path, header: dict[str, Any], data: bytes, length: int | None = None
                 ) -> Path:
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text) if length is None else length) + text + data)
    return path


@pytest.mark.parametrize("case, why", [
    ("oversized", "header length"),
    ("overlapping", "overlaps"),
    ("out of range", "outside the file"),
    ("unknown dtype", "unknown dtype"),
])
def test_a_crafted_safetensors_header_is_one_line(
        plans: tuple[Path, Path], checkpoint: Path, tmp_path: Path,
        capfd: pytest.CaptureFixture[str], case: str, why: str) -> None:
    """Checked before any tensor is read: by check_safetensors directly, and in a checkpoint
    whose rank file was replaced (its sha256 updated in the manifest) by `train --resume`."""
    f32 = {"dtype": "F32", "shape": [2]}
    header = {"a": dict(f32, data_offsets=[0, 8]), "b": dict(f32, data_offsets=[8, 16])}
    length = None
    if case == "oversized":
        length = 1 << 40
    elif case == "overlapping":
        header["b"]["data_offsets"] = [4, 12]
    elif case == "out of range":
        header["b"]["data_offsets"] = [1000, 1008]
    else:
        header["b"]["dtype"] = "F128"
    bad = _safetensors(tmp_path / "bad.safetensors", header, bytes(16), length)
    with pytest.raises(PartitionError, match=why):
        check_safetensors(bad)
    with pytest.raises(PartitionError, match=why):
        read_tensors(bad)
    crafted = tmp_path / "ck"
    shutil.copytree(checkpoint, crafted)
    folder = crafted / "step-00000002"
    shutil.copy(bad, folder / "rank-00001.safetensors")
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["ranks"][1]["sha256"] = sha256_file(bad)
    (folder / "manifest.json").write_text(json.dumps(manifest))
    _one_line_exit_2(["train", str(plans[0]), "--steps", "3", *COMMON, "--resume",
                      str(crafted)], capfd, "rank-00001.safetensors", why)


def test_a_changed_checkpoint_file_is_refused(plans: tuple[Path, Path], checkpoint: Path,
                                              tmp_path: Path,
                                              capfd: pytest.CaptureFixture[str]) -> None:
    crafted = tmp_path / "ck"
    shutil.copytree(checkpoint, crafted)
    with open(crafted / "step-00000002" / "rank-00000.safetensors", "r+b") as handle:
        handle.seek(-1, 2)
        handle.write(b"\x01")
    _one_line_exit_2(["train", str(plans[0]), "--steps", "3", *COMMON, "--resume",
                      str(crafted)], capfd, "does not match its sha256")
    shutil.rmtree(crafted)
    shutil.copytree(checkpoint, crafted)
    manifest_file = crafted / "step-00000002" / "manifest.json"
    good = json.loads(manifest_file.read_text())
    key = next(iter(good["tensors"]))
    for change, said in ((lambda m: m["ranks"][0].update(rank="zero"), "malformed manifest"),
                         (lambda m: m["tensors"][key].update(file="../../elsewhere"),
                          "tensor index names tensors its files do not hold")):
        body = json.loads(json.dumps(good))
        change(body)
        manifest_file.write_text(json.dumps(body))
        _one_line_exit_2(["train", str(plans[0]), "--steps", "3", *COMMON, "--resume",
                          str(crafted)], capfd, said)


def test_an_npz_holding_objects_is_one_line(plans: tuple[Path, Path], tmp_path: Path,
                                            capfd: pytest.CaptureFixture[str]) -> None:
    data = tmp_path / "data.npz"
    np.savez(data, tokens=np.array([{"a": 1}, None], dtype=object),
             labels=np.zeros((4, 16), np.int64))
    _one_line_exit_2(["train", str(plans[0]), "--steps", "1", *COMMON, "--data", str(data)],
                     capfd, "holds Python objects")
    folder = tmp_path / "arrays"
    folder.mkdir()
    np.save(folder / "tokens.npy", np.array([object()] * 4, dtype=object), allow_pickle=True)
    _one_line_exit_2(["train", str(plans[0]), "--steps", "1", *COMMON, "--data", str(folder)],
                     capfd, str(folder))


def test_the_program_is_named_and_only_loaded_from_its_folders(
        plans: tuple[Path, Path], tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    """`train` names the program and its sha256 first; a plan whose program lies elsewhere,
    or whose digest differs, exits 2 before anything loads it."""
    plan = read_plan(plans[0])
    assert main(["train", str(plans[0]), "--steps", "1", *COMMON]) == 0
    first = capfd.readouterr().out.splitlines()[0]
    assert first.startswith("program ") and plan.program_sha256 in first, first
    other = tmp_path / "elsewhere" / "deeper"
    other.mkdir(parents=True)
    shutil.copy(plans[0] / plan.program, other / "gpt.pt2")
    copied = tmp_path / "plan"
    shutil.copytree(plans[0], copied)
    body = json.loads((copied / "plan.json").read_text())
    body["model"] = str((plans[0] / plan.model).resolve())
    body["program"] = str(other / "gpt.pt2")
    (copied / "plan.json").write_text(json.dumps(body))
    _one_line_exit_2(["train", str(copied), "--steps", "1", *COMMON], capfd,
                     "beside the plan folder or beside its model")
    body["program"] = str((plans[0] / plan.program).resolve())
    body["program_sha256"] = "0" * 64
    (copied / "plan.json").write_text(json.dumps(body))
    _one_line_exit_2(["train", str(copied), "--steps", "1", *COMMON], capfd, "was altered")


def test_a_2_stage_checkpoint_resumes_on_a_3_stage_plan(plans: tuple[Path, Path],
                                                        tmp_path: Path) -> None:
    """Issue 35's target: 4 steps on the 2-stage plan, checkpoint, resumed on the 3-stage plan
    to step 8, within 1e-5 of 8 straight steps on the 2-stage plan (AdamW)."""
    common = dict(microbatches=2, batch_size=2, checkpoint_every=4, **ADAMW)
    straight, moved = tmp_path / "straight", tmp_path / "moved"
    train_plan(plans[0], steps=8, checkpoint_dir=straight, **common)  # type: ignore[arg-type]
    train_plan(plans[0], steps=4, checkpoint_dir=moved, **common)  # type: ignore[arg-type]
    resumed = train_plan(plans[1], steps=8, resume=moved, **common)  # type: ignore[arg-type]
    assert resumed.start_step == 4 and len(resumed.loss) == 4
    want = {n: v for r in (0, 1) for n, v in rank_params(straight / "step-00000008", r).items()}
    got = {n: v for r in (0, 1, 2) for n, v in rank_params(moved / "step-00000008", r).items()}
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=1e-5, msg=name)


def test_rng_states_come_back_on_the_cpu_for_a_gpu_rank(
        plans: tuple[Path, Path], checkpoint: Path, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 35's review finding: ``torch.set_rng_state`` (and ``torch.cuda``'s) take only a CPU
    tensor, so a rank on ``cuda`` resuming (format 2 or 1) must hand them CPU tensors; the
    checkpoint is never read onto the rank's device (shown without a GPU: the setters are
    recorded, not called)."""
    from onnx_partition.runtime.train.checkpoint_state import load_legacy_rank, load_rank_state
    from onnx_partition.safe_tensors import save_tensors

    handed: list[tuple[str, torch.device]] = []
    monkeypatch.setattr(torch, "set_rng_state", lambda t: handed.append(("cpu", t.device)))
    monkeypatch.setattr(torch.cuda, "set_rng_state",
                        lambda t, device=None: handed.append(("cuda", t.device)))
    folder = tmp_path / "step"
    shutil.copytree(checkpoint / "step-00000002", folder)
    tensors = read_tensors(folder / "rank-00000.safetensors")
    tensors["rng/cuda"] = tensors["rng/cpu"].clone()  # as a CUDA rank writes it
    save_tensors(folder / "rank-00000.safetensors", tensors)
    module = stage_modules(plans[0])[0].module
    gpu = torch.device("cuda", 0)
    load_rank_state(folder, 0, module, torch.optim.AdamW(module.parameters()), gpu,
                    same_plan=True)
    legacy = tmp_path / "rank.pt"
    torch.save({"module": module.state_dict(),
                "optimizer": torch.optim.AdamW(module.parameters()).state_dict(),
                "rng": tensors["rng/cpu"], "cuda_rng": tensors["rng/cpu"]}, legacy)
    load_legacy_rank(legacy, module, torch.optim.AdamW(module.parameters()), gpu)
    cpu = torch.device("cpu")
    assert handed == [("cpu", cpu), ("cuda", cpu), ("cpu", cpu), ("cuda", cpu)]
