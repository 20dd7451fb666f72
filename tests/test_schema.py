"""plan.json, cluster.json and costs.json against their declared schemas: the offending field is
named in one line, an unknown key is an error naming it, and no NaN or Infinity gets into a plan.
(Declarations and defaults agreeing with the code, old files, run and stage-costs files:
tests/test_contracts.py.)"""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
from support.cli import one_error
from support.graphs import CHAIN, save

from onnx_partition.cli import main
from onnx_partition.errors import PartitionError
from onnx_partition.plan.schema import validate_cluster, validate_costs, validate_plan


@pytest.fixture(scope="module")
def plan_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("schema")
    model = save(CHAIN, root / "m.onnx")
    out = root / "plan"
    assert main(["partition", str(model), "-s", "2", "--batch-size", "2", "-o", str(out)]) == 0
    return out


def edited(body: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    body = json.loads(json.dumps(body))
    *parents, last = [int(p) if p.isdigit() else p for p in path.split(".")]
    node = body
    for key in parents:
        node = node[key]
    if value is KeyError:
        del node[last]
    else:
        node[last] = value
    return body


PLAN_CASES = [
    ("stages.0.replicas", "2", "stages[0].replicas: Input should be a valid integer, got '2'"),
    ("stages.0.replicas", 70000, "stages[0].replicas: Input should be less than or equal to"),
    ("stages.0.replicas", -3, "stages[0].replicas: Input should be greater than or equal to 1"),
    ("stages.0.replicas", True, "stages[0].replicas: Input should be a valid integer"),
    ("stages.0.index", "x", "stages[0].index: Input should be a valid integer, got 'x'"),
    ("stages.1.index", 0, "stages[1].index is 0; stages must be listed in pipeline order"),
    ("stages.0.outputs", [], "stages[0].outputs: List should have at least 1 item"),
    ("model", None, "model: Input should be a valid string, got None"),
    ("outputs.0.dtype", "float99", "outputs[0].dtype: is not a numeric dtype name"),
    ("stages.0.predicted.compute_ms", "1.0", "stages[0].predicted.compute_ms: Input should be"),
    ("stages.0.predicted.comm_ms", math.nan, "stages[0].predicted.comm_ms: Input should be a "
                                             "finite number"),
    ("stages.0.file", "../m.onnx", "stages[0].file: must be a path inside the plan folder"),
    ("stages", KeyError, "stages: Field required"),
    ("predicted.bottleneck_ms", math.inf, "predicted.bottleneck_ms: Input should be a finite"),
    ("predicted.bottleneck_ms", "fast", "predicted.bottleneck_ms: Input should be a valid number"),
    ("inputs.0.shape", [2**40, 4], "inputs[0].shape[0]: Input should be less than or equal to"),
    ("input_shapes.x", [2**31 - 1, 2**31 - 1], "input_shapes.x: more than"),
    ("link.bandwidth_gbps", math.nan, "link.bandwidth_gbps: Input should be a finite number"),
    ("costs.measured_nodes", math.nan, "costs.measured_nodes: NaN and Infinity are not allowed"),
    ("link.latency_ms", "0", "link.latency_ms: Input should be a valid number, got '0'"),
]


@pytest.mark.parametrize(("path", "value", "message"), PLAN_CASES)
def test_plan_fields_are_checked_by_name(capsys, plan_dir, path, value, message):
    body = json.loads((plan_dir / "plan.json").read_text())
    text = json.dumps(edited(body, path, value))
    with pytest.raises(PartitionError) as info:
        validate_plan(json.loads(text))
    assert message in str(info.value) and "\n" not in str(info.value)
    saved = (plan_dir / "plan.json").read_text()
    try:
        (plan_dir / "plan.json").write_text(text)
        for verb in ("run", "simulate"):  # never a traceback, never a hang
            one_error(capsys, [verb, plan_dir], message.partition(":")[0])
    finally:
        (plan_dir / "plan.json").write_text(saved)


def test_declared_free_keys_pass(plan_dir):
    """plan.json's keys beyond the Plan fields are declared; free data lives under them."""
    body = json.loads((plan_dir / "plan.json").read_text())
    body["program"], body["program_sha256"] = "model.pt2", "0" * 64
    body["trained_from"] = "/somewhere/plan"
    body["costs"]["anything"] = [1, 2]
    validate_plan(body)
    validate_cluster({"machines": 2, "intra": {"bandwidth_gbps": 1}})
    validate_costs({"fingerprint": "sha256:abc", "device": "cpu", "settings": {"x": 1},
                    "nodes": {"a": {"forward_ms": 1}}})


@pytest.mark.parametrize(("body", "message"), [
    (("top", "plan_sha256", "0"), "plan.json: unknown key 'plan_sha256' (did you mean "
                                  "'program_sha256'?)"),
    (("stage", "replica", 2), "plan.json: stages[0]: unknown key 'replica' (did you mean "
                              "'replicas'?)"),
    (("stage", "fx_units", [1]), "plan.json: stages[0]: unknown key 'fx_units'"),
    (("io", "dtyp", "float32"), "plan.json: inputs[0]: unknown key 'dtyp' (did you mean "
                                "'dtype'?)"),
    (("predicted", "compute", 1.0), "plan.json: stages[0].predicted: unknown key 'compute' "
                                    "(did you mean 'compute_ms'?)"),
    (("link", "latency", 1.0), "plan.json: link: unknown key 'latency' (did you mean "
                               "'latency_ms'?)"),
])
def test_a_misspelled_plan_key_is_named(plan_dir, body, message):
    plan = json.loads((plan_dir / "plan.json").read_text())
    where, key, value = body
    {"top": plan, "stage": plan["stages"][0], "io": plan["inputs"][0],
     "predicted": plan["stages"][0]["predicted"], "link": plan["link"]}[where][key] = value
    with pytest.raises(PartitionError) as info:
        validate_plan(plan)
    assert str(info.value) == message


def test_a_misspelled_cluster_key_is_named(capsys, tmp_path):
    """The issue's case: ``memory_gbs`` was ignored and the default (unlimited) used."""
    model = save(CHAIN, tmp_path / "m.onnx")
    bad = tmp_path / "bad.json"
    for body, message in [
        ({"machines": 2, "memory_gbs": 8}, "unknown key 'memory_gbs' (did you mean "
                                           "'memory_gb'?)"),
        ({"intra": {"bandwidth_gbps": 5, "latancy_ms": 1}}, "intra: unknown key 'latancy_ms' "
                                                             "(did you mean 'latency_ms'?)"),
    ]:
        bad.write_text(json.dumps(body))
        err = one_error(capsys, ["partition", model, "--batch-size", "2", "--cluster", bad,
                                 "-o", tmp_path / "out"], message)
        assert f"cluster file {bad}: {message}" in err
        assert not (tmp_path / "out").exists()


def test_a_misspelled_costs_key_is_named(capsys, tmp_path):
    model = save(CHAIN, tmp_path / "m.onnx")
    (tmp_path / "c.json").write_text(json.dumps({"nodes": {"a": {"forward_ms": 1,
                                                                 "backwards_ms": 2}}}))
    one_error(capsys, ["partition", model, "-s", "2", "--batch-size", "2", "--costs",
                       tmp_path / "c.json", "-o", tmp_path / "out"],
              f"costs file {tmp_path / 'c.json'}: nodes.a: unknown key 'backwards_ms' (did you "
              "mean 'backward_ms'?)")


CLUSTER_CASES = [
    ({"intra": {"bandwidth_gbps": math.nan}}, "intra.bandwidth_gbps: Input should be a finite"),
    ({"intra": {"bandwidth_gbps": -5}}, "intra.bandwidth_gbps: Input should be greater than or"),
    ({"inter": {"bandwidth_gbps": 1, "latency_ms": -1}}, "inter.latency_ms: Input should be"),
    ({"speed": math.inf}, "speed: Input should be a finite number"),
    ({"machines": 2.7}, "machines: Input should be a valid integer, got 2.7"),
    ({"intra": {"bandwidth_gbps": "fast"}}, "intra.bandwidth_gbps: Input should be a valid "
                                            "number, got 'fast'"),
    ({"memory_gb": 0}, "memory_gb: Input should be greater than 0"),
    ({"machines": 4096, "devices_per_machine": 4096}, "machines x devices_per_machine is more"),
    ({"kind": "tpu"}, "kind: Input should be 'cpu' or 'cuda'"),
]


@pytest.mark.parametrize(("body", "message"), CLUSTER_CASES)
def test_cluster_fields_are_checked_by_name(capsys, tmp_path, body, message):
    model = save(CHAIN, tmp_path / "m.onnx")
    (tmp_path / "c.json").write_text(json.dumps(body))  # NaN and Infinity as JSON extensions
    one_error(capsys, ["partition", model, "--batch-size", "2", "--cluster", tmp_path / "c.json",
                       "-o", tmp_path / "out"], message)
    assert not (tmp_path / "out").exists()


COSTS_CASES = [
    ({"nodes": {"a": {"forward_ms": "1"}}}, "nodes.a.forward_ms: Input should be a valid number"),
    ({"nodes": {"a": {"forward_ms": math.nan}}}, "nodes.a.forward_ms: Input should be a finite"),
    ({"nodes": {"a": {"forward_ms": -1}}}, "nodes.a.forward_ms: Input should be greater than"),
    ({"nodes": {"a": {}}}, "nodes.a.forward_ms: Field required"),
    ({"nodes": []}, "nodes: Input should be a valid dictionary"),
    ({"unit": "s", "nodes": {}}, "unit: Input should be 'ms'"),
]


@pytest.mark.parametrize(("body", "message"), COSTS_CASES)
def test_costs_fields_are_checked_by_name(capsys, tmp_path, body, message):
    model = save(CHAIN, tmp_path / "m.onnx")
    (tmp_path / "c.json").write_text(json.dumps(body))
    one_error(capsys, ["partition", model, "-s", "2", "--batch-size", "2", "--costs",
                       tmp_path / "c.json", "-o", tmp_path / "out"], message)


def test_no_infinity_is_ever_written(tmp_path):
    """All-zero costs make the bottleneck 0: the throughput is left out, not Infinity."""
    model = save(CHAIN, tmp_path / "m.onnx")
    (tmp_path / "c.json").write_text(json.dumps({"nodes": {k: {"forward_ms": 0} for k in
                                                           "abdefy"}}))
    assert main(["partition", str(model), "-s", "2", "--batch-size", "2", "--bandwidth", "0",
                 "--latency", "0", "--costs", str(tmp_path / "c.json"), "-o",
                 str(tmp_path / "out")]) == 0
    json.loads((tmp_path / "out" / "plan.json").read_text(),
               parse_constant=lambda c: pytest.fail(f"plan.json holds {c}"))
