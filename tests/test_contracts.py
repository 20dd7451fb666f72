"""Each JSON contract is declared once: the dataclass the code uses is the check of the file
(its defaults are the file's); files of the previous version (written by hand below) still read
with the documented defaults; a misspelled key in any contract is an error naming it; and a
plan read back writes the same bytes."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, fields
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from support.graphs import CHAIN, save

from onnx_partition.cli import main
from onnx_partition.cost.annotate import read_costs
from onnx_partition.cost.cluster import Cluster, Link, load_cluster
from onnx_partition.errors import PartitionError
from onnx_partition.plan import DEFAULT_MICROBATCHES, IOSpec, Plan, Predicted, Stage, plan_text
from onnx_partition.plan.contracts import (
    CLUSTER_FORMAT,
    COSTS_FORMAT,
    PLAN_FORMAT,
    RUN_FORMAT,
    STAGE_COSTS_FORMAT,
    ClusterFields,
    ClusterFile,
    FleetFields,
    FleetFile,
    GroupFields,
    PlanFields,
)
from onnx_partition.plan.declare import json_of
from onnx_partition.plan.schema import (
    parse,
    validate_cluster,
    validate_plan,
    validate_run,
    validate_stage_costs,
)

#: (the contract's type, a file's check of it, the smallest file): the file's defaults are the
#: code's, since the one declaration is both.
DEFAULTS: list[tuple[type, Any, dict[str, Any]]] = [
    (Predicted, Predicted, {"compute_ms": 0.0, "comm_ms": 0.0, "memory_bytes": 0}),
    (Stage, Stage, {"index": 0, "file": "s.onnx", "nodes": [], "inputs": [], "outputs": ["y"]}),
    (IOSpec, IOSpec, {"name": "x", "dtype": "float32", "shape": []}),
    (Link, Link, {"bandwidth_gbps": 10.0}),
    (ClusterFields, ClusterFile, {}),
    (GroupFields, GroupFields, {"gpu": "h100"}),
    (FleetFields, FleetFile, {"groups": [{"gpu": "h100"}]}),
]


@pytest.mark.parametrize(("code", "check", "smallest"), DEFAULTS,
                         ids=[d[0].__name__ for d in DEFAULTS])
def test_code_and_file_share_the_defaults(code, check, smallest):
    read = parse(check, smallest, "test")
    assert isinstance(read, code)
    required = {k: getattr(read, k) for k in smallest}
    assert read == code(**required)  # every field the file left out is the code's default
    assert parse(check, json_of(read), "test") == read  # and writes back to the same


def test_the_link_latency_default_is_the_documented_one():
    """docs/cli.md: --latency defaults to 0.02 ms; a cluster.json link without a latency agrees
    (the schema used to default it to 0)."""
    assert Link().latency_ms == 0.02 and Link().bandwidth_gbps == 10.0
    assert validate_cluster({"intra": {"bandwidth_gbps": 5}}).intra.latency_ms == \
        Link().latency_ms
    assert asdict(validate_cluster({}).intra) == asdict(Cluster().intra)
    assert asdict(validate_cluster({}).inter) == asdict(Cluster().inter) == {
        "bandwidth_gbps": 1.25, "latency_ms": 0.05}


def test_every_plan_property_reads_a_declared_key():
    declared = {f.name for f in fields(PlanFields)}
    properties = {name for name, value in vars(Plan).items() if isinstance(value, property)}
    derived = {"microbatches", "rows_per_microbatch"}  # read other keys
    assert properties - derived <= declared


def test_a_cluster_written_by_a_plan_reads_as_cluster_json():
    body = Cluster(machines=2, devices_per_machine=4, memory_gb=80.0, kind="cuda",
                   gpu="h100").to_json()
    assert list(body) == [f.name for f in fields(ClusterFields)]
    assert json_of(validate_cluster(body)) == body


# --------------------------------------------------------------------------- old files


def old_plan() -> dict[str, Any]:
    """plan.json as an early version wrote it: no batch_size, no device_model, no program, no
    manifest, stages without constants or sha256, no micro-batch count."""
    return {
        "format": "onnx-partition/plan@1", "model": "../m.onnx",
        "stages": [
            {"index": 0, "file": "stage_0.onnx", "nodes": ["a", "b"], "inputs": ["x"],
             "outputs": ["t"], "predicted": {"compute_ms": 1.5, "comm_ms": 0.0,
                                             "memory_bytes": 64}},
            {"index": 1, "file": "stage_1.onnx", "nodes": ["c"], "inputs": ["t"],
             "outputs": ["y"]},
        ],
        "inputs": [{"name": "x", "dtype": "float32", "shape": ["N", 4]}],
        "outputs": [{"name": "y", "dtype": "float32", "shape": ["N", 4]}],
        "predicted": {"bottleneck_ms": 1.5, "throughput_per_s": 666.667,
                      "total_compute_ms": 2.0},
        "link": {"bandwidth_gbps": 10.0, "latency_ms": 0.02},
        "candidates": {"topo": {"dp_ms": 1.5, "refined_ms": 1.5, "positions": [2],
                                "seconds": 0.01}},
        "version": "0.1.0", "costs": {"source": "analytic:cpu", "measured_nodes": 0},
        "input_shapes": {"x": [2, 4]}, "unknown_size_tensors": 0, "partition_s": 0.1,
    }


def test_a_plan_at_1_reads_and_is_written_back_at_2():
    plan = Plan.from_json(old_plan())
    assert plan.stages[0].predicted is not None
    assert plan.stages[0].predicted.activation_bytes is None
    body = plan.to_json()
    assert body["format"] == PLAN_FORMAT
    assert body["stages"][0]["predicted"] == {"compute_ms": 1.5, "comm_ms": 0.0,
                                              "memory_bytes": 64}


def test_a_train_plan_at_2_carries_the_memory_parts():
    body = old_plan()
    body["format"], body["mode"] = PLAN_FORMAT, "train"
    body.update(optimizer="adam", precision="fp32", schedule="1f1b")
    body["stages"][0]["predicted"].update(
        forward_ms=0.5, backward_ms=1.0, weights_bytes=8, grad_bytes=8, optimizer_bytes=16,
        activation_bytes=8, inflight=2, buffer_bytes=8)
    plan = Plan.from_json(body)
    assert plan.to_json()["stages"][0]["predicted"] == body["stages"][0]["predicted"]
    assert plan.extra["schedule"] == "1f1b"
    body["stages"][0]["predicted"]["saved_bytes"] = 1
    with pytest.raises(PartitionError, match="saved_bytes"):
        Plan.from_json(body)


def test_an_old_plan_reads_with_the_documented_defaults():
    plan = Plan.from_json(old_plan())
    assert [s.replicas for s in plan.stages] == [1, 1]
    assert [s.devices for s in plan.stages] == [["cpu"], ["cpu"]]
    assert plan.stages[1].predicted is None and plan.stages[1].constants == []
    assert plan.stages[0].sha256 == "" and plan.inputs[0].high is None
    assert (plan.mode, plan.ordering, plan.solver) == ("infer", "topo", "dp")
    assert plan.program == "" and plan.program_sha256 == ""
    assert plan.microbatches == DEFAULT_MICROBATCHES and plan.rows_per_microbatch == 2
    assert plan.manifest == {} and plan.device_model is None
    own = ["format", *(PlanFields.FIXED or ())]
    assert list(plan.to_json()) == own + [k for k in old_plan() if k not in own]


def test_an_old_cluster_file_with_only_the_intra_bandwidth(tmp_path):
    (tmp_path / "c.json").write_text(json.dumps({"format": CLUSTER_FORMAT, "machines": 2,
                                                 "intra": {"bandwidth_gbps": 100}}))
    cluster = load_cluster(tmp_path / "c.json")
    assert cluster.intra == Link(100.0, 0.02)  # the documented latency, not 0
    assert cluster.inter == Link(1.25, 0.05)
    assert math.isinf(cluster.memory_gb) and cluster.speed == 1.0 and cluster.kind == "cpu"
    (tmp_path / "bare.json").write_text("{}")  # no format string: read as cluster@1
    assert load_cluster(tmp_path / "bare.json") == Cluster()


def test_an_old_costs_file_without_a_format(tmp_path):
    (tmp_path / "c.json").write_text(json.dumps({"nodes": {"a": {"forward_ms": 2}}}))
    assert read_costs(tmp_path / "c.json") == {"a": {"forward_ms": 2.0}}
    (tmp_path / "v1.json").write_text(json.dumps({"format": COSTS_FORMAT, "unit": "ms",
                                                  "device": "cpu", "nodes": {}}))
    assert read_costs(tmp_path / "v1.json") == {}


# --------------------------------------------------------------------------- run, stage costs


def run_body() -> dict[str, Any]:
    part = {"microbatches": 2, "batch_size": 3, "rows": 6, "iteration_ms": 1.0,
            "throughput_per_s": 2000.0, "samples_per_s": 6000.0,
            "stages": [{"index": 0, "replicas": 1, "busy_ms": 0.5}], "devices": []}
    return {"format": RUN_FORMAT, "runtime": "threads", "stages": 1, "replicas": [1],
            "microbatches": 2, "batch_size": 3, "rows": 6, "warmup": 1,
            "measured": {**part, "iterations": 1, "iteration_ms_each": [1.0]},
            "predicted": {**part, "schedule": "infer", "bubble_fraction": 0.1,
                          "scaled_from_batch_size": None},
            "ratio": {"samples_per_s": 1.0}}


def test_a_run_file_is_declared(tmp_path):
    validate_run(run_body())
    body = run_body()
    body["measured"]["iteraton_ms"] = 1.0
    (tmp_path / "run.json").write_text(json.dumps(body))
    from onnx_partition.pipeline.predict import read_run

    with pytest.raises(PartitionError, match=r"run.json: measured: unknown key 'iteraton_ms' "
                                             r"\(did you mean 'iteration_ms'\?\)$"):
        read_run(tmp_path / "run.json")
    with pytest.raises(PartitionError, match=r"measured\.microbatches: Input should be greater"):
        validate_run({**run_body(), "measured": {**run_body()["measured"], "microbatches": 0}})


def stage_costs_body() -> dict[str, Any]:
    return {"format": STAGE_COSTS_FORMAT, "unit": "ms", "device": "cpu",
            "rows_per_microbatch": 2, "microbatches": 4, "schedule": "1f1b",
            "measured_iteration_ms": 12.5,
            "simulator_costs": {"forward_ms": [1.0, 2.0], "backward_ms": [2.0, 4.0]}}


def test_the_stage_costs_file_is_declared(tmp_path):
    from onnx_partition.runtime.train.record import RECORD_FORMAT, write_record

    assert RECORD_FORMAT == STAGE_COSTS_FORMAT
    stats = SimpleNamespace(microbatches=4, schedule="1f1b", measured_ms=12.5,
                            forward_ms=[1.0, 2.0], backward_ms=[2.0, 4.0])
    write_record(tmp_path / "r.json", stats, 2, "cpu")  # type: ignore[arg-type]
    assert json.loads((tmp_path / "r.json").read_text()) == stage_costs_body()
    validate_stage_costs(stage_costs_body())
    body = stage_costs_body()
    body["simulator_costs"]["forward"] = [1.0]
    with pytest.raises(PartitionError, match=r"simulator_costs: unknown key 'forward' \(did "
                                             r"you mean 'forward_ms'\?\)$"):
        validate_stage_costs(body)
    stats.forward_ms = [math.nan, 1.0]
    with pytest.raises(PartitionError, match=r"simulator_costs.forward_ms\[0\]"):
        write_record(tmp_path / "r2.json", stats, 2, "cpu")  # type: ignore[arg-type]
    assert not (tmp_path / "r2.json").exists()


def test_the_format_strings():
    assert PLAN_FORMAT == "onnx-partition/plan@2" and CLUSTER_FORMAT.endswith("cluster@1")
    assert RUN_FORMAT == "onnx-partition/run@1"
    assert STAGE_COSTS_FORMAT == "onnx-partition/stage-costs@1"
    with pytest.raises(PartitionError, match="format: String should match pattern"):
        validate_run({**run_body(), "format": "onnx-partition/plan@1"})


# --------------------------------------------------------------------------- plan bytes


@pytest.mark.parametrize("options", [
    ["-s", "2"],
    ["--devices", "2", "--machines", "2", "--mode", "train", "--no-program", "--microbatches",
     "4"],
], ids=["pipeline", "hybrid"])
def test_a_written_plan_reads_back_to_the_same_bytes(tmp_path, options):
    model = save(CHAIN, tmp_path / "m.onnx")
    out = tmp_path / "plan"
    assert main(["partition", str(model), "--batch-size", "2", "-o", str(out), "-q",
                 *options]) == 0
    text = (out / "plan.json").read_text()
    body = json.loads(text)
    validate_plan(body)
    assert plan_text(Plan.from_json(body).to_json()) == text
    # the command line's link defaults are the code's (--bandwidth, --latency, --inter-*)
    if "cluster" in body:
        assert body["cluster"] == Cluster(machines=2, devices_per_machine=2).to_json()
    else:
        assert body["link"] == asdict(Link())


def test_cluster_file_keys_match_the_docs():
    files = (Path(__file__).resolve().parents[1] / "docs" / "files.md").read_text()
    start = files.index('```json\n{"format": "onnx-partition/cluster@1"') + len("```json\n")
    example = json.loads(files[start:files.index("```", start)])
    validate_cluster(example)


def test_no_plan_is_written_that_would_not_read_back():
    body = Plan.from_json(old_plan()).to_json()
    plan_text(body)
    body["trainedfrom"] = "x"  # a key the code misspelled
    with pytest.raises(PartitionError, match=r"^plan.json to be written: unknown key "
                                             r"'trainedfrom' \(did you mean 'trained_from'\?\)$"):
        plan_text(body)
