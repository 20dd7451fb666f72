"""plan.json's extras are typed fields (onnx_partition.plan.extras): every one reads into its
record and writes back to the same text; plans the previous code wrote (tests/data/
plans_a34aaa8, written by a34aaa8) read back unchanged; a wrong value inside any of them is a
one-line error naming its path; and the old dict of the extras (``plan.extra``,
``Plan(extra=...)``) reads and writes the typed fields."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from onnx_partition.errors import PartitionError
from onnx_partition.plan import IOSpec, Plan, Stage, plan_text
from onnx_partition.plan.contracts import ClusterFields, FleetFields, Link, PlanPredicted
from onnx_partition.plan.extras import (
    Activations,
    AnalyticDevice,
    Calibrated,
    Candidate,
    CostsDevice,
    CostsSource,
    EngineCosts,
    EngineRun,
    FileEntry,
    HybridPeriodProof,
    IlpResult,
    KindsDevice,
    OrderingResult,
    PipelineProof,
    PlannedOver,
    SimulatorCosts,
)
from onnx_partition.plan.legacy import EXTRAS
from onnx_partition.plan.schema import validate_plan

ROOT = Path(__file__).resolve().parents[1]
OLD_PLANS = sorted((ROOT / "tests" / "data" / "plans_a34aaa8").glob("*.json"))
SHA = "ab" * 32


def base() -> dict[str, Any]:
    return {
        "format": "onnx-partition/plan@2", "model": "../m.onnx",
        "stages": [
            {"index": 0, "file": "stage_0.onnx", "nodes": ["a"], "inputs": ["x"],
             "outputs": ["t"], "replicas": 2, "devices": ["cuda:0", "cuda:1"],
             "predicted": {"compute_ms": 1.5, "comm_ms": 0, "memory_bytes": 64},
             "constants": [], "sha256": "", "shard": "optimizer"},
            {"index": 1, "file": "stage_1.onnx", "nodes": ["b"], "inputs": ["t"],
             "outputs": ["y"], "replicas": 1, "devices": ["cuda:2"], "predicted": None,
             "constants": [], "sha256": "", "recompute": True, "gpu": "v100"},
        ],
        "inputs": [{"name": "x", "dtype": "float32", "shape": ["N", 4], "high": None}],
        "outputs": [{"name": "y", "dtype": "float32", "shape": ["N", 4], "high": None}],
        "mode": "train", "ordering": "topo", "solver": "hybrid-dp",
        "predicted": {"iteration_ms": 3.25, "bubble_fraction": 0.1, "microbatches": 4,
                      "bottleneck_ms": 1.5, "devices_used": 3, "devices_available": 4},
        "program": "", "program_sha256": "",
    }


#: Every extra, with every record field somewhere, in an order no declaration has.
EVERY_EXTRA: dict[str, Any] = {
    "compute_scale": {"forward": 1.25, "backward": 1, "why": "two processes",
                      "parts": {"side_by_side": {"forward": 1.25, "backward": 1.0}}},
    "version": "0.1.0",
    "costs": {"source": "c.json", "measured_nodes": 2, "backward": "measured",
              "check": {"covered_nodes": 2, "compute_nodes": 2, "batch_size": None,
                        "scale": 1.0, "notes": ["note: x"]}, "anything": [1, 2]},
    "input_shapes": {"x": [2, 4]}, "unknown_size_tensors": 0, "batch_size": None,
    "device_model": {"source": "kinds", "kinds": {
        "a100": {"source": "analytic", "name": "a100", "kind": "cuda", "peak_tflops": 19.5,
                 "mem_gbps": 1555, "launch_overhead_ms": 0.005, "figures_from": "datasheet",
                 "backward": "per aten op"},
        "v100": {"source": "costs", "file": "v.json", "measured_on": None,
                 "profiled": "cached profile"}},
        "warning": "w", "sources": {"memory": "datasheet"}},
    "partition_s": 0.5,
    "manifest": {"stage_0.onnx": {"size": 10, "sha256": SHA}},
    "trained_from": "/elsewhere/plan",
    "weights": "none",
    "origin": {"hf": {"class": "LlamaForCausalLM", "config": {"hidden_size": 64}}},
    "calibrated": {"by": "profile --plan", "executor": "torch", "device": "cpu",
                   "threads_per_stage": 1, "repeats": 3, "warmup": 1, "side_by_side": "threads",
                   "converged": True, "chosen_round": 1, "rounds": [
                       {"stages": [1, 1], "priced_ms": [1, 2], "alone_ms": [1.0, 2.0],
                        "together_ms": [1.0, 2.0], "side_by_side_ms": [1.0, 2.0],
                        "pipeline_busy_ms": [1.0, 2.0], "pipeline_iteration_ms": 3.0,
                        "hop_ms": 0.1, "forward_ms": [1.0], "backward_ms": [1.0],
                        "bottleneck_ms": 2.0, "resolved": "same stages"}],
                   "engine_run": {"by": "train", "schedule": "1f1b", "microbatches": 4,
                                  "measured_ms": 9.0, "forward_ms": [1.0, 2.0],
                                  "backward_ms": [2.0, 4.0], "action_ms": [0.1, 0.1],
                                  "barrier_ms": 0.02, "idle_send_ms": [0.3], "hop_ms": 0.05,
                                  "measured_where": {"send_ms": "ping-pong"},
                                  "memory": {"by": "the run", "stages": []}}},
    "optimizer": "adamw", "precision": "bf16", "math": "bf16", "schedule": "zb-h1",
    "recompute": "all",
    "activations": {"source": "saved-tensors", "program": "m.pt2", "total_bytes": 128,
                    "precision": "bf16", "autocast": "cuda", "note": "n"},
    "link": {"bandwidth_gbps": 450, "latency_ms": 0.005},
    "candidates": {"topo": {"dp_ms": 1.5, "refined_ms": 1.5, "positions": 4, "seconds": 0.01},
                   "dfs": {"dp_ms": 1.5, "refined_ms": 1.5, "positions": [2], "seconds": 0}},
    "ilp": {"error": "no solution", "fallback": "dp"},
    "exact": {"kind": "hybrid-period", "proven_optimal": False, "by": "budget",
              "objective": "period", "budget_s": 1.0, "ordering": "topo", "positions": 2,
              "devices": 4, "period_ms": 1.5, "lower_bound_ms": 1.0, "gap": 0.33,
              "plan_period_ms": 1.6, "max_cells": 100, "max_devices": 8, "seconds": 1.0,
              "rounding_ms": 0.0, "period_proven": False, "period_gap": 0.33,
              "iteration_bound_ms": 20.0, "iteration_ms": 24.0},
    "planned_over": {"granularity": "torch-ops", "units": 3, "nodes": 5},
    "cluster": {"format": "onnx-partition/cluster@2", "groups": [
        {"gpu": "a100", "machines": 1, "devices_per_machine": 2, "memory_gb": 80,
         "intra": {"bandwidth_gbps": 300, "latency_ms": 0.005}}], "kind": "cuda",
        "inter": {"bandwidth_gbps": 25, "latency_ms": 0.02}},
    "orderings": {"topo": {"iteration_ms": 3.25}, "grid": {"lower_bound_ms": 3.0},
                  "as-slowest": {"iteration_ms": 4.0, "planned_ms": 3.5}},
    "planning_s": 0.25, "devices_notes": ["4 devices would buy 10%"],
    "allreduce_ms": [0.5, 0],
    "simulator_costs": {"send_ms": [0.1], "hop_bytes": [1000.0], "forward_ms": [1, 2],
                        "backward_ms": [2, 4], "activation_bytes": [8, 8],
                        "static_bytes": [64, 64], "input_bytes": [0, 4],
                        "kept_bytes": [0, 2],
                        "backward_input_ms": [1.0, 2.0], "step_ms": [0.5, 0.5],
                        "accumulate_ms": [0.1, 0.1], "split_ms": [0.0, 0.2],
                        "action_ms": [0.01, 0.01]},
    "engine_costs": {"send_ms": "the fleet's links", "split_ms": "s", "step_ms": "a",
                     "accumulate_ms": "b", "action_ms": "c"},
}

TYPES = {"costs": CostsSource, "device_model": KindsDevice, "calibrated": Calibrated,
         "activations": Activations, "link": Link, "ilp": IlpResult,
         "exact": HybridPeriodProof, "cluster": FleetFields, "simulator_costs": SimulatorCosts,
         "engine_costs": EngineCosts, "planned_over": PlannedOver}


def test_the_fixture_sets_every_extra():
    assert set(EVERY_EXTRA) == set(EXTRAS)


def test_every_extra_reads_typed_and_writes_back_the_same_text():
    body = {**base(), **EVERY_EXTRA}
    text = json.dumps(body, indent=1) + "\n"
    plan = Plan.from_json(json.loads(text))
    for name, kind in TYPES.items():
        assert isinstance(getattr(plan, name), kind), name
    assert isinstance(plan.predicted, PlanPredicted) and plan.predicted.microbatches == 4
    assert isinstance(plan.device_model, KindsDevice)
    assert isinstance(plan.device_model.kinds["a100"], AnalyticDevice)
    assert isinstance(plan.device_model.kinds["v100"], CostsDevice)
    assert plan.device_model.kinds["v100"].measured_on is None
    assert isinstance(plan.calibrated, Calibrated) and plan.calibrated.engine_run is not None
    assert isinstance(plan.calibrated.engine_run, EngineRun)
    assert isinstance(plan.candidates, dict) and isinstance(plan.candidates["dfs"], Candidate)
    assert isinstance(plan.orderings, dict)
    assert isinstance(plan.orderings["grid"], OrderingResult)
    assert isinstance(plan.manifest["stage_0.onnx"], FileEntry)
    assert plan.simulator_costs.hop_bytes == [1000.0] and plan.engine_costs.split_ms == "s"
    assert plan_text(plan.to_json()) == text  # every key, value and order as it was
    assert plan_text(copy.deepcopy(plan).to_json()) == text


def test_a_pipeline_proof_and_one_cluster_read_as_their_records():
    body = {**base(), "exact": {"proven_optimal": True, "by": "chain", "bottleneck_ms": 1.5,
                                "lower_bound_ms": 1.5, "gap": 0.0, "dp_ms": 1.5,
                                "budget_s": 1.0, "seconds": 0.0, "rounding_ms": 0.0},
            "cluster": {"format": "onnx-partition/cluster@1", "machines": 1,
                        "devices_per_machine": 4, "memory_gb": None, "speed": 1.0,
                        "kind": "cuda", "intra": {"bandwidth_gbps": 300, "latency_ms": 0.005},
                        "inter": {"bandwidth_gbps": 25, "latency_ms": 0.02}, "gpu": None},
            "device_model": {"source": "costs", "file": "c.json", "measured_on": "cpu"}}
    plan = Plan.from_json(body)
    assert isinstance(plan.exact, PipelineProof) and plan.exact.proven_optimal
    assert isinstance(plan.cluster, ClusterFields) and plan.cluster.memory_gb == float("inf")
    assert isinstance(plan.device_model, CostsDevice)
    assert plan.to_json() == {**body, "format": "onnx-partition/plan@2"}


@pytest.mark.parametrize("path", OLD_PLANS, ids=[p.stem for p in OLD_PLANS])
def test_a_plan_the_previous_code_wrote_reads_back_unchanged(path):
    text = path.read_text()
    assert plan_text(Plan.from_json(json.loads(text)).to_json()) == text


BAD = [
    ("simulator_costs", {"send_ms": ["x"]},
     "simulator_costs.send_ms[0]: Input should be a valid number, got 'x'"),
    ("simulator_costs", {"step_ms": [-1.0]},
     "simulator_costs.step_ms[0]: Input should be greater than or equal to 0"),
    ("engine_costs", {"step": "a"},
     "engine_costs: unknown key 'step' (did you mean 'step_ms'?)"),
    ("device_model", {"source": "analytic", "name": "a", "kind": "cuda", "peak_tflops": "1",
                      "mem_gbps": 1, "launch_overhead_ms": 0},
     "device_model.peak_tflops: Input should be a valid number, got '1'"),
    ("device_model", {"source": "kinds", "kinds": {"v100": {"source": "costs", "file": 3,
                                                            "measured_on": None}}},
     "device_model.kinds.v100.file: Input should be a valid string, got 3"),
    ("exact", {"kind": "hybrid-period", "proven_optimal": "yes", "by": "bound",
               "objective": "period", "budget_s": 1.0},
     "exact.proven_optimal: Input should be a valid boolean, got 'yes'"),
    ("exact", {"proven_optimal": True, "by": "chain"}, "exact.bottleneck_ms: Field required"),
    ("cluster", {"groups": [{"gpu": "a100", "machines": 0}]},
     "cluster.groups[0].machines: Input should be greater than or equal to 1"),
    ("cluster", {"machines": 2, "memory_gbs": 8},
     "cluster: unknown key 'memory_gbs' (did you mean 'memory_gb'?)"),
    ("calibrated", {**EVERY_EXTRA["calibrated"], "rounds": [{"stages": [1.5]}]},
     "calibrated.rounds[0].stages[0]: Input should be a valid integer, got 1.5"),
    ("candidates", {"topo": {"dp_ms": 1, "refined_ms": 1, "positions": "4", "seconds": 0}},
     "candidates.topo.positions: Input should be a valid integer, got '4'"),
    ("compute_scale", {"forward": 1, "backward": 1, "parts": {"x": {"forward": 1}},
                       "why": ""}, "compute_scale.parts.x.backward: Field required"),
    ("orderings", {"topo": {"iteration": 1.0}},
     "orderings.topo: unknown key 'iteration' (did you mean 'iteration_ms'?)"),
    ("activations", {"source": "outputs", "total_bytes": -1},
     "activations.total_bytes: Input should be greater than or equal to 0"),
    ("ilp", {"optimal": 1}, "ilp.optimal: Input should be a valid boolean, got 1"),
    ("costs", {"source": "c", "measured_nodes": 1, "check": {"covered_nodes": 1}},
     "costs.check.compute_nodes: Field required"),
    ("weights", "empty", "weights: Input should be 'none', 'random' or 'data', got 'empty'"),
    ("origin", {"hf": {"class": "X"}},
     "origin: origin.hf should have the keys 'class' and 'config'"),
    ("manifest", {"stage_0.onnx": {"size": 1, "sha256": "x"}},
     "manifest.stage_0.onnx.sha256: String should match pattern"),
]


@pytest.mark.parametrize(("key", "value", "message"), BAD, ids=[f"{b[0]}-{i}"
                                                                for i, b in enumerate(BAD)])
def test_a_wrong_value_inside_an_extra_is_named_by_its_path(key, value, message):
    with pytest.raises(PartitionError) as info:
        validate_plan({**base(), key: value})
    said = str(info.value)
    assert said.startswith(f"plan.json: {message}") and "\n" not in said


def test_a_plan_built_with_the_old_dict_of_extras_reads_it_into_the_fields():
    plan = Plan("m.onnx", [Stage(0, "s.onnx", ["a"], ["x"], ["y"])],
                [IOSpec("x", "float32", ["N"])], [IOSpec("y", "float32", ["N"])],
                predicted={"bottleneck_ms": 1.0},  # type: ignore[arg-type]
                extra={"link": {"bandwidth_gbps": 5.0, "latency_ms": 0.1},
                       "simulator_costs": {"send_ms": []}, "schedule": "infer"})
    assert plan.link == Link(5.0, 0.1) and plan.simulator_costs.send_ms == []
    assert plan.predicted.bottleneck_ms == 1.0 and plan.schedule == "infer"
    plan.extra["costs"] = {"source": "analytic:cpu", "measured_nodes": 0}
    plan.extra["costs"]["backward"] = "estimated"  # one level deep: read back into the field
    plan.extra.setdefault("devices_notes", []).append("a note")
    plan.extra.pop("schedule")
    assert plan.costs.backward == "estimated" and plan.devices_notes == ["a note"]
    assert plan.schedule is None and "schedule" not in plan.extra
    assert list(plan.to_json())[-4:] == ["link", "simulator_costs", "costs", "devices_notes"]
    with pytest.raises(PartitionError, match=r"unknown key 'trainedfrom' \(did you mean "
                                             r"'trained_from'\?\)"):
        plan.extra["trainedfrom"] = "x"


def test_the_contracts_import_without_pydantic():
    code = ("import sys\nimport onnx_partition.plan.contracts, onnx_partition.plan\n"
            "print('pydantic' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=ROOT, timeout=120, check=True)
    assert done.stdout.strip() == "False"
