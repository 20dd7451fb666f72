"""Plan folders: the manifest covers every file, publication is atomic and exclusive, crashes
leave nothing lost, and no user file is ever overwritten."""

from __future__ import annotations

import fcntl
import json
import os
import stat
from pathlib import Path

import pytest
from support.cli import one_error
from support.faults import CrashAt
from support.graphs import CHAIN, save

from onnx_partition.cli import main
from onnx_partition.errors import PartitionError
from onnx_partition.fileio import sha256_file
from onnx_partition.plan import folder as plandir
from onnx_partition.plan import read_plan
from onnx_partition.plan.folder import PUBLISH_STEPS, is_earlier_plan, publish, verify


@pytest.fixture
def chain(tmp_path):
    return save(CHAIN, tmp_path / "m.onnx")


def big_plan(tmp_path: Path) -> Path:
    """A two-stage plan whose stages keep weights in .data files (2 MiB matrices)."""
    import numpy as np
    import onnx
    from onnx import helper, numpy_helper

    w = numpy_helper.from_array(np.eye(512, dtype=np.float32) * 2, "w")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["a"]), helper.make_node("Relu", ["a"], ["b"]),
         helper.make_node("MatMul", ["b", "w"], ["y"])], "g",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["N", 512])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["N", 512])], [w])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.save(model, str(tmp_path / "big.onnx"), save_as_external_data=True,
              location="big.onnx.data")
    out = tmp_path / "plan"
    assert main(["partition", str(tmp_path / "big.onnx"), "-s", "2", "--batch-size", "1",
                 "-o", str(out)]) == 0
    return out


# --------------------------------------------------------------------------- integrity


def test_manifest_covers_data_files_and_is_checked_before_anything_runs(capsys, tmp_path):
    out = big_plan(tmp_path)
    manifest = json.loads((out / "plan.json").read_text())["manifest"]
    on_disk = sorted(p.name for p in out.iterdir() if p.name != "plan.json")
    assert sorted(manifest) == on_disk and any(n.endswith(".onnx.data") for n in on_disk)
    for name, entry in manifest.items():
        assert entry["size"] == (out / name).stat().st_size
        assert entry["sha256"] == sha256_file(out / name)
    assert main(["run", str(out), "--iterations", "1", "--check"]) == 0
    capsys.readouterr()
    data = next(out.glob("*.onnx.data"))
    raw = bytearray(data.read_bytes())
    raw[100] ^= 0xFF  # flip a weight byte: same size
    data.write_bytes(bytes(raw))
    for argv in (["run", out], ["run", out, "--nproc", "2"], ["report", out]):
        one_error(capsys, argv, f"{data.name} does not match its sha256")
    assert main(["simulate", str(out), "--no-verify"]) == 0  # sizes only: they match
    data.write_bytes(bytes(raw[:-1]))
    one_error(capsys, ["simulate", out, "--no-verify"], "changed or truncated")


@pytest.mark.parametrize("damage", ["empty", "missing", "bad"])
def test_a_missing_or_empty_checksum_is_an_error(capsys, tmp_path, chain, damage):
    out = tmp_path / "plan"
    assert main(["partition", str(chain), "-s", "2", "--batch-size", "2", "-o", str(out)]) == 0
    body = json.loads((out / "plan.json").read_text())
    if damage == "missing":
        del body["manifest"]
        pattern = "has no manifest"
    else:
        body["manifest"]["stage_0.onnx"]["sha256"] = "" if damage == "empty" else "xyz"
        pattern = "manifest.stage_0.onnx.sha256"
    (out / "plan.json").write_text(json.dumps(body))
    one_error(capsys, ["run", out], pattern)
    one_error(capsys, ["simulate", out], pattern)


def test_a_forged_plan_cannot_make_a_user_file_replaceable(capsys, tmp_path, chain):
    out = tmp_path / "plan"
    assert main(["partition", str(chain), "-s", "2", "--batch-size", "2", "-o", str(out)]) == 0
    assert is_earlier_plan(out)
    (out / "notes.txt").write_text("mine")
    assert not is_earlier_plan(out)  # a file the manifest does not list
    body = json.loads((out / "plan.json").read_text())
    body["stages"][1]["file"] = "notes.txt"  # forged: names the user's file as a stage file
    (out / "plan.json").write_text(json.dumps(body))
    assert not is_earlier_plan(out)
    one_error(capsys, ["partition", chain, "-s", "2", "--batch-size", "2", "-o", out],
              "not an earlier plan")
    assert (out / "notes.txt").read_text() == "mine"


# --------------------------------------------------------------------------- atomic swap


def files(tmp: Path, n: int, text: str) -> dict[str, object]:
    for i in range(n):
        (tmp / f"stage_{i}.onnx").write_text(text)
    return {"format": "onnx-partition/plan@1", "model": "m.onnx", "outputs": [
        {"name": "y", "dtype": "float32", "shape": [1]}], "stages": [
        {"index": i, "file": f"stage_{i}.onnx", "nodes": [], "inputs": [], "outputs": ["y"]}
        for i in range(n)]}


def crash_in_child(out: Path, step: str, text: str) -> int:
    """Publish into ``out`` in a forked child that dies (os._exit) at ``step``."""
    pid = os.fork()
    if pid == 0:  # the child: no clean-up code may run
        try:
            publish(out, lambda tmp: files(tmp, 2, text), step_hook=CrashAt(step))
        finally:
            os._exit(0)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


def test_the_crash_tests_cover_every_publication_step():
    assert PUBLISH_STEPS == ("written", "swapped", "moved-old")  # the steps tested below


@pytest.mark.parametrize("exchange", [True, False])
@pytest.mark.parametrize("step", ["written", "swapped", "moved-old"])
def test_a_crash_at_any_step_loses_nothing(tmp_path, monkeypatch, step, exchange):
    if not exchange:
        monkeypatch.setattr(plandir, "exchange", lambda first, second: False)
    out = tmp_path / "plan"
    publish(out, lambda tmp: files(tmp, 2, "old"))
    code = crash_in_child(out, step, "new")
    reached = step == "written" or (step == "swapped") == exchange
    assert code == (3 if reached else 0)
    if out.exists():  # either plan, whole; never a mix
        plan = read_plan(out)
        verify(out, plan)
        assert len({(out / s.file).read_text() for s in plan.stages}) == 1
    else:
        assert step == "moved-old" and not exchange  # the one window between two renames
    publish(out, lambda tmp: files(tmp, 3, "next"))  # recovers, then publishes
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan"]
    assert (out / "stage_2.onnx").read_text() == "next"


def test_concurrent_publications_are_exclusive(tmp_path):
    """Six processes publish into one folder at once: each succeeds or is told another is
    writing; the folder ends whole, with no leftovers."""
    out = tmp_path / "plan"
    read_end, write_end = os.pipe()
    children = []
    for k in range(6):
        pid = os.fork()
        if pid == 0:
            os.close(write_end)
            os.read(read_end, 1)  # all start together
            code = 0
            try:
                publish(out, lambda tmp, k=k: files(tmp, 2, f"writer {k}"))
            except PartitionError as exc:
                code = 7 if "another partition is writing" in str(exc) else 9
            except BaseException:
                code = 8
            os._exit(code)
        children.append(pid)
    os.close(read_end)
    os.write(write_end, b"go" * 6)
    os.close(write_end)
    codes = [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in children]
    assert set(codes) <= {0, 7} and 0 in codes, codes
    verify(out, read_plan(out))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan"]


def test_a_held_lock_is_a_one_line_error(capsys, tmp_path, chain):
    out = tmp_path / "plan"
    with open(tmp_path / ".plan.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        one_error(capsys, ["partition", chain, "-s", "2", "--batch-size", "2", "-o", out],
                  f"another partition is writing {out}")
    assert not out.exists()


# --------------------------------------------------------------------------- paths


def test_report_never_overwrites_a_file_without_force(capsys, tmp_path, chain):
    out = tmp_path / "plan"
    assert main(["partition", str(chain), "-s", "2", "--batch-size", "2", "-o", str(out)]) == 0
    plan_json = (out / "plan.json").read_bytes()
    for target in ("plan.json", "stage_0.onnx"):
        one_error(capsys, ["report", out, "-o", out / target, "--force"], "is a file of the plan")
    assert (out / "plan.json").read_bytes() == plan_json
    mine = tmp_path / "notes.html"
    mine.write_text("mine")
    one_error(capsys, ["report", out, "-o", mine], "exists; use --force")
    assert mine.read_text() == "mine"
    assert main(["report", str(out), "-o", str(mine), "--force"]) == 0
    assert main(["report", str(out)]) == 0 and main(["report", str(out)]) == 0  # ours: replaced
    assert main(["partition", str(chain), "-s", "3", "--batch-size", "2", "-o", str(out)]) == 0


def test_force_never_deletes_the_model(capsys, tmp_path, chain):
    one_error(capsys, ["partition", chain, "-s", "2", "--batch-size", "2", "-o", tmp_path,
                       "--force"], "holds")
    assert chain.is_file()
    one_error(capsys, ["partition", chain, "-s", "2", "--batch-size", "2", "-o", tmp_path.parent,
                       "--force"], "holds")
    assert chain.is_file()


def test_bad_output_paths_are_one_line_errors(capsys, tmp_path, chain, monkeypatch):
    argv = ["partition", chain, "-s", "2", "--batch-size", "2", "-o"]
    (tmp_path / "file").write_text("x")
    one_error(capsys, [*argv, tmp_path / "file" / "plan"], "cannot write the plan folder")
    if os.path.isdir("/sys/kernel"):
        one_error(capsys, [*argv, "/sys/kernel/onnx-partition-plan"], "cannot write")
    if os.geteuid() != 0:  # root may write anywhere
        locked = tmp_path / "ro"
        locked.mkdir()
        locked.chmod(stat.S_IRUSR | stat.S_IXUSR)
        one_error(capsys, [*argv, locked / "plan"], "Permission denied")
    long = tmp_path / ("p" * 250)  # a legal name; the temporaries' names must stay legal too
    assert main([*map(str, argv), str(long)]) == 0
    verify(long, read_plan(long))
    one_error(capsys, ["report", long, "-o", tmp_path / "file" / "r.html"], "Not a directory")
    one_error(capsys, ["report", long, "-o", "/sys/kernel/r.html"], "cannot write")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["file", "m.onnx", long.name]
                                                                + (["ro"] if os.geteuid() else []))
    monkeypatch.chdir(long)  # -o . from inside a plan folder: no temporary copy left there
    assert main([*map(str, argv), "."]) == 0
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]
    assert not [p for p in long.iterdir() if p.name.startswith(".")]
