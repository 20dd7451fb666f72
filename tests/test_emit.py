"""Stage files (:mod:`onnx_partition.graph.emit`): exact cuts, valid ONNX whose inputs and outputs
are
the cut tensors, external weights, and plan folders written atomically."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from support.graphs import CHAIN, feeds_for, save
from support.outputs import run_whole, session

from onnx_partition.errors import PartitionError
from onnx_partition.fileio import HashingWriter, sha256_file, written_sha256
from onnx_partition.graph import OpGraph, load
from onnx_partition.graph import emit as emit_module
from onnx_partition.graph.emit import (
    EXTERNAL_THRESHOLD,
    StageCut,
    cut_stages,
    emit,
    io_specs,
    save_stage,
    stage_proto,
)
from onnx_partition.plan import IOSpec, Plan, Stage, read_plan
from onnx_partition.plan.folder import verify

# CHAIN's nodes: 0 c (free Constant), 1 a, 2 b, 3 d, 4 e, 5 f, 6 y
TWO = {1: 0, 2: 0, 3: 0, 4: 1, 5: 1, 6: 1}
THREE = {1: 0, 2: 1, 3: 1, 4: 1, 5: 2, 6: 2}


@pytest.fixture
def chain(tmp_path: Path) -> OpGraph:
    return load(save(CHAIN, tmp_path / "m.onnx"), batch_size=3)


def plan_for(graph: OpGraph, cuts: list[StageCut]) -> Plan:
    stages = [Stage(k, f"stage_{k}.onnx", [graph.nodes[i].key for i in cut.nodes], cut.inputs,
                    cut.outputs) for k, cut in enumerate(cuts)]
    inputs, outputs = io_specs(graph)
    return Plan("", stages, inputs, outputs)


def run_stages(models: list[onnx.ModelProto], feeds: dict[str, np.ndarray],
               tmp: Path) -> dict[str, np.ndarray]:
    env = dict(feeds)
    for k, model in enumerate(models):
        path = tmp / f"run_{k}.onnx"
        onnx.save(model, str(path))
        sess = session(path)
        names = [o.name for o in sess.get_outputs()]
        env.update(zip(names, sess.run(names, {i.name: env[i.name] for i in sess.get_inputs()})))
    return env


# ------------------------------------------------------------------------------ cuts


def test_cuts_are_exact(chain: OpGraph) -> None:
    assert cut_stages(chain, TWO, 2) == [
        StageCut([1, 2, 3], [0], ["x"], ["a", "d"], ["w"]),
        StageCut([4, 5, 6], [], ["d", "x", "a"], ["y"], ["w"])]
    # the free constant goes with its reader d; a skips stage 1 and still leaves stage 0 once
    assert cut_stages(chain, THREE, 3) == [
        StageCut([1], [], ["x"], ["a"], ["w"]),
        StageCut([2, 3, 4], [0], ["a", "x"], ["e"], []),
        StageCut([5, 6], [], ["e", "a"], ["y"], ["w"])]


def test_an_edge_pointing_back_is_refused(chain: OpGraph) -> None:
    with pytest.raises(ValueError, match="'a' flows from a later stage into stage 0"):
        cut_stages(chain, {1: 1, 2: 0, 3: 0, 4: 1, 5: 1, 6: 1}, 2)


def test_io_specs_keep_symbolic_dims(chain: OpGraph) -> None:
    assert io_specs(chain) == ([IOSpec("x", "float32", ["N", 4])],
                               [IOSpec("y", "float32", ["N", 4])])


@pytest.mark.parametrize("assignment", [TWO, THREE], ids=["two", "three"])
def test_stage_models_are_valid_onnx_over_exactly_the_cut(chain: OpGraph, tmp_path: Path,
                                                          assignment: dict[int, int]) -> None:
    cuts = cut_stages(chain, assignment, max(assignment.values()) + 1)
    models = [stage_proto(chain, cut, k) for k, cut in enumerate(cuts)]
    for k, (model, cut) in enumerate(zip(models, cuts)):
        onnx.checker.check_model(model, full_check=True)
        assert [i.name for i in model.graph.input] == cut.inputs
        assert [o.name for o in model.graph.output] == cut.outputs
        assert [n.name for n in model.graph.node] == [
            chain.nodes[i].key for i in sorted(cut.nodes + cut.constants)]
        assert [t.name for t in model.graph.initializer] == cut.initializers
        assert {p.key: p.value for p in model.metadata_props} == {"onnx_partition.stage": str(k)}
        assert model.producer_name == "onnx-partition"
    feeds = feeds_for()
    got = run_stages(models, feeds, tmp_path)
    np.testing.assert_array_equal(got["y"], run_whole(chain.path, feeds)["y"])


# ------------------------------------------------------------------------------ weights


def big_model(tmp: Path, external: bool) -> OpGraph:
    """x @ w2 (512 x 513 floats, just over 1 MiB) @ w1 (513 x 512, also) + b (small)."""
    rng = np.random.default_rng(0)
    w2 = numpy_helper.from_array(rng.standard_normal((512, 513)).astype(np.float32), "w2")
    w1 = numpy_helper.from_array(rng.standard_normal((513, 512)).astype(np.float32), "w1")
    b = numpy_helper.from_array(np.arange(512, dtype=np.float32), "b")
    nodes = [helper.make_node("MatMul", ["x", "w2"], ["h"], name="mm2"),
             helper.make_node("MatMul", ["h", "w1"], ["g"], name="mm1"),
             helper.make_node("Add", ["g", "b"], ["y"], name="add")]
    graph = helper.make_graph(nodes, "big", [helper.make_tensor_value_info(
        "x", TensorProto.FLOAT, [2, 512])], [helper.make_tensor_value_info(
            "y", TensorProto.FLOAT, [2, 512])], initializer=[w2, w1, b])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save_model(model, str(tmp / "big.onnx"), save_as_external_data=external,
                    location="big.onnx.data", size_threshold=0)
    return load(tmp / "big.onnx")


def external_info(tensor: onnx.TensorProto) -> dict[str, str]:
    return {e.key: e.value for e in tensor.external_data}


@pytest.mark.parametrize("external", [False, True], ids=["inline-source", "external-source"])
def test_large_weights_go_external_aligned_small_ones_inline(tmp_path: Path,
                                                            external: bool) -> None:
    graph = big_model(tmp_path, external)
    cut = cut_stages(graph, {0: 0, 1: 0, 2: 0}, 1)[0]
    out = tmp_path / "out"
    out.mkdir()
    digest = save_stage(stage_proto(graph, cut, 0), out / "stage_0.onnx", tmp_path)
    assert digest == hashlib.sha256((out / "stage_0.onnx").read_bytes()).hexdigest()
    saved = onnx.load(str(out / "stage_0.onnx"), load_external_data=False)
    by_name = {t.name: t for t in saved.graph.initializer}
    size = 512 * 513 * 4
    assert size >= EXTERNAL_THRESHOLD
    aligned = -(-size // 4096) * 4096
    assert external_info(by_name["w2"]) == {
        "location": "stage_0.onnx.data", "offset": "0", "length": str(size)}
    assert external_info(by_name["w1"]) == {
        "location": "stage_0.onnx.data", "offset": str(aligned), "length": str(size)}
    assert by_name["b"].data_location == TensorProto.DEFAULT and len(by_name["b"].raw_data) == 2048
    assert (out / "stage_0.onnx.data").stat().st_size == aligned + size
    data = (out / "stage_0.onnx.data").read_bytes()  # the gap is zeros, hashed as written
    assert data[size:aligned] == bytes(aligned - size)
    assert written_sha256(out / "stage_0.onnx.data") == hashlib.sha256(data).hexdigest()
    assert sorted(p.name for p in out.iterdir()) == ["stage_0.onnx", "stage_0.onnx.data"]
    feeds = {"x": np.random.default_rng(1).standard_normal((2, 512)).astype(np.float32)}
    sess = session(out / "stage_0.onnx")
    np.testing.assert_array_equal(sess.run(["y"], feeds)[0],
                                  run_whole(tmp_path / "big.onnx", feeds)["y"])


def test_the_manifest_does_not_read_the_weights_again(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A stage's data file is hashed while it is written: publishing the plan folder does not
    read it a second time, and its manifest entry equals a fresh read's."""
    import onnx_partition.plan.folder as folder

    graph = big_model(tmp_path, True)
    read: list[str] = []
    real = folder.sha256_file

    def counted(path: Path, **kwargs: bool) -> str:
        read.append(Path(path).name)
        return real(path, **kwargs)

    monkeypatch.setattr(folder, "sha256_file", counted)
    cuts = cut_stages(graph, {0: 0, 1: 0, 2: 1}, 2)
    emit(graph, cuts, plan_for(graph, cuts), tmp_path / "plan")
    assert "stage_0.onnx.data" not in read and "stage_0.onnx" in read
    plan = read_plan(tmp_path / "plan")
    assert plan.manifest is not None
    entry = plan.manifest["stage_0.onnx.data"]
    assert entry.sha256 == sha256_file(tmp_path / "plan" / "stage_0.onnx.data")
    verify(tmp_path / "plan", plan)  # reads every file: the check is never taken on trust


def test_a_changed_file_is_not_taken_as_written(tmp_path: Path) -> None:
    with HashingWriter(tmp_path / "f") as out:
        out.write(b"abc")
        out.pad_to(8)
        with pytest.raises(ValueError, match="before the end"):
            out.pad_to(2)
    assert written_sha256(tmp_path / "f") == hashlib.sha256(b"abc" + bytes(5)).hexdigest()
    (tmp_path / "f").write_bytes(b"abcdefgh")  # same size, a new modification time
    os.utime(tmp_path / "f", ns=(1, 1))
    assert written_sha256(tmp_path / "f") is None
    assert written_sha256(tmp_path / "missing") is None


def test_small_stage_leaves_no_data_file(chain: OpGraph, tmp_path: Path) -> None:
    cut = cut_stages(chain, TWO, 2)[0]
    save_stage(stage_proto(chain, cut, 0), tmp_path / "s.onnx", tmp_path)
    assert not (tmp_path / "s.onnx.data").exists()


def test_checker_failure_is_one_line(chain: OpGraph, tmp_path: Path) -> None:
    model = stage_proto(chain, cut_stages(chain, TWO, 2)[0], 0)
    model.graph.node[1].op_type = "NoSuchOp"
    with pytest.raises(PartitionError, match=r"^stage file s.onnx failed the ONNX checker: \S"):
        save_stage(model, tmp_path / "s.onnx", tmp_path)
    save_stage(model, tmp_path / "unchecked.onnx", tmp_path, check=False)  # no check: written
    assert (tmp_path / "unchecked.onnx").exists()


# ------------------------------------------------------------------------------ plan folder


def test_emit_writes_stages_plan_and_manifest(chain: OpGraph, tmp_path: Path) -> None:
    cuts = cut_stages(chain, TWO, 2)
    plan = emit(chain, cuts, plan_for(chain, cuts), tmp_path / "out")
    out = tmp_path / "out"
    assert sorted(p.name for p in out.iterdir()) == ["plan.json", "stage_0.onnx", "stage_1.onnx"]
    assert plan.model == "../m.onnx"
    written = read_plan(out)
    for stage in written.stages:
        assert stage.sha256 == hashlib.sha256((out / stage.file).read_bytes()).hexdigest()
        loaded = onnx.load(str(out / stage.file))
        assert [i.name for i in loaded.graph.input] == stage.inputs
        assert [o.name for o in loaded.graph.output] == stage.outputs
    body = json.loads((out / "plan.json").read_text())
    assert sorted(body["manifest"]) == ["stage_0.onnx", "stage_1.onnx"]


def test_a_failed_emit_leaves_the_earlier_plan_and_no_temporary(
        chain: OpGraph, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "out"
    cuts = cut_stages(chain, TWO, 2)
    emit(chain, cuts, plan_for(chain, cuts), out)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    real = emit_module.save_stage
    calls = []

    def fail_second(*args: object, **kwargs: object) -> str:
        calls.append(1)
        if len(calls) == 2:
            raise PartitionError("disk full")
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(emit_module, "save_stage", fail_second)
    three = cut_stages(chain, THREE, 3)
    with pytest.raises(PartitionError, match="disk full"):
        emit(chain, three, plan_for(chain, three), out, force=True)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx", "out"]


def test_emit_never_overwrites_a_user_folder_or_the_model(chain: OpGraph,
                                                          tmp_path: Path) -> None:
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("precious")
    cuts = cut_stages(chain, TWO, 2)
    with pytest.raises(PartitionError, match="not an earlier plan; use --force"):
        emit(chain, cuts, plan_for(chain, cuts), mine)
    assert [p.name for p in mine.iterdir()] == ["notes.txt"]
    with pytest.raises(PartitionError, match=r"holds .*m\.onnx, which the plan needs"):
        emit(chain, cuts, plan_for(chain, cuts), tmp_path, force=True)
    assert (tmp_path / "m.onnx").exists() and (mine / "notes.txt").read_text() == "precious"
    emit(chain, cuts, plan_for(chain, cuts), mine, force=True)
    assert sorted(p.name for p in mine.iterdir()) == ["plan.json", "stage_0.onnx",
                                                      "stage_1.onnx"]


def test_a_copied_span_is_written_and_hashed_block_by_block(tmp_path: Path) -> None:
    source = tmp_path / "src"
    body = bytes(range(256)) * 41  # 10,496 bytes: blocks of 1,000 leave a short last one
    source.write_bytes(body)
    with HashingWriter(tmp_path / "f") as out:
        out.write(b"head")
        out.copy_from(source, 7, 10_000, block=1_000)
        out.pad_to(10_008)
        assert out.tell() == 10_008
        with pytest.raises(EOFError, match="ended 7 bytes early"):
            out.copy_from(source, 10_000, 503)
    written = (tmp_path / "f").read_bytes()
    assert written[:10_008] == b"head" + body[7:10_007] + bytes(4)
    assert written_sha256(tmp_path / "f") == hashlib.sha256(written).hexdigest()
