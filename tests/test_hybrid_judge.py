"""The exact hybrid DP against the CP-SAT judge (real OR-Tools): equal bottleneck periods, and
"no plan fits" exactly when the judge finds none, on the issue's counterexamples, fixed
12-unit instances on 4 devices and random small ones."""

from __future__ import annotations

import math
import random
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from onnx_partition.errors import PartitionError
from onnx_partition.pipeline.memory import StageBytes, memory_per_device
from onnx_partition.solve.hybrid import HybridConfig, SequenceCosts, plan_hybrid
from onnx_partition.solve.hybrid_judge import JudgeResult, judge_hybrid


def dp_period(costs: SequenceCosts, config: HybridConfig) -> float:
    """The DP's least bottleneck period, inf when it says no plan fits."""
    try:
        plans = plan_hybrid(costs, config)
    except PartitionError as error:
        assert "no plan fits" in str(error)
        return math.inf
    return max(s.period_ms for s in plans[0])


def agree(dp: float, judged: JudgeResult) -> bool:
    assert judged.optimal
    if math.isinf(judged.period_ms) or math.isinf(dp):
        return dp == judged.period_ms
    return abs(dp - judged.period_ms) <= 1e-9 + judged.tolerance_ms


def judge_memory(costs: SequenceCosts, config: HybridConfig, judged: JudgeResult) -> list[float]:
    """The one memory model of the judge's plan."""
    sizes = [StageBytes(sum(costs.param_bytes[i:j]), sum(costs.activation_bytes[i:j]),
                        costs.cut_bytes[i], costs.cut_bytes[j]) for i, j, _ in judged.stages]
    return memory_per_device(sizes, [r for _, _, r in judged.stages], config.microbatches,
                             schedule="1f1b" if config.train else "infer",
                             optimizer_factor=config.optimizer_factor)


def test_judge_finds_the_issue_counterexamples():
    a = SequenceCosts([2.0, 1.0, 4.0, 2.0], [0.0] * 4, [2.0, 2.0, 2.0, 0.0],
                      [1.0, 0.0, 0.0, 0.0], [0.0] * 5)
    config = HybridConfig(devices=4, memory_bytes=4.0, microbatches=8, train=True,
                          optimizer_factor=1.0, link_bytes_per_ms=10.0)
    judged = judge_hybrid(a, config)
    assert judged.stages == ((0, 1, 2), (1, 4, 2))
    assert judged.period_ms == pytest.approx(3.55) and agree(dp_period(a, config), judged)
    b = SequenceCosts([1.0] * 3, [0.0] * 3, [0.0] * 3, [1.0, 0.0, 0.0], [0.0] * 4)
    config = HybridConfig(devices=4, memory_bytes=2.5, microbatches=8, train=True, depth=3)
    judged = judge_hybrid(b, config)
    assert [r for _, _, r in judged.stages] == [2, 1, 1] and judged.period_ms == 1.0
    assert judge_memory(b, config, judged) == [2.0, 0.0, 0.0]
    three = HybridConfig(devices=3, memory_bytes=2.5, microbatches=8, train=True, depth=3)
    assert judge_hybrid(b, three).period_ms == math.inf == dp_period(b, three)


@pytest.mark.parametrize("seed", range(4))
def test_dp_equals_the_judge_on_12_units_and_4_devices(seed: int):
    """Training under a memory limit that binds: 12 units, 4 devices, transfers and
    all-reduce priced, M of 4 or 8."""
    rng = random.Random(seed)

    def draw() -> list[float]:
        return [float(rng.randint(0, 9)) for _ in range(12)]

    costs = SequenceCosts(draw(), draw(), draw(), draw(),
                          [0.0, *(float(rng.randint(0, 9)) for _ in range(11)), 0.0])
    config = HybridConfig(devices=4, train=True, microbatches=(4, 8)[seed % 2],
                          memory_bytes=(150.0, 200.0, 300.0)[seed % 3], link_bytes_per_ms=2.0,
                          link_latency_ms=0.5)
    judged = judge_hybrid(costs, config)
    assert max(judge_memory(costs, config, judged)) <= config.memory_bytes
    assert agree(dp_period(costs, config), judged), (dp_period(costs, config), judged)


@settings(max_examples=30, deadline=None)
@given(n=st.integers(1, 6), devices=st.integers(1, 4), train=st.booleans(), data=st.data())
def test_dp_equals_the_judge_on_random_small_instances(n, devices, train, data):
    ints = st.integers(0, 9).map(float)
    costs = SequenceCosts(*(data.draw(st.lists(ints, min_size=n, max_size=n)) for _ in range(4)),
                          [0.0, *data.draw(st.lists(ints, min_size=n - 1, max_size=n - 1)),
                           0.0])
    config = HybridConfig(
        devices=devices, train=train, microbatches=data.draw(st.sampled_from([1, 2, 3, 4, 8])),
        memory_bytes=data.draw(st.sampled_from([math.inf, 20.0, 40.0, 60.0, 150.0])),
        link_bytes_per_ms=data.draw(st.sampled_from([math.inf, 2.0])),
        link_latency_ms=data.draw(st.sampled_from([0.0, 0.5])),
        depth=data.draw(st.sampled_from([None, None, 2])))
    judged = judge_hybrid(costs, config)
    assert agree(dp_period(costs, config), judged), (dp_period(costs, config), judged)


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 6), devices=st.integers(1, 4), data=st.data())
def test_dp_equals_the_judge_with_the_one_count(n, devices, data):
    """Weights apart from the trainable bytes (constants: no gradient nor optimizer state),
    the all-reduced ``param_bytes`` apart from both, and stage 0 receiving the graph inputs
    (partition.stage_sizes' count), initializers several positions hold (a tied parameter)
    in every stage holding one, the optimizer state sharded or not: the DP and the judge
    agree, and the judge's plan fits."""
    ints = st.integers(0, 9).map(float)

    def draw() -> list[float]:
        return data.draw(st.lists(ints, min_size=n, max_size=n))

    weights = draw()
    trained = [w * data.draw(st.sampled_from([0.0, 0.5, 1.0])) for w in weights]
    costs = SequenceCosts(draw(), draw(), draw(), draw(),
                          [0.0, *data.draw(st.lists(ints, min_size=n - 1, max_size=n - 1)),
                           0.0], weight_bytes=weights, trainable_bytes=trained,
                          input_bytes=data.draw(st.sampled_from([0.0, 5.0, 15.0, 30.0])),
                          shared=[(b, b * f, sorted(set(where))) for b, f, where in data.draw(
                              st.lists(st.tuples(st.sampled_from([4.0, 10.0]),
                                                 st.sampled_from([0.0, 1.0]),
                                                 st.lists(st.integers(0, n - 1), min_size=1,
                                                          max_size=3)), max_size=2))])
    config = HybridConfig(
        devices=devices, train=True, microbatches=data.draw(st.sampled_from([1, 2, 4, 8])),
        memory_bytes=data.draw(st.sampled_from([20.0, 40.0, 60.0, 100.0])),
        link_bytes_per_ms=2.0, depth=data.draw(st.sampled_from([None, None, 2])),
        shard=data.draw(st.sampled_from(["none", "optimizer"])))
    judged = judge_hybrid(costs, config)
    assert agree(dp_period(costs, config), judged), (dp_period(costs, config), judged)
    if math.isfinite(judged.period_ms):
        def held(i: int, j: int, what: int) -> float:  # shared ones, once per stage
            return sum(t[what] for t in costs.shared if any(i <= p < j for p in t[2]))

        sizes = [StageBytes(sum(weights[i:j]) + held(i, j, 0), sum(costs.activation_bytes[i:j]),
                            costs.input_bytes if i == 0 else costs.cut_bytes[i],
                            costs.cut_bytes[j], sum(trained[i:j]) + held(i, j, 1))
                 for i, j, _ in judged.stages]
        memory = memory_per_device(sizes, [r for _, _, r in judged.stages],
                                   config.microbatches, schedule="1f1b", shard=config.shard)
        assert max(memory) <= config.memory_bytes


def test_a_tied_parameter_counts_in_each_stage_holding_it():
    """20 bytes per position and 10 both hold, all trained (x4): one stage holds 50 bytes
    (200 with gradients and Adam), each of two stages 30 (120); nothing fits 100 bytes,
    though the positions' own bytes alone (80 per stage) would."""
    costs = SequenceCosts([1.0, 1.0], [0.0, 0.0], [20.0, 20.0], [0.0, 0.0], [0.0, 0.0, 0.0],
                          weight_bytes=[20.0, 20.0], trainable_bytes=[20.0, 20.0],
                          shared=[(10.0, 10.0, [0, 1])])
    config = HybridConfig(devices=2, memory_bytes=100.0, microbatches=1, train=True)
    assert judge_hybrid(costs, config).period_ms == math.inf == dp_period(costs, config)
    roomy = replace(config, memory_bytes=120.0)
    assert judge_hybrid(costs, roomy).stages == ((0, 1, 1), (1, 2, 1))
    assert agree(dp_period(costs, roomy), judge_hybrid(costs, roomy))


def test_the_judge_imports_none_of_the_dps_formulas():
    """The judge writes its own period, all-reduce, warm-up step and memory (docs/design.md):
    it imports only the problem's data types from the solver package."""
    import ast
    import inspect

    import onnx_partition.solve.hybrid_judge as judge

    tree = ast.parse(inspect.getsource(judge))
    imported = {(node.module, alias.name) for node in ast.walk(tree)
                if isinstance(node, ast.ImportFrom) for alias in node.names}
    ours = {pair for pair in imported if (pair[0] or "").startswith("onnx_partition")}
    assert ours == {("onnx_partition.solve.hybrid_model", "HybridConfig"),
                    ("onnx_partition.solve.hybrid_model", "SequenceCosts")}


#: Training, all-reduce and memory both binding: two positions, 4 devices, 4 micro-batches; the
#: least period 6.6 ms on 2 + 2 replicas at 48 bytes per device, none fits below 45.5 bytes.
PERTURBED = (SequenceCosts([4.0, 4.0], [8.0, 8.0], [10.0, 10.0], [3.0, 3.0], [0.0, 2.0, 0.0]),
             HybridConfig(devices=4, train=True, microbatches=4, memory_bytes=50.0,
                          link_bytes_per_ms=10.0, link_latency_ms=0.1))


@pytest.mark.parametrize("formula", ["allreduce", "period", "memory"])
def test_a_perturbed_dp_formula_makes_the_judge_disagree(monkeypatch, formula):
    """Unperturbed the two agree; the DP's ring all-reduce, its stage period or the memory it
    allows scaled by 1.1 (public names of its pricing), and the judge, which prices on its
    own, disagrees."""
    import onnx_partition.solve.hybrid as hybrid
    import onnx_partition.solve.hybrid_tables as tables

    costs, config = PERTURBED
    judged = judge_hybrid(costs, config)
    assert agree(dp_period(costs, config), judged)
    if formula == "allreduce":
        ring = tables.ring_allreduce_ms
        monkeypatch.setattr(tables, "ring_allreduce_ms", lambda *a: 1.1 * ring(*a))
    elif formula == "period":
        period = tables.stage_period
        monkeypatch.setattr(tables, "stage_period", lambda *a: 1.1 * period(*a))
    else:
        caps = hybrid.held_caps
        monkeypatch.setattr(hybrid, "held_caps",
                            lambda t, memory, **k: caps(t, memory / 1.1, **k))
    assert not agree(dp_period(costs, config), judged)


def test_a_perturbed_shard_term_makes_the_judge_disagree(monkeypatch):
    """The optimizer state sharded over 2 + 2 replicas: at 38 bytes per device the plan fits
    only because each replica holds half of its state (unsharded none does); the DP's
    optimizer state (what a replica sheds) scaled by 0.9, and the judge, which writes the shard
    term on its own, disagrees."""
    import onnx_partition.solve.hybrid_tables as tables

    costs, config = PERTURBED
    sharded = replace(config, shard="optimizer", memory_bytes=38.0)
    judged = judge_hybrid(costs, sharded)
    assert judged.stages == ((0, 1, 2), (1, 2, 2)) and agree(dp_period(costs, sharded), judged)
    assert judge_hybrid(costs, replace(sharded, shard="none")).period_ms == math.inf
    state = tables.optimizer_state
    monkeypatch.setattr(tables, "optimizer_state", lambda *a, **k: 0.9 * state(*a, **k))
    assert not agree(dp_period(costs, sharded), judged)
