"""Mixed GPU fleets (cluster@2 ``groups``): the file, per-kind pricing, the fleet DP against
brute force, never slower than the baselines, and a partition that names each stage's GPU."""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import random
from dataclasses import replace
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper
from support.cli import one_error
from support.graphs import CHAIN, save
from support.problems import chain, dags

from onnx_partition import export
from onnx_partition.cli import main
from onnx_partition.cost.aten import ANALYTIC_BACKWARD, backward_per_node
from onnx_partition.cost.cluster import Cluster, Fleet, GpuGroup, Link, load_cluster
from onnx_partition.cost.devices import gpu
from onnx_partition.cost.engine_price import EngineTerms
from onnx_partition.cost.kinds import price_kinds
from onnx_partition.errors import PartitionError
from onnx_partition.graph import load
from onnx_partition.partition import partition
from onnx_partition.pipeline.schedules import PLANNED_NAMES as PLANNED
from onnx_partition.pipeline.schedules import build
from onnx_partition.pipeline.simulate import simulate
from onnx_partition.plan import Plan, plan_text, read_plan
from onnx_partition.plan.contracts import FLEET_FORMAT
from onnx_partition.solve.fleet import (
    FleetSequence,
    KindCosts,
    as_slowest,
    fastest_alone,
    fleet_dp,
    place_on_groups,
    plan_fleet,
    polish_fleet,
    score_fleet,
    stage_period,
)
from onnx_partition.solve.hybrid import replica_choices
from onnx_partition.solve.problem import DagProblem
from onnx_partition.solve.scoring import NodeArrays, RunSpec

A100_V100 = {
    "format": FLEET_FORMAT, "inter": {"bandwidth_gbps": 25, "latency_ms": 0.02},
    "groups": [
        {"gpu": "a100-80gb", "machines": 1, "devices_per_machine": 4,
         "intra": {"bandwidth_gbps": 300, "latency_ms": 0.005}},
        {"gpu": "v100", "machines": 2, "devices_per_machine": 2, "memory_gb": 16,
         "intra": {"bandwidth_gbps": 150, "latency_ms": 0.005}},
    ],
}


def write(tmp_path: Path, body: object, name: str = "c.json") -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(body))
    return path


# --------------------------------------------------------------------------- cluster@2


def test_a_fleet_file_reads_with_datasheet_memory_and_machines_in_file_order(tmp_path):
    fleet = load_cluster(write(tmp_path, A100_V100))
    assert isinstance(fleet, Fleet)
    a100, v100 = fleet.groups
    assert (a100.gpu, a100.devices, a100.memory) == ("a100-80gb", 4, 79.5)  # the datasheet's
    # less the CUDA context's 0.5 GB
    assert (v100.gpu, v100.devices, v100.memory) == ("v100", 4, 16.0)  # as given
    assert fleet.inter == Link(25.0, 0.02) and v100.intra == Link(150.0, 0.005)
    assert fleet.devices == 8 and fleet.kinds == ["a100-80gb", "v100"]
    assert fleet.machine_offset == [0, 1]
    assert [fleet.device_name(0, 3), fleet.device_name(1, 0), fleet.device_name(1, 3)] == [
        "m0/cuda:3", "m1/cuda:0", "m2/cuda:1"]
    body = fleet.to_json()
    assert body["format"] == FLEET_FORMAT and body["groups"][0]["memory_gb"] == 79.5
    assert load_cluster(write(tmp_path, body, "again.json")) == Fleet(
        groups=(GpuGroup("a100-80gb", 1, 4, 79.5, Link(300.0, 0.005)), v100),
        inter=fleet.inter)


def test_a_cluster_at_1_file_still_reads(tmp_path):
    body = {"format": "onnx-partition/cluster@1", "kind": "cuda", "gpu": "v100",
            "machines": 2, "devices_per_machine": 4, "memory_gb": 32}
    assert load_cluster(write(tmp_path, body)) == Cluster(2, 4, 32.0, kind="cuda", gpu="v100")


@pytest.mark.parametrize(("change", "text"), [
    ({"gpu": "h100"}, "'groups' describes each kind of GPU; drop the top-level 'gpu'"),
    ({"machines": 2, "memory_gb": 8}, "drop the top-level 'machines', 'memory_gb'"),
    ({"format": "onnx-partition/cluster@1"},
     "'groups' (a mixed fleet) needs \"format\": \"onnx-partition/cluster@2\""),
    ({"groups": []}, "groups: List should have at least 1 item"),
    ({"groups": [{"gpu": "v100", "memory": 16}]},
     "groups[0]: unknown key 'memory' (did you mean 'memory_gb'?)"),
    ({"groups": [{"gpu": "k80"}]}, "unknown GPU 'k80'"),
    ({"groups": [{"gpu": "v100", "machines": 0}]}, "groups[0].machines"),
    ({"speeds": 2}, "unknown key 'speeds'"),
])
def test_a_bad_fleet_file_is_one_line_and_exit_2(tmp_path, capsys, change, text):
    path = write(tmp_path, {**A100_V100, **change})
    model = save(CHAIN, tmp_path / "m.onnx")
    one_error(capsys, ["partition", str(model), "--batch-size", "2", "--cluster", str(path),
                       "-o", str(tmp_path / "out")], text)
    assert not (tmp_path / "out").exists()


def test_the_docs_fleet_example_reads(tmp_path):
    files = (Path(__file__).resolve().parents[1] / "docs" / "files.md").read_text()
    start = files.index('```json\n{"format": "onnx-partition/cluster@2"') + len("```json\n")
    example = files[start:files.index("```", start)]
    fleet = load_cluster(write(tmp_path, json.loads(example)))
    assert isinstance(fleet, Fleet) and fleet.kinds == ["a100-80gb", "v100"]


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_a_fleet_takes_a_fixed_depth(tmp_path, capsys, depth):
    """``--stages N`` on a fleet: the plan has exactly N stages (the fleet DP's fixed depth,
    each group alone and the as-slowest plan at that depth), its figure the one ranked by;
    more stages than the model has operators is one line, exit 2."""
    model = save(CHAIN, tmp_path / "m.onnx")
    cluster = str(write(tmp_path, A100_V100))
    out = tmp_path / f"o{depth}"
    assert main(["partition", str(model), "--batch-size", "4096", "--stages", str(depth),
                 "--cluster", cluster, "-o", str(out), "--mode", "train",
                 "--no-program"]) == 0
    capsys.readouterr()
    plan = read_plan(out)
    assert len(plan.stages) == depth
    ranked = min(f["iteration_ms"] for f in plan.extra["orderings"].values())
    assert plan.predicted["iteration_ms"] == pytest.approx(ranked, abs=2e-6)
    one_error(capsys, ["partition", str(model), "--batch-size", "2", "--gpu", "h100",
                       "--cluster", cluster, "-o", str(tmp_path / "o")],
              "--gpu prices one kind of GPU; a fleet's groups name theirs")


def test_a_fleet_takes_no_more_stages_than_it_can_cut(tmp_path, capsys):
    model = save(CHAIN, tmp_path / "m.onnx")
    one_error(capsys, ["partition", str(model), "--batch-size", "2", "--stages", "40",
                       "--cluster", str(write(tmp_path, A100_V100)), "-o", str(tmp_path / "o")],
              "--stages 40 is not possible: the model has 6 operators to cut")


def test_groups_in_a_cluster_at_1_shape_are_never_silently_ignored(tmp_path):
    with pytest.raises(PartitionError, match="drop the top-level 'gpu', 'machines'"):
        load_cluster(write(tmp_path, {"kind": "cuda", "gpu": "h100", "machines": 2,
                                      "groups": [{"gpu": "v100"}]}))


# --------------------------------------------------------------------------- the DP


def brute_force(seq: FleetSequence, fleet: Fleet, run: RunSpec,
                ordering: tuple[int, ...], recompute: str = "none",
                depth: int | None = None) -> float:
    """The least bottleneck over every split (of ``depth`` stages where given), group
    assignment along ``ordering`` (each group one run of stages or none), replica counts and
    (``auto``) each stage keeping or recomputing, by enumeration."""
    n, best = seq.n, math.inf
    for cuts in itertools.product([False, True], repeat=n - 1):
        bounds = [0, *[i + 1 for i, c in enumerate(cuts) if c], n]
        spans = list(itertools.pairwise(bounds))
        if depth is not None and len(spans) != depth:
            continue
        for pos in itertools.product(range(len(ordering)), repeat=len(spans)):
            if any(a > b for a, b in itertools.pairwise(pos)):
                continue
            groups = [ordering[p] for p in pos]
            options = [replica_choices(min(fleet.groups[g].devices, run.microbatches))
                       for g in groups]
            flags = [[recompute]] * len(spans) if recompute != "auto" else [["none", "all"]] * \
                len(spans)
            for reps, each in itertools.product(itertools.product(*options),
                                                itertools.product(*flags)):
                used = {g: sum(r for r, h in zip(reps, groups) if h == g) for g in groups}
                if any(used[g] > fleet.groups[g].devices for g in used):
                    continue
                worst = 0.0
                for k, ((i, j), g, r, flag) in enumerate(zip(spans, groups, reps, each)):
                    enter = None if k == 0 else (
                        fleet.groups[g].intra if pos[k - 1] == pos[k] else fleet.inter)
                    leave = None if k == len(spans) - 1 else (
                        fleet.groups[g].intra if pos[k + 1] == pos[k] else fleet.inter)
                    worst = max(worst, stage_period(seq, fleet, run, g, i, j, r, enter, leave,
                                                    recompute=flag))
                best = min(best, worst)
    return best


def random_instance(rng: random.Random) -> tuple[FleetSequence, Fleet, RunSpec]:
    n = rng.randint(1, 4)
    memory = [rng.choice([None, rng.uniform(2e-6, 4e-5)]) for _ in range(2)]
    fleet = Fleet(groups=(
        GpuGroup("a100-80gb", 1, rng.randint(1, 3), memory[0], Link(rng.uniform(1, 9), 0.01)),
        GpuGroup("v100", 1, rng.randint(1, 3), memory[1], Link(rng.uniform(1, 9), 0.01))),
        inter=Link(rng.choice([0.001, 1.0]), 0.02))
    run = RunSpec(fleet.clusters[0], train=rng.random() < 0.5, microbatches=rng.randint(1, 4))
    fwd = [rng.uniform(0.1, 3.0) for _ in range(n)]
    seq = FleetSequence([fwd, [f * rng.uniform(0.5, 3.0) for f in fwd]],
                        [[2 * f for f in fwd], [4 * f for f in fwd]],
                        [rng.uniform(0, 4e3) for _ in range(n)],
                        [rng.uniform(0, 4e3) for _ in range(n)],
                        [0.0, *(rng.uniform(0, 5e3) for _ in range(n - 1)), 0.0])
    return seq, fleet, run


def counted_instance(rng: random.Random) -> tuple[FleetSequence, Fleet, RunSpec]:
    """:func:`random_instance` with the one memory count: weights apart from the trainable
    bytes, stage 0 receiving the graph inputs, a tied initializer several positions hold."""
    seq, fleet, run = random_instance(rng)
    weights = [rng.uniform(0, 4e3) for _ in range(seq.n)]
    return replace(seq, weight_bytes=weights,
                   trainable_bytes=[w * rng.choice([0.0, 1.0]) for w in weights],
                   input_bytes=rng.uniform(0, 5e3),
                   shared=[(rng.uniform(0, 4e3), 0.0,
                            sorted({rng.randrange(seq.n) for _ in range(2)}))]), fleet, run


@pytest.mark.parametrize("seed", range(80))
@pytest.mark.parametrize("recompute", ["none", "all", "auto"])
def test_the_fleet_dp_is_exact_against_brute_force(seed, recompute):
    """Every mode: keeping activations, every stage recomputing (its own memory and forward
    again), and each stage's choice (the brute force tries both for every stage); any depth,
    or (every fourth seed) a fixed one."""
    seq, fleet, run = (random_instance if seed < 40 else counted_instance)(random.Random(seed))
    depth = None if seed % 4 else 1 + seed // 4 % 3
    for ordering in [(0, 1), (1, 0)]:
        value, stages = fleet_dp(seq, fleet, run, ordering, recompute=recompute, depth=depth)
        expected = brute_force(seq, fleet, run, ordering, recompute, depth)
        if math.isinf(expected):
            assert math.isinf(value) and stages == []
            continue
        assert value == pytest.approx(expected, rel=1e-9)
        # the stages it returns reach that value, cover the sequence, each group one run
        assert [s[0] for s in stages] == [0, *(s[1] for s in stages[:-1])]
        assert stages[-1][1] == seq.n
        assert depth is None or len(stages) == depth
        runs = [g for g, _ in itertools.groupby(s[2] for s in stages)]
        assert len(runs) == len(set(runs))
        periods = []
        for k, (i, j, g, r, rebuilt) in enumerate(stages):
            enter = None if k == 0 else (
                fleet.groups[g].intra if stages[k - 1][2] == g else fleet.inter)
            leave = None if k == len(stages) - 1 else (
                fleet.groups[g].intra if stages[k + 1][2] == g else fleet.inter)
            periods.append(stage_period(seq, fleet, run, g, i, j, r, enter, leave,
                                        recompute="all" if rebuilt else "none"))
            # a stage recomputes as the mode says; under auto exactly where keeping does not fit
            keeping = stage_period(seq, fleet, run, g, i, j, r, enter, leave)
            assert rebuilt == (run.train and (recompute == "all" or (
                recompute == "auto" and math.isinf(keeping))))
        assert max(periods) == pytest.approx(value, rel=1e-9)


def test_a_faster_kind_gets_the_longer_stage():
    """Four equal positions, one device of each kind, the second kind 3x slower, free links:
    the fast kind takes three positions, the slow one one (bottleneck 3 ms either way round;
    all four on the fast kind would be 4 ms)."""
    fleet = Fleet(groups=(GpuGroup("a100-80gb", 1, 1), GpuGroup("v100", 1, 1)),
                  inter=Link(0.0, 0.0))
    run = RunSpec(fleet.clusters[0], train=False, microbatches=4)
    seq = FleetSequence([[1.0, 1.0, 1.0, 1.0], [3.0, 3.0, 3.0, 3.0]], [[0.0] * 4] * 2,
                        [0.0] * 4, [0.0] * 4, [0.0] * 5)
    value, stages = fleet_dp(seq, fleet, run, (0, 1))
    assert value == 3.0 and stages == [(0, 3, 0, 1, False), (3, 4, 1, 1, False)]  # 3 fast
    value, stages = fleet_dp(seq, fleet, run, (1, 0))
    assert value == 3.0 and stages == [(0, 1, 1, 1, False), (1, 4, 0, 1, False)]


def test_under_auto_the_fleet_dp_recomputes_only_the_stage_that_must():
    """Two positions (forward 3, 3 ms on the A100, 6, 6 on the V100, backward twice that), the
    first with 2000 B of weights and 3000 B of activations, the second 1000 B of activations;
    2 A100s and 2 V100s of 12000 B each, free links, 4 micro-batches (2 in flight on 2
    replicas). The first position keeping holds 4 * 2000 + 2 * 3000 = 14000 B: it never fits,
    on 2 replicas recomputing 8000 + 3000 = 11000 B (period (3 + 6 + 3) / 2 = 6). So keeping
    everything fits nothing; recomputing everything is 12 ms at best (one stage per A100,
    each (3 + 6 + 3) / 1); recomputing the first on the A100s and keeping the second on the
    V100s ((6 + 12) / 2 = 9 ms) is the least, 9 ms."""
    fleet = Fleet(groups=(GpuGroup("a100-80gb", 1, 2, 1.2e-5, Link(0.0, 0.0)),
                          GpuGroup("v100", 1, 2, 1.2e-5, Link(0.0, 0.0))),
                  inter=Link(0.0, 0.0))
    run = RunSpec(fleet.clusters[0], train=True, microbatches=4)
    seq = FleetSequence([[3.0, 3.0], [6.0, 6.0]], [[6.0, 6.0], [12.0, 12.0]],
                        [2000.0, 0.0], [3000.0, 1000.0], [0.0, 0.0, 0.0])
    assert fleet_dp(seq, fleet, run, (0, 1), recompute="none") == (math.inf, [])
    assert fleet_dp(seq, fleet, run, (0, 1), recompute="all")[0] == 12.0
    value, stages = fleet_dp(seq, fleet, run, (0, 1), recompute="auto")
    assert value == 9.0 and stages == [(0, 1, 0, 2, True), (1, 2, 1, 2, False)]


# --------------------------------------------------------------------------- the planner


@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(case=dags(max_nodes=7), fast=st.integers(1, 3), slow=st.integers(1, 3),
       ratio=st.floats(1.0, 4.0), train=st.booleans(),
       inter=st.sampled_from([0.05, 1.0]), memory=st.sampled_from([None, 0.2]),
       engine=st.sampled_from([None, (0.3, 0.05)]), schedules=st.sampled_from([(), PLANNED]))
def test_the_fleet_plan_is_never_slower_than_either_baseline(case, fast, slow, ratio, train,
                                                             inter, memory, engine, schedules):
    """Only the fastest group, or every device as the slowest kind: the fleet's plan is at
    least as fast as both (links between machines no faster than inside one), also with each
    kind's engine work (the slower kind's ``ratio`` times more) and over several schedules."""
    problem, arrays = case
    fwd, bwd = list(problem.compute_ms), list(arrays.backward_ms)
    fast_engine, slow_engine = ((terms(engine[0], engine[1]),
                                 terms(engine[0] * ratio, engine[1] * ratio))
                                if engine else (None, None))
    kinds = {"a100-80gb": KindCosts(fwd, bwd, fast_engine),
             "v100": KindCosts([f * ratio for f in fwd], [b * ratio for b in bwd],
                               slow_engine)}
    fleet = Fleet(groups=(GpuGroup("a100-80gb", 1, fast, memory, Link(10.0, 0.01)),
                          GpuGroup("v100", 1, slow, memory, Link(5.0, 0.01))),
                  inter=Link(inter, 0.02))
    run = RunSpec(fleet.clusters[0], train=train, microbatches=4)
    baselines = []
    for name in schedules or ("1f1b",):
        each = replace(run, train_schedule=name)
        with contextlib.suppress(PartitionError):
            baselines.append(fastest_alone(problem, arrays, kinds, fleet, each).sim.iteration_ms)
        with contextlib.suppress(PartitionError):
            baselines.append(as_slowest(problem, arrays, kinds, fleet, each)[0].sim.iteration_ms)
    try:
        best, families = plan_fleet(problem, arrays, kinds, fleet, run, schedules=schedules)
    except PartitionError:
        assert not baselines  # nothing fits anywhere
        return
    assert all(best.sim.iteration_ms <= b * (1 + 1e-9) for b in baselines)
    assert best.sim.iteration_ms == min(f["iteration_ms"] for f in families.values()) or \
        best.sim.iteration_ms == pytest.approx(min(f["iteration_ms"]
                                                   for f in families.values()), abs=1e-6)


def terms(step_ms: float, hop_ms: float = 0.0) -> EngineTerms:
    """Engine terms of a kind whose step takes ``step_ms`` and each hop ``hop_ms`` more."""
    return EngineTerms(0.0, step_ms, 0.0, 0.0, hop_ms, {})


def chain_on_two_kinds(a100s: int, microbatches: int, fast: EngineTerms | None = None,
                       slow: EngineTerms | None = None
                       ) -> tuple[DagProblem, NodeArrays, dict[str, KindCosts], Fleet, RunSpec]:
    """A four-node chain (4, 4, 1, 1 ms) on ``a100s`` A100s and two V100s 3x slower, in
    training; ``fast`` and ``slow``: the kinds' engine terms."""
    problem, arrays = chain([4.0, 4.0, 1.0, 1.0])
    fwd, bwd = list(problem.compute_ms), list(arrays.backward_ms)
    kinds = {"a100-80gb": KindCosts(fwd, bwd, fast),
             "v100": KindCosts([3 * f for f in fwd], [3 * b for b in bwd], slow)}
    fleet = Fleet(groups=(GpuGroup("a100-80gb", 1, a100s), GpuGroup("v100", 1, 2)),
                  inter=Link(1.0, 0.01))
    return problem, arrays, kinds, fleet, RunSpec(fleet.clusters[0], train=True,
                                                  microbatches=microbatches)


def test_the_replica_polish_keeps_each_stage_on_its_group_and_only_gains():
    problem, arrays, kinds, fleet, run = chain_on_two_kinds(3, 6)
    start = score_fleet(problem, arrays, kinds, fleet, run, [0, 0, 1, 1],
                        place_on_groups(fleet, [0, 1], [1, 1]), "fleet:test")
    assert start is not None
    polished = polish_fleet(problem, arrays, kinds, fleet, run, start, [0, 1])
    assert polished.sim.iteration_ms < start.sim.iteration_ms
    assert polished.replicas[0] <= 3 and polished.replicas[1] <= 2
    assert polished.gpus == ["a100-80gb", "v100"]
    assert all(d.startswith("m0/") for d in polished.devices[0])
    assert all(d.startswith("m1/") for d in polished.devices[1])


# --------------------------------------------------------------------------- end to end


def test_partition_on_a_fleet_writes_each_stage_gpu_and_simulate_replays_it(tmp_path, capsys):
    model = save(CHAIN, tmp_path / "m.onnx")
    body = {"format": FLEET_FORMAT, "inter": {"bandwidth_gbps": 1, "latency_ms": 0.02},
            "groups": [{"gpu": "a100-80gb", "devices_per_machine": 2},
                       {"gpu": "v100", "devices_per_machine": 2}]}
    out = tmp_path / "plan"
    assert main(["partition", str(model), "--batch-size", "4096", "--cluster",
                 str(write(tmp_path, body)), "-o", str(out), "--mode", "train",
                 "--no-program"]) == 0
    printed = capsys.readouterr().out
    assert "gpu" in printed.splitlines()[0]
    assert "priced by: each GPU kind on its own: a100-80gb by the analytic roofline of " \
           "a100-80gb:tf32; v100 by the analytic roofline of v100:fp32" in printed
    plan = read_plan(out)
    assert all(s.gpu in ("a100-80gb", "v100", "a100-80gb+v100") for s in plan.stages)
    text = (out / "plan.json").read_text()
    raw = json.loads(text)
    assert [s["gpu"] for s in raw["stages"]] == [s.gpu for s in plan.stages]
    assert plan_text(Plan.from_json(raw).to_json()) == text  # reads back to the same bytes
    assert raw["cluster"]["groups"][1]["memory_gb"] == 31.5  # the V100's datasheet less 0.5
    for stage in plan.stages:  # each device named on the machines of its kind
        machines = {d.split("/")[0] for d in stage.devices}
        assert machines <= ({"m0"} if stage.gpu == "a100-80gb" else
                            {"m1"} if stage.gpu == "v100" else {"m0", "m1"})
    assert main(["simulate", str(out)]) == 0
    shown = capsys.readouterr().out
    assert f"({plan.stages[0].devices[0]}, {plan.stages[0].gpu})" in shown
    assert main(["report", str(out), "-o", str(tmp_path / "r.html")]) == 0
    page = (tmp_path / "r.html").read_text()
    assert "used of a fleet: 1 machine × 2 a100-80gb (79.5 GB each, stages " in page
    assert "Each GPU kind&#x27;s memory: a100-80gb 79.5 GB, v100 31.5 GB" in page


def test_costs_per_kind_are_keyed_by_the_groups_gpu(tmp_path, capsys):
    model = save(CHAIN, tmp_path / "m.onnx")
    cluster = write(tmp_path, {"format": FLEET_FORMAT, "groups": [
        {"gpu": "a100-80gb", "devices_per_machine": 2}, {"gpu": "v100"}]})
    costs = write(tmp_path, {"format": "onnx-partition/costs@1", "unit": "ms",
                             "device": "cuda:0", "nodes": {
                                 k: {"forward_ms": 1.0} for k in "abdef"}}, "v.json")
    out = tmp_path / "plan"
    base = ["partition", str(model), "--batch-size", "2", "--cluster", str(cluster),
            "-o", str(out)]
    assert main([*base, "--costs", f"v100={costs}"]) == 0
    printed = capsys.readouterr().out
    assert f"v100 by costs file {costs}" in printed
    assert "a100-80gb by the analytic roofline" in printed
    kinds = read_plan(out).device_model["kinds"]  # type: ignore[index]
    assert kinds["v100"]["source"] == "costs" and kinds["a100-80gb"]["source"] == "analytic"
    one_error(capsys, [*base, "--force", "--costs", f"h100={costs}"],
              "--costs h100=FILE: no group of the fleet has gpu 'h100' (its kinds: "
              "a100-80gb, v100)")
    one_error(capsys, [*base, "--force", "--costs", str(costs)],
              "the fleet has 2 GPU kinds (a100-80gb, v100): give a costs file per kind")
    one_error(capsys, ["partition", str(model), "--batch-size", "2", "--devices", "2",
                       "-o", str(tmp_path / "p2"), "--costs", f"v100={costs}"],
              "--costs KIND=FILE prices the GPU kinds of a fleet")
    cpu = write(tmp_path, {**json.loads(costs.read_text()), "device": "cpu"}, "cpu.json")
    assert main([*base, "--force", "--costs", f"v100={cpu}"]) == 0
    assert (f"warning: costs file {cpu} for v100 was measured on cpu, not a GPU"
            in capsys.readouterr().err)
    one_error(capsys, [*base, "--force", "--costs", f"v100={cpu}", "--strict-costs"],
              "measured on cpu, not a GPU: its times may not fit it (--strict-costs)")


# --------------------------------------------------------------------------- engine terms


def test_each_stage_is_scored_with_its_own_kinds_engine():
    """The A100's step 1 ms, the V100's 5 ms and 0.5 ms per hop: a stage on the V100 steps in
    5 ms, a stage over both kinds in the slower's 5, the boundary plays 0.5 ms more; the
    simulated iteration is that of the costs with those hops (what ``simulate`` replays)."""
    problem, arrays, kinds, fleet, run = chain_on_two_kinds(2, 4, terms(1.0), terms(5.0, 0.5))
    split = score_fleet(problem, arrays, kinds, fleet, run, [0, 0, 1, 1],
                        place_on_groups(fleet, [0, 1], [1, 1]), "fleet:test")
    assert split is not None
    assert [s.step_ms for s in split.costs.stages] == [1.0, 5.0]
    played = replace(split.costs, send_ms=[s + 0.5 for s in split.costs.send_ms])
    assert split.sim.iteration_ms == simulate(build("1f1b", [1, 1], 4), played).iteration_ms
    both = score_fleet(problem, arrays, kinds, fleet, run, [0, 0, 0, 0], [[0, 2]], "x")
    assert both is not None and both.gpus == ["a100-80gb+v100"]
    assert both.costs.stages[0].step_ms == 5.0
    best, families = plan_fleet(problem, arrays, kinds, fleet, run)
    assert best.sim.iteration_ms == pytest.approx(
        min(f["iteration_ms"] for f in families.values()), abs=1e-6)


def test_a_fleet_train_plan_prints_the_figure_it_was_ranked_by(tmp_path, capsys):
    """``partition --mode train`` on a fleet: the iteration printed and replayed by
    ``simulate`` (with the engine's step, priced per kind) is the best candidate's figure."""
    model = save(CHAIN, tmp_path / "m.onnx")
    out = tmp_path / "plan"
    assert main(["partition", str(model), "--batch-size", "4096", "--cluster",
                 str(write(tmp_path, A100_V100)), "-o", str(out), "--mode", "train",
                 "--no-program"]) == 0
    capsys.readouterr()
    plan = read_plan(out)
    ranked = min(f["iteration_ms"] for f in plan.extra["orderings"].values())
    assert plan.predicted["iteration_ms"] == pytest.approx(ranked, abs=2e-6)
    assert all(x > 0 for x in plan.extra["simulator_costs"]["step_ms"])
    assert main(["simulate", str(out)]) == 0
    assert f"iteration of 8 micro-batches: {plan.predicted['iteration_ms']:.3f} ms" in \
        capsys.readouterr().out


def test_a_fleet_is_priced_in_the_plans_precision(tmp_path):
    """``--precision bf16`` prices each kind's products at its half-precision peak, as one
    kind's plan is (the V100's 125 TFLOP/s, not its 15.7 of fp32)."""
    graph = load(save(CHAIN, tmp_path / "m.onnx"), batch_size=65536)
    files = {"a100-80gb": None, "v100": None}
    _, body = price_kinds(graph, files, precision="bf16")
    assert [body["kinds"][k]["name"] for k in files] == ["a100-80gb:bf16", "v100:bf16"]
    assert body["kinds"]["v100"]["peak_tflops"] == 125.0


@pytest.mark.parametrize(("option", "schedule", "recomputed"), [
    (["--schedule", "zb-h1"], "zb-h1", None),
    (["--recompute", "all"], "1f1b", True),
])
def test_a_fleet_plans_the_schedule_and_recomputation_asked(tmp_path, capsys, option,
                                                           schedule, recomputed):
    """``--schedule zb-h1`` and ``--recompute all`` shape a fleet's plan as they do one kind's
    (they were dropped: a 1F1B plan keeping every activation), its figure still the one it
    was ranked by."""
    model = save(CHAIN, tmp_path / "m.onnx")
    out = tmp_path / "plan"
    assert main(["partition", str(model), "--batch-size", "65536", "--cluster",
                 str(write(tmp_path, A100_V100)), "-o", str(out), "--mode", "train",
                 "--no-program", *option]) == 0
    capsys.readouterr()
    plan = read_plan(out)
    assert plan.extra["schedule"] == schedule
    assert all(s.recompute is recomputed for s in plan.stages)
    ranked = min(f["iteration_ms"] for f in plan.extra["orderings"].values())
    assert plan.predicted["iteration_ms"] == pytest.approx(ranked, abs=2e-6)
    if schedule == "zb-h1":
        assert "backward_input_ms" in plan.extra["simulator_costs"]


def matmul_relu_chain(path: Path, width: int, layers: int) -> Path:
    """``layers`` times MatMul by a ``width`` x ``width`` weight then Relu: weights and
    activations of a size where memory binds a fleet."""
    nodes, weights, last = [], [], "x"
    for k in range(layers):
        weights.append(numpy_helper.from_array(np.zeros((width, width), np.float32), f"w{k}"))
        out = "y" if k == layers - 1 else f"r{k}"
        nodes += [helper.make_node("MatMul", [last, f"w{k}"], [f"m{k}"], name=f"mm{k}"),
                  helper.make_node("Relu", [f"m{k}"], [out], name=f"relu{k}")]
        last = out
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", width])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", width])], weights)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, path)
    return path


def test_a_fleet_at_tight_memory_gets_a_dp_plan_whose_stages_recompute(tmp_path, capsys):
    """``--recompute auto`` (the default) at 0.22 GB per device: four 1024-wide layers of
    8192 rows, 2 micro-batches. Keeping activations, the fleet DP's best fitting plan runs
    a stage on both V100s then one on each A100 (22.398 ms simulated); knowing a stage may
    recompute, it puts the first two stages on one A100 each, recomputing, and the rest on
    both V100s, keeping, faster.
    plan.json marks those stages, and ``simulate`` replays the iteration ``partition``
    printed."""
    model = matmul_relu_chain(tmp_path / "m.onnx", 1024, 4)
    body = {**A100_V100, "groups": [
        {"gpu": "a100-80gb", "devices_per_machine": 2, "memory_gb": 0.22},
        {"gpu": "v100", "devices_per_machine": 2, "memory_gb": 0.22}]}
    out = tmp_path / "plan"
    assert main(["partition", str(model), "--batch-size", "8192", "--cluster",
                 str(write(tmp_path, body)), "-o", str(out), "--mode", "train",
                 "--no-program", "--microbatches", "2"]) == 0
    printed = capsys.readouterr().out
    plan = read_plan(out)
    assert plan.solver == "hybrid-fleet"  # the fleet DP's plan won
    raw = json.loads((out / "plan.json").read_text())
    assert [s.get("recompute", False) for s in raw["stages"]] == [True, True, False]
    assert [s["gpu"] for s in raw["stages"]] == ["a100-80gb", "a100-80gb", "v100"]
    assert [len(s["devices"]) for s in raw["stages"]] == [1, 1, 2]
    iteration = plan.predicted["iteration_ms"]
    assert iteration < 22.397606  # the keep-only DP's plan
    assert f"{iteration:.3f} ms" in printed
    assert main(["simulate", str(out)]) == 0
    assert f"iteration of 2 micro-batches: {iteration:.3f} ms" in capsys.readouterr().out


def test_a_fleet_where_nothing_fits_names_the_schedules_tried(tmp_path, capsys):
    model = save(CHAIN, tmp_path / "m.onnx")
    tiny = {**A100_V100, "groups": [{**g, "memory_gb": 1e-9} for g in A100_V100["groups"]]}
    one_error(capsys, ["partition", str(model), "--batch-size", "2", "--mode", "train",
                       "--no-program", "--cluster", str(write(tmp_path, tiny)),
                       "-o", str(tmp_path / "o")],
              "no plan fits the fleet's memory under 1f1b or zb-h1: no stage of the model")
    one_error(capsys, ["partition", str(model), "--batch-size", "2", "--mode", "train",
                       "--no-program", "--cluster", str(write(tmp_path, tiny)), "--stages", "2",
                       "-o", str(tmp_path / "o")],
              "no 2-stage plan fits the fleet under 1f1b or zb-h1")


def test_a_fleet_train_plan_prices_each_kinds_backward_per_aten_op(tmp_path):
    """With the program beside the model, each kind's backward is the aten ops' roofline on
    that kind (as one kind's train plan is priced), not the forward's estimate: each stage's
    backward is its kinds' larger sum over its nodes."""
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(),
                                 torch.nn.Linear(16, 8), torch.nn.LayerNorm(8))
    model = export(module, (torch.randn(2, 8),), tmp_path / "block.onnx", input_names=["x"])
    plan = partition(model, None, tmp_path / "plan", batch_size=4, mode="train",
                     cluster=load_cluster(write(tmp_path, A100_V100)))
    assert plan.extra["costs"]["backward"] == ANALYTIC_BACKWARD
    graph = load(model, batch_size=4)
    index = {n.key: n.index for n in graph.nodes}
    per_kind = {k: backward_per_node(graph, model.with_suffix(".pt2"), gpu(k))
                for k in ("a100-80gb", "v100")}
    for stage in plan.stages:
        expected = max(sum(per_kind[k][index[n]] for n in stage.nodes
                           if not graph.nodes[index[n]].free)
                       for k in str(stage.gpu).split("+"))
        assert stage.predicted is not None
        assert stage.predicted.backward_ms == pytest.approx(expected, abs=1e-6)


def test_a_kind_priced_by_a_costs_file_steps_at_its_own_gpus_bandwidth(tmp_path, capsys):
    """A costs file without an ``engine`` leaves the optimizer step analytic: on the V100's
    900 GB/s for the group whose gpu keys it, not the default GPU's."""
    model = save(CHAIN, tmp_path / "m.onnx")
    costs = write(tmp_path, {"format": "onnx-partition/costs@1", "unit": "ms",
                             "device": "cuda:0", "nodes": {
                                 k: {"forward_ms": 1.0} for k in "abdef"}}, "v.json")
    out = tmp_path / "plan"
    assert main(["partition", str(model), "--batch-size", "2", "--mode", "train",
                 "--no-program", "--cluster", str(write(tmp_path, A100_V100)), "-o", str(out),
                 "--costs", f"v100={costs}"]) == 0
    capsys.readouterr()
    said = read_plan(out).extra["engine_costs"]["step_ms"]
    assert "v100: analytic: 28 B per parameter (adamw) at 900 GB/s (v100:fp32)" in said
    assert "a100-80gb: analytic: 28 B per parameter (adamw) at 2039 GB/s" in said


def test_under_recompute_all_the_fleet_dp_also_splits_for_the_recomputed_times():
    """``--recompute all``: every stage runs its forward twice, which moves the best split
    (the backward here is not proportional to the forward). The DP also splits for those
    times and memory, so the plan is 46.2925 ms; split as if keeping activations: 49.042."""
    problem, arrays = chain([2.0, 4.0, 1.0, 1.0], [0.0, 500.0, 0.0, 500.0], 1000.0)
    fwd, bwd = list(problem.compute_ms), [8.0, 2.0, 1.0, 0.5]
    kinds = {"a100-80gb": KindCosts(fwd, bwd),
             "v100": KindCosts([1.5 * f for f in fwd], [1.5 * b for b in bwd])}
    fleet = Fleet(groups=(GpuGroup("a100-80gb", 1, 2, 2e-5, Link(1.0, 0.01)),
                          GpuGroup("v100", 1, 2, 2e-5, Link(1.0, 0.01))),
                  inter=Link(1.0, 0.01))
    run = RunSpec(fleet.clusters[0], train=True, microbatches=4, recompute="all")
    best, _ = plan_fleet(problem, arrays, kinds, fleet, run, alone=False, slowest=False)
    assert best.sim.iteration_ms == pytest.approx(46.2925, abs=1e-6)
    assert all(s.recompute for s in best.costs.stages)
    assert all(m <= 2e4 for m in best.memory_bytes)
