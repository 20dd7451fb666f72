"""The hybrid DP (stages x replicas): exact on tiny inputs, equal to brute force, memory-safe."""

from __future__ import annotations

import itertools
import math
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support.graphs import CHAIN, save
from support.outputs import assert_same, run_whole

from onnx_partition.cost.cluster import Cluster, Link, parse_bytes
from onnx_partition.errors import PartitionError
from onnx_partition.partition import partition
from onnx_partition.pipeline.from_plan import simulate_plan
from onnx_partition.pipeline.memory import StageBytes, memory_per_device
from onnx_partition.plan import read_plan
from onnx_partition.runtime import PipelineSession
from onnx_partition.solve.hybrid import HybridConfig, SequenceCosts, plan_hybrid
from onnx_partition.solve.planner import _dp_plans
from onnx_partition.solve.scoring import RunSpec


def uniform(n: int) -> SequenceCosts:
    return SequenceCosts([1.0] * n, [2.0] * n, [10.0] * n, [1.0] * n, [0.0] * (n + 1))


def test_devices_divide_the_bottleneck():
    for devices, period in ((1, 8.0), (2, 4.0), (4, 2.0), (8, 1.0)):
        plans = plan_hybrid(uniform(8), HybridConfig(devices=devices))
        assert max(s.period_ms for s in plans[0]) == period
        assert all(sum(s.replicas for s in p) <= devices for p in plans)
        assert all(p[0].start == 0 and p[-1].end == 8 for p in plans)


def test_budgets_propose_plans_on_fewer_devices():
    plans = plan_hybrid(uniform(8), HybridConfig(devices=8, budgets=[2, 4]))
    best = {b: min(max(s.period_ms for s in p) for p in plans
                   if sum(s.replicas for s in p) <= b) for b in (2, 4, 8)}
    assert best == {2: 4.0, 4: 2.0, 8: 1.0}  # each budget's own optimum is proposed


def test_pure_data_parallel_is_a_candidate():
    plans = plan_hybrid(uniform(8), HybridConfig(devices=4))
    shapes = [[(s.end - s.start, s.replicas) for s in p] for p in plans]
    assert [(8, 4)] in shapes and [(2, 1)] * 4 in shapes


def test_allreduce_makes_replication_costly_in_training():
    costs = SequenceCosts([1.0] * 4, [2.0] * 4, [1000.0] * 4, [0.0] * 4, [0.0] * 5)
    config = HybridConfig(devices=4, train=True, microbatches=4, link_bytes_per_ms=100.0)
    best = plan_hybrid(costs, config)[0]
    # Data parallelism would all-reduce 4000 bytes; four stages send nothing: pipeline wins.
    assert [s.replicas for s in best] == [1, 1, 1, 1]
    # One heavy layer on a fast link: replicate it 4x, paying a ring all-reduce per iteration.
    single = SequenceCosts([1.0], [2.0], [1000.0], [0.0], [0.0, 0.0])
    (stage,) = plan_hybrid(single, HybridConfig(devices=4, train=True, microbatches=4,
                                                link_bytes_per_ms=1000.0))[0]
    assert stage.replicas == 4
    assert stage.allreduce_ms == pytest.approx(2 * 3 / 4 * 1000 / 1000.0)
    assert stage.period_ms == pytest.approx(3.0 / 4 + stage.allreduce_ms / 4)


def test_memory_limit_is_respected_and_reported():
    costs = SequenceCosts([1.0] * 6, [1.0] * 6, [100.0] * 6, [10.0] * 6, [0.0] * 7)
    config = HybridConfig(devices=3, train=True, microbatches=8, memory_bytes=1300.0)
    for plan in plan_hybrid(costs, config):
        assert all(s.memory_bytes <= 1300.0 for s in plan)
    # On 2 devices the leanest split is 3 + 3 positions; the first stage keeps 2 micro-batches
    # in flight: 4 * 300 + 2 * 30 = 1260 bytes.
    with pytest.raises(PartitionError, match=r"on 2 devices: the plan needing the least \(2 "
                                             r"stages, replicas \[1, 1\]\) is over it in "
                                             r"stage 0 \(positions 0..2\) needs 1.26 kB, 260 B "
                                             r"over; stage 1 \(positions 3..5\) needs 1.23 kB"):
        plan_hybrid(costs, HybridConfig(devices=2, train=True, microbatches=8,
                                        memory_bytes=1000.0))


def test_replicas_in_front_lower_the_stash_issue_22_a():
    """Under 1F1B a stage's memory depends on its neighbours' replica counts: stages [0, 1) and
    [1, 4) on 2 replicas each fit (4 and 4 bytes), period 3.5 + 0.4 / 8; the old DP kept one
    suffix per device count and returned period 7.0."""
    costs = SequenceCosts([2.0, 1.0, 4.0, 2.0], [0.0] * 4, [2.0, 2.0, 2.0, 0.0],
                          [1.0, 0.0, 0.0, 0.0], [0.0] * 5)
    config = HybridConfig(devices=4, memory_bytes=4.0, microbatches=8, train=True,
                          optimizer_factor=1.0, link_bytes_per_ms=10.0)
    best = plan_hybrid(costs, config)[0]
    assert [(s.start, s.end, s.replicas, s.memory_bytes) for s in best] == [
        (0, 1, 2, 4.0), (1, 4, 2, 4.0)]
    assert max(s.period_ms for s in best) == pytest.approx(3.55)


def test_a_plan_fits_when_only_replicas_make_it_fit_issue_22_b():
    """Three units of time 1, activations (1, 0, 0), 2.5 bytes, depth 3 on 4 devices: one
    replica of the first stage would hold 3 micro-batches (3 bytes), two hold 2 (2 bytes)."""
    costs = SequenceCosts([1.0] * 3, [0.0] * 3, [0.0] * 3, [1.0, 0.0, 0.0], [0.0] * 4)
    config = HybridConfig(devices=4, memory_bytes=2.5, microbatches=8, train=True, depth=3)
    best = plan_hybrid(costs, config)[0]
    assert [(s.replicas, s.memory_bytes) for s in best] == [(2, 2.0), (1, 0.0), (1, 0.0)]
    with pytest.raises(PartitionError, match=r"no plan fits in 2 B per device on 3 devices: "
                                             r"the plan needing the least \(3 stages, replicas "
                                             r"\[1, 1, 1\]\) is over it in stage 0 "
                                             r"\(position 0\) needs 3 B, 1 B over$"):
        plan_hybrid(costs, replace(config, devices=3))


def test_memory_error_names_operators_and_never_a_negative_overflow():
    costs = SequenceCosts([1.0] * 4, [0.0] * 4, [0.0] * 4, [1.0, 1.0, 0.0, 0.0], [0.0] * 5,
                          ["/a/MatMul", "/b/Add", "/c/Relu", "/d/MatMul"],
                          ["/a/Relu", "/b/Mul", "/c/Relu", "/d/Softmax"])
    config = HybridConfig(devices=2, memory_bytes=1.0, microbatches=8, train=True)
    with pytest.raises(PartitionError) as caught:
        plan_hybrid(costs, config)
    message = str(caught.value)
    # one stage holds one micro-batch of both stashes; any cut leaves 2 in flight in front
    assert message.endswith("(1 stage, replicas [1]) is over it in stage 0 (/a/MatMul to "
                            "/d/Softmax) needs 2 B, 1 B over"), message
    assert "-" not in message.split("over it in")[1]


def brute(costs: SequenceCosts, config: HybridConfig) -> float:
    """Best bottleneck period over every split, replica assignment and (``config.recompute``
    ``auto``) per-stage recompute flags whose memory per device (the one memory model, whole
    plan) fits (every replica count, as the DP; no stage more replicas than micro-batches;
    9-16 devices: tests/test_hybrid_counts.py)."""
    n = len(costs.forward_ms)
    best = math.inf
    for q in range(1, min(n, config.devices) + 1):
        ways = ([(False,) * q] if config.recompute == "none" or not config.train else
                [(True,) * q] if config.recompute == "all" else
                list(itertools.product((False, True), repeat=q)))
        for inner in itertools.combinations(range(1, n), q - 1):
            bounds = [0, *inner, n]
            most = min(config.devices, config.microbatches)
            for reps in itertools.product(range(1, most + 1), repeat=q):
                if sum(reps) > config.devices:
                    continue
                for flags in ways:
                    if max(plan_memory(costs, config, bounds, reps, flags)) > config.memory_bytes:
                        continue
                    best = min(best, max(plan_stage(costs, config, i, j, reps[k], flags[k])
                                         for k, (i, j) in enumerate(itertools.pairwise(bounds))))
    return best


def plan_memory(costs, config, bounds, reps, flags=None):
    sizes = [StageBytes(sum(costs.param_bytes[i:j]), sum(costs.activation_bytes[i:j]),
                        costs.cut_bytes[i], costs.cut_bytes[j])
             for i, j in itertools.pairwise(bounds)]
    return memory_per_device(sizes, reps, config.microbatches,
                             schedule="1f1b" if config.train else "infer",
                             optimizer_factor=config.optimizer_factor, recompute=flags)


def plan_stage(costs, config, i, j, r, recompute=False):
    n = len(costs.forward_ms)
    cut = [0.0] + [c / config.link_bytes_per_ms + config.link_latency_ms
                   for c in costs.cut_bytes[1:n]] + [0.0]
    compute = sum(costs.forward_ms[i:j]) + (sum(costs.backward_ms[i:j]) if config.train else 0)
    compute += sum(costs.forward_ms[i:j]) if recompute and config.train else 0
    comm = (cut[i] + cut[j]) * (2 if config.train else 1)
    params = sum(costs.param_bytes[i:j])
    allreduce = 0.0
    if config.train and r > 1:
        allreduce = 2 * (r - 1) / r * params / config.link_bytes_per_ms + 2 * (
            r - 1) * config.link_latency_ms
    m = config.microbatches  # the fullest replica runs ceil(M / r) of the M micro-batches
    return (compute + comm) * math.ceil(m / r) / m + allreduce / m


def draw_costs(n: int, data: st.DataObject) -> SequenceCosts:
    """Whole-number costs 0..9 of ``n`` positions, transfers at the inner boundaries."""
    floats = st.integers(0, 9).map(float)
    return SequenceCosts(
        data.draw(st.lists(floats, min_size=n, max_size=n)),
        data.draw(st.lists(floats, min_size=n, max_size=n)),
        data.draw(st.lists(floats, min_size=n, max_size=n)),
        data.draw(st.lists(floats, min_size=n, max_size=n)),
        [0.0, *data.draw(st.lists(floats, min_size=n - 1, max_size=n - 1)), 0.0],
    )


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 5),
    devices=st.integers(1, 4),
    train=st.booleans(),
    data=st.data(),
)
def test_hybrid_dp_matches_brute_force(n, devices, train, data):
    costs = draw_costs(n, data)
    config = HybridConfig(devices=devices, train=train,
                          microbatches=data.draw(st.sampled_from([2, 3, 4])),
                          memory_bytes=data.draw(st.sampled_from([math.inf, 60.0, 150.0])),
                          link_bytes_per_ms=data.draw(st.sampled_from([math.inf, 2.0])),
                          link_latency_ms=data.draw(st.sampled_from([0.0, 0.5])))
    expected = brute(costs, config)
    if math.isinf(expected):
        with pytest.raises(PartitionError, match="no plan fits"):
            plan_hybrid(costs, config)
        return
    plans = plan_hybrid(costs, config)  # exact: "no plan fits" only when none does
    for plan in plans:  # every stage's memory is the whole plan's, and fits
        bounds = [s.start for s in plan] + [n]
        memory = plan_memory(costs, config, bounds, [s.replicas for s in plan])
        assert [s.memory_bytes for s in plan] == memory
        assert max(memory) <= config.memory_bytes
    best = max(s.period_ms for s in plans[0])
    assert best == pytest.approx(expected, rel=1e-9, abs=1e-12)


def test_cluster_spec_basics(tmp_path):
    cluster = Cluster(machines=2, devices_per_machine=4, memory_gb=80, kind="cuda")
    assert cluster.devices == 8
    assert [cluster.device_name(i) for i in (0, 5)] == ["m0/cuda:0", "m1/cuda:1"]
    assert cluster.link(4) == cluster.intra and cluster.link(5) == cluster.inter
    assert parse_bytes("80GB") == 80e9 and parse_bytes("1MiB") == 2**20
    with pytest.raises(PartitionError, match="cannot read a size"):
        parse_bytes("lots")
    assert Link(0.0).bytes_per_ms == math.inf
    assert np.isclose(Link(10.0).bytes_per_ms, 1e7)


def test_hybrid_plan_end_to_end(tmp_path):
    """A plan with replicas from the planner runs and equals the whole model."""
    model = save(CHAIN, tmp_path / "m.onnx")
    plan = partition(model, 2, tmp_path / "out", batch_size=4, mode="train", microbatches=4,
                     cluster=Cluster(devices_per_machine=4, memory_gb=1.0))
    assert [s.replicas for s in plan.stages] == [len(s.devices) for s in plan.stages]
    assert sum(s.replicas for s in plan.stages) <= 4 and len(plan.stages) == 2
    assert plan.solver.startswith("hybrid-")
    replayed, _ = simulate_plan(read_plan(tmp_path / "out"))  # from plan.json alone
    assert plan.predicted["iteration_ms"] == pytest.approx(replayed.iteration_ms, rel=1e-4)
    feeds = {"x": np.random.default_rng(0).standard_normal((8, 4)).astype(np.float32)}
    with PipelineSession(tmp_path / "out", microbatches=4) as session:
        outputs = dict(zip(
                    [o.name for o in session.get_outputs()], session.run(None, feeds)))
    assert_same(outputs, run_whole(model, feeds))


def test_inference_memory_error_holds_one_microbatch():
    """Inference keeps one micro-batch in flight whatever the replicas: the least-memory plan
    on 2 devices is 2 + 2 positions (14 and 12 bytes), not one a 1F1B count would pick."""
    costs = SequenceCosts([1.0] * 4, [0.0] * 4, [5.0] * 4, [3.0, 1.0, 1.0, 1.0], [0.0] * 5)
    with pytest.raises(PartitionError, match=r"least \(2 stages, replicas \[1, 1\]\) is over it "
                                             r"in stage 0 \(positions 0..1\) needs 14 B, 7 B "
                                             r"over; stage 1 \(positions 2..3\) needs 12 B"):
        plan_hybrid(costs, HybridConfig(devices=2, memory_bytes=7.0, microbatches=8))


@settings(max_examples=80, deadline=None)
@given(n=st.integers(1, 5), devices=st.integers(1, 4), data=st.data())
def test_recompute_per_stage_matches_brute_force(n, devices, data):
    """Recomputation chosen per stage inside the DP (``auto``): its least period within memory
    is the least over every split, replica count and per-stage flag; every plan's stages fit
    as flagged, and a stage recomputes exactly where keeping would not fit."""
    costs = draw_costs(n, data)
    config = HybridConfig(devices=devices, train=True, recompute="auto",
                          microbatches=data.draw(st.sampled_from([2, 3, 4])),
                          memory_bytes=data.draw(st.sampled_from([30.0, 60.0, 100.0])),
                          link_bytes_per_ms=data.draw(st.sampled_from([math.inf, 2.0])))
    expected = brute(costs, config)
    if math.isinf(expected):
        with pytest.raises(PartitionError, match="no plan fits"):
            plan_hybrid(costs, config)
        return
    plans = plan_hybrid(costs, config)
    for plan in plans:
        bounds = [s.start for s in plan] + [n]
        reps, flags = [s.replicas for s in plan], [s.recompute for s in plan]
        assert [s.memory_bytes for s in plan] == plan_memory(costs, config, bounds, reps, flags)
        assert max(s.memory_bytes for s in plan) <= config.memory_bytes
        kept = plan_memory(costs, config, bounds, reps, [False] * len(plan))
        assert flags == [k > config.memory_bytes for k in kept]  # keeping is never slower
        assert [s.period_ms for s in plan] == pytest.approx(
            [plan_stage(costs, config, s.start, s.end, s.replicas, s.recompute) for s in plan])
    assert max(s.period_ms for s in plans[0]) == pytest.approx(expected, rel=1e-9, abs=1e-12)


def test_mixed_recompute_flags_beat_all_keep_and_all_recompute():
    """Forward (4, 3, 4) ms, backward twice that, activations (4, 1, 4) B, no weights or
    transfers, 6 B per device, 3 devices, 4 micro-batches. Best: [0, 2) on 2 replicas
    recomputing, [2, 3) on 1 keeping. The last stage holds 1 micro-batch (4 B, keeps: 3 x 4 =
    12 ms). The first, 2 replicas in front of 1, warms up 2 (boundary step max(2, 1)) and holds
    ceil(3 / 2) = 2: keeping 2 x 5 = 10 B is over, recomputing 5 B + 2 x 0 fits, at
    (3 + 1) x 7 = 28 ms per micro-batch, each replica taking 2 of 4: 14 ms. Keeping everywhere
    nothing fits (a stage holding position 0 or 2 with more than one micro-batch in flight is
    over 6 B); recomputing everywhere the last stage costs 16 ms, and every plan's bottleneck
    is 16 ms, so two DP passes (all keep, all recompute) then flags per stage end at 16."""
    costs = SequenceCosts([4.0, 3.0, 4.0], [8.0, 6.0, 8.0], [0.0] * 3, [4.0, 1.0, 4.0],
                          [0.0] * 4)
    config = HybridConfig(devices=3, memory_bytes=6.0, microbatches=4, train=True,
                          recompute="auto")
    best = plan_hybrid(costs, config)[0]
    assert [(s.start, s.end, s.replicas, s.recompute, s.memory_bytes, s.period_ms)
            for s in best] == [(0, 2, 2, True, 5.0, 14.0), (2, 3, 1, False, 4.0, 12.0)]
    with pytest.raises(PartitionError, match="no plan fits"):
        plan_hybrid(costs, replace(config, recompute="none"))
    every = plan_hybrid(costs, replace(config, recompute="all"))
    assert max(s.period_ms for s in every[0]) == 16.0
    assert all(s.recompute for p in every for s in p)
    assert brute(costs, config) == 14.0


def test_the_planner_also_proposes_the_all_recomputing_cuts():
    """Under auto the planner's DP proposals are the per-stage DP's plan and, besides it, the
    cuts of the DP with every stage recomputing, each stage re-decided (keeping where it fits):
    on the case above [0, 1) | [1, 3) x 2 and [0, 1) | [1, 2) | [2, 3), each with its first
    stage recomputing and within the 6 B, other cuts the simulator may find faster."""
    costs = SequenceCosts([4.0, 3.0, 4.0], [8.0, 6.0, 8.0], [0.0] * 3, [4.0, 1.0, 4.0],
                          [0.0] * 4)
    config = HybridConfig(devices=3, memory_bytes=6.0, microbatches=4, train=True,
                          recompute="auto")
    run = RunSpec(Cluster(devices_per_machine=3), train=True, microbatches=4, recompute="auto")
    proposed = [[(s.start, s.end, s.replicas, s.recompute) for s in p]
                for p in _dp_plans(costs, config, run)]
    assert proposed == [[(0, 2, 2, True), (2, 3, 1, False)],
                        [(0, 1, 1, True), (1, 3, 2, False)],
                        [(0, 1, 1, True), (1, 2, 1, False), (2, 3, 1, False)]]
    assert all(s.memory_bytes <= 6.0 for p in _dp_plans(costs, config, run) for s in p)


def test_memory_error_names_the_recomputing_stages():
    """Two positions of 4 B activations, 1 B sent between them, 4 B per device, 2 devices, 8
    micro-batches. Keeping: one stage needs 8 B, a pipeline's first stage (2 in flight)
    1 + 2 x 4 = 9 B: the least is one stage. Recomputing per stage: that first stage needs
    1 + 4 + 2 x 0 = 5 B and the last 4 + 1 = 5 B (keeping it, 1 in flight, is the same): the
    least is the pipeline, its recomputing stage named so."""
    costs = SequenceCosts([1.0] * 2, [1.0] * 2, [0.0] * 2, [4.0, 4.0], [0.0, 1.0, 0.0])
    config = HybridConfig(devices=2, memory_bytes=4.0, microbatches=8, train=True,
                          recompute="auto")
    with pytest.raises(PartitionError, match=r"least \(2 stages, replicas \[1, 1\]\) is over "
                                             r"it in stage 0 \(position 0\) needs 5 B "
                                             r"recomputing, 1 B over; stage 1 \(position 1\) "
                                             r"needs 5 B, 1 B over$"):
        plan_hybrid(costs, config)
    with pytest.raises(PartitionError, match=r"least \(1 stage, replicas \[1\]\) is over it "
                                             r"in stage 0 \(positions 0..1\) needs 8 B, 4 B "
                                             r"over$"):
        plan_hybrid(costs, replace(config, recompute="none"))
