"""The hybrid DP under ZB-H1 (issue 33 item 3): every stage holds stage 0's window of
micro-batches and keeps, between its ``I`` and ``W`` passes, the output gradients of
``kept_held`` of them (``StageBytes.kept``; stage 0 keeps none). A hand-computed plan that fits
without the kept term and not with it, the DP against brute force written from
pipeline/memory.py's ``memory_per_device``, and the DP's memory with one replica per stage
equal to the plain model's."""

from __future__ import annotations

import itertools
import math
import random
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support.hybrid_brute import compositions, stage_ms

from onnx_partition.errors import PartitionError
from onnx_partition.pipeline.memory import StageBytes, memory_per_device
from onnx_partition.solve import hybrid_exact, hybrid_tables
from onnx_partition.solve.hybrid import (
    HybridConfig,
    SequenceCosts,
    plan_hybrid,
    solve_hybrid,
    stage_memory,
)
from onnx_partition.solve.hybrid_judge import JudgeResult, judge_hybrid

#: Two positions on two devices, two micro-batches, one stage each (depth 2): under ZB-H1
#: W_0 = 1, so both stages hold min(W_0 + 1, M) = 2 micro-batches (1F1B: 2 and 1) and stage 1
#: keeps the gradients of min(1 + W_0 - W_1, 2) = 2 of them, 3 bytes each (stage 0 keeps
#: none). Stage 0: static 1 + 1 (weights, the gradient buffer of its 1-byte send) + 2 x 1
#: = 4; stage 1: static 1 + 2 x (1 + 1 received) = 5, + 2 x 3 kept = 11.
HAND = SequenceCosts([1.0, 1.0], [1.0, 1.0], [1.0, 1.0], [1.0, 1.0], [0.0, 1.0, 0.0],
                     kept_bytes=[5.0, 3.0])
HAND_CONFIG = HybridConfig(devices=2, memory_bytes=8.0, microbatches=2, train=True,
                           optimizer_factor=1.0, depth=2, train_schedule="zb-h1")


def sizes_of(costs: SequenceCosts, spans: list[tuple[int, int]]) -> list[StageBytes]:
    """What pipeline/memory.py counts for each stage: its own sums over the positions (the
    backward's working set: their largest)."""
    kept = costs.kept_bytes or [0.0] * len(costs.forward_ms)
    working = costs.working_bytes or [0.0] * len(costs.forward_ms)
    return [StageBytes(sum(costs.param_bytes[i:j]), sum(costs.activation_bytes[i:j]),
                       costs.cut_bytes[i], costs.cut_bytes[j], None,
                       sum(kept[i:j]) if i > 0 else 0.0, max(working[i:j])) for i, j in spans]


def test_zb_fits_without_the_kept_term_and_not_with_it():
    stages = [(0, 1, 1), (1, 2, 1)]
    assert stage_memory(HAND, HAND_CONFIG, stages) == [4.0, 11.0]
    assert memory_per_device(sizes_of(HAND, [(0, 1), (1, 2)]), [1, 1], 2, schedule="zb-h1",
                             optimizer_factor=1.0) == [4.0, 11.0]
    with pytest.raises(PartitionError, match="no plan fits"):
        plan_hybrid(HAND, HAND_CONFIG)
    unkept = plan_hybrid(replace(HAND, kept_bytes=[]), HAND_CONFIG)[0]
    assert [(s.start, s.end, s.replicas) for s in unkept] == stages
    assert [s.memory_bytes for s in unkept] == [4.0, 5.0]
    # 1F1B keeps nothing between I and W: the same plan fits, stage 1 holding one
    one_f = plan_hybrid(HAND, replace(HAND_CONFIG, train_schedule="1f1b"))[0]
    assert [s.memory_bytes for s in one_f] == [4.0, 3.0]
    # with room for the kept gradients the DP plans it, at the plain model's memory
    roomy = plan_hybrid(HAND, replace(HAND_CONFIG, memory_bytes=11.0))[0]
    assert [s.memory_bytes for s in roomy] == [4.0, 11.0]


def brute_zb(costs: SequenceCosts, config: HybridConfig) -> float:
    """The least bottleneck period over every split, replica counts and (``auto``)
    recomputation flags whose ``memory_per_device`` under the config's schedule fits (inf:
    none); a recomputing stage runs its forward once more."""
    n = len(costs.forward_ms)
    most = min(config.devices, config.microbatches)
    best = math.inf
    again = replace(costs, backward_ms=[b + f for f, b in zip(costs.forward_ms,
                                                               costs.backward_ms)])
    depths = [config.depth] if config.depth else range(1, min(n, config.devices) + 1)
    for q in depths:
        ways = {"none": [(False,) * q], "all": [(True,) * q],
                "auto": list(itertools.product([False, True], repeat=q))}[config.recompute]
        for inner in itertools.combinations(range(1, n), q - 1):
            spans = list(itertools.pairwise([0, *inner, n]))
            for reps, flags in itertools.product(compositions(config.devices, q, most), ways):
                worst = max(stage_ms(again if f else costs, config, i, j, r)
                            for (i, j), r, f in zip(spans, reps, flags, strict=True))
                if worst >= best:
                    continue
                memory = memory_per_device(sizes_of(costs, spans), list(reps),
                                           config.microbatches, schedule=config.train_schedule,
                                           optimizer_factor=config.optimizer_factor,
                                           recompute=list(flags), shard=config.shard)
                if max(memory) <= config.memory_bytes:
                    best = worst
    return best


def draw_costs(data: st.DataObject, n: int) -> SequenceCosts:
    ints = st.integers(0, 9).map(float)

    def draw(size: int = n) -> list[float]:
        return data.draw(st.lists(ints, min_size=size, max_size=size))

    return SequenceCosts(draw(), draw(), draw(), draw(), [0.0, *draw(n - 1), 0.0],
                         kept_bytes=draw(), working_bytes=data.draw(st.sampled_from(
                             [[], draw()])))


@settings(max_examples=80, deadline=None)
@given(n=st.integers(1, 4), devices=st.integers(1, 4), data=st.data())
def test_the_zb_dp_equals_brute_force(n, devices, data):
    """Training under a memory limit, ZB-H1 with kept gradients (or 1F1B), the backward's
    working set or none, keeping, every stage
    recomputing or each where keeping does not fit, the optimizer state sharded or not: the
    DP's least period is brute force's (inf where nothing fits), and its
    plan's memory is the plain model's."""
    costs = draw_costs(data, n)
    config = HybridConfig(devices=devices, train=True,
                          train_schedule=data.draw(st.sampled_from(["zb-h1", "1f1b"])),
                          microbatches=data.draw(st.sampled_from([1, 2, 3, 4])),
                          memory_bytes=data.draw(st.sampled_from([30.0, 60.0, 100.0, 200.0])),
                          link_bytes_per_ms=2.0, depth=data.draw(st.sampled_from([None, 2])),
                          recompute=data.draw(st.sampled_from(["none", "all", "auto"])),
                          shard=data.draw(st.sampled_from(["none", "optimizer"])))
    want = brute_zb(costs, config)
    try:
        plans = plan_hybrid(costs, config)
    except PartitionError as error:
        assert "no plan fits" in str(error)
        assert want == math.inf
        return
    best = plans[0]
    assert max(s.period_ms for s in best) == pytest.approx(want, rel=1e-6)
    spans = [(s.start, s.end) for s in best]
    memory = memory_per_device(sizes_of(costs, spans), [s.replicas for s in best],
                               config.microbatches, schedule=config.train_schedule,
                               optimizer_factor=config.optimizer_factor,
                               recompute=[s.recompute for s in best], shard=config.shard)
    assert [s.memory_bytes for s in best] == pytest.approx(memory)
    assert max(memory) <= config.memory_bytes


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 6), data=st.data())
def test_hybrid_memory_with_one_replica_per_stage_is_the_plain_models(n, data):
    """stage_memory (the DP's tables) of any split, one replica per stage, equals
    pipeline/memory.py's memory_per_device under every train schedule the DP counts, keeping
    or recomputing; with replicas too."""
    costs = draw_costs(data, n)
    q = data.draw(st.integers(1, n))
    inner = sorted(data.draw(st.sets(st.integers(1, n - 1), min_size=q - 1, max_size=q - 1))
                   ) if n > 1 else []
    spans = list(itertools.pairwise([0, *inner, n]))
    schedule = data.draw(st.sampled_from(["1f1b", "zb-h1"]))
    m = data.draw(st.integers(1, 8))
    recompute = data.draw(st.lists(st.booleans(), min_size=len(spans), max_size=len(spans)))
    reps = data.draw(st.sampled_from([[1] * len(spans), data.draw(st.lists(
        st.integers(1, 3), min_size=len(spans), max_size=len(spans)))]))
    config = HybridConfig(devices=sum(reps), train=True, microbatches=m,
                          train_schedule=schedule)
    got = stage_memory(costs, config, [(i, j, r) for (i, j), r in zip(spans, reps)], recompute)
    want = memory_per_device(sizes_of(costs, spans), reps, m, schedule=schedule,
                             recompute=recompute)
    assert got == pytest.approx(want)


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


def test_the_judge_counts_the_kept_term():
    """The hand case: no plan fits with the kept gradients, the 1F1B-shaped one without."""
    assert judge_hybrid(HAND, HAND_CONFIG).period_ms == math.inf
    unkept = judge_hybrid(replace(HAND, kept_bytes=[]), HAND_CONFIG)
    assert unkept.stages == ((0, 1, 1), (1, 2, 1)) and unkept.period_ms == 2.0
    roomy = judge_hybrid(HAND, replace(HAND_CONFIG, memory_bytes=11.0))
    assert roomy.period_ms == 2.0


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 5), devices=st.integers(1, 4), data=st.data())
def test_the_zb_dp_equals_the_judge(n, devices, data):
    """ZB-H1 (or 1F1B) under a memory limit, with the backward's working set or not, the
    optimizer state sharded or not: the DP and the judge (its own kept and working-set
    formulas) agree."""
    costs = draw_costs(data, n)
    config = HybridConfig(devices=devices, train=True,
                          train_schedule=data.draw(st.sampled_from(["zb-h1", "1f1b"])),
                          microbatches=data.draw(st.sampled_from([1, 2, 4])),
                          memory_bytes=data.draw(st.sampled_from([30.0, 60.0, 100.0, 200.0])),
                          link_bytes_per_ms=2.0, depth=data.draw(st.sampled_from([None, 2])),
                          shard=data.draw(st.sampled_from(["none", "optimizer"])))
    judged = judge_hybrid(costs, config)
    assert agree(dp_period(costs, config), judged), (dp_period(costs, config), judged)


#: ZB-H1 on three positions and 3 devices, 3 micro-batches, where the kept gradients bind: the
#: least period 14 ms with them, 10 ms without (and with half of them).
KEPT_BINDS = (SequenceCosts([6.0, 4.0, 3.0], [2.0, 1.0, 5.0], [1.0, 3.0, 3.0], [6.0, 4.0, 6.0],
                            [0.0, 2.0, 1.0, 0.0], kept_bytes=[4.0, 3.0, 4.0]),
              HybridConfig(devices=3, train=True, microbatches=3, memory_bytes=40.0,
                           link_bytes_per_ms=2.0, train_schedule="zb-h1"))


@pytest.mark.parametrize("case", ["hand", "binds"])
def test_a_perturbed_kept_term_makes_the_judge_disagree(monkeypatch, case):
    """Unperturbed the DP and the judge agree; the DP's kept-gradient bytes (its public
    ``kept_table``) scaled by 0.5, and the judge, which writes the kept term on its own,
    disagrees."""
    costs, config = (HAND, HAND_CONFIG) if case == "hand" else KEPT_BINDS
    judged = judge_hybrid(costs, config)
    assert judged.period_ms == (math.inf if case == "hand" else pytest.approx(14.0))
    assert agree(dp_period(costs, config), judged)
    assert judge_hybrid(replace(costs, kept_bytes=[]), config).period_ms < judged.period_ms
    table = hybrid_tables.kept_table
    monkeypatch.setattr(hybrid_tables, "kept_table", lambda *a: 0.5 * table(*a))
    assert not agree(dp_period(costs, config), judged)


@pytest.mark.parametrize("seed", range(30))
def test_the_bounded_zb_dp_plans_fit_and_bracket_the_exact(seed, monkeypatch):
    """The exact DP too large (EXACT_CELLS 0): under ZB-H1 the one-suffix DP takes W_0 = M, so
    its plans fit (memory_per_device's, kept gradients included), never below the exact least
    period, and the relaxation bounds it from below."""
    rng = random.Random(seed)
    n = rng.randint(3, 6)
    forward = [float(rng.randint(1, 6)) for _ in range(n)]
    costs = SequenceCosts(forward, [2.0 * f for f in forward],
                          [float(rng.randint(0, 4)) for _ in range(n)],
                          [float(rng.randint(1, 4)) for _ in range(n)],
                          [0.0, *(float(rng.randint(0, 2)) for _ in range(n - 1)), 0.0],
                          kept_bytes=[float(rng.randint(0, 3)) for _ in range(n)])
    config = HybridConfig(devices=rng.randint(2, 5), memory_bytes=float(rng.randint(14, 40)),
                          microbatches=rng.randint(2, 6), train=True, link_bytes_per_ms=4.0,
                          train_schedule="zb-h1", recompute=rng.choice(["none", "auto"]))
    try:
        exact = solve_hybrid(costs, config)
    except PartitionError:
        exact = None
    monkeypatch.setattr(hybrid_tables, "EXACT_CELLS", 0)
    try:
        bounded = solve_hybrid(costs, config)
    except PartitionError:
        return  # the bounded DP may miss plans, never invent them
    assert exact is not None, "the bounded DP found a plan where none fits"
    if bounded.exact:  # memory free
        assert bounded.period_ms == exact.period_ms
        return
    assert bounded.lower_ms <= exact.period_ms * (1 + 1e-9) <= bounded.period_ms * (1 + 2e-9)
    for plan in bounded.plans:
        spans = [(s.start, s.end) for s in plan]
        memory = memory_per_device(sizes_of(costs, spans), [s.replicas for s in plan],
                                   config.microbatches, schedule="zb-h1",
                                   recompute=[s.recompute for s in plan])
        assert max(memory) <= config.memory_bytes


@settings(max_examples=120, deadline=None)
@given(n=st.integers(1, 7), devices=st.integers(1, 7), data=st.data())
def test_pruned_states_lose_no_plan_within_the_devices(n, devices, data):
    """The exact DP prunes suffix states that no plan on at most ``D`` devices passes through
    (``hybrid_exact.Prune``: their devices and the fewest covering the prefix over ``D``;
    under ZB-H1 a warm-up the boundaries in front would push past ``W_0``). Against the same
    DP with nothing pruned, at bounds a bisection probes: every depth's fewest devices within
    ``D`` and its plan (stages, replicas, recomputation) are the same, and a count over ``D``
    stays over it."""
    costs = draw_costs(data, n)
    config = HybridConfig(devices=devices, train=True,
                          train_schedule=data.draw(st.sampled_from(["zb-h1", "1f1b"])),
                          microbatches=data.draw(st.sampled_from([1, 2, 3, 5, 8])),
                          memory_bytes=data.draw(st.sampled_from([30.0, 60.0, 100.0, 200.0])),
                          link_bytes_per_ms=2.0,
                          recompute=data.draw(st.sampled_from(["none", "all", "auto"])),
                          shard=data.draw(st.sampled_from(["none", "optimizer"])))
    tables = hybrid_tables.StageTables(costs, config)
    caps = hybrid_tables.held_caps(tables, config.memory_bytes)
    caps_rc = (hybrid_tables.held_caps(tables, config.memory_bytes, rebuilt=True)
               if tables.period_rc is not None else None)
    max_q = min(devices, n)
    periods = sorted({float(p) for p in tables.period[np.isfinite(tables.period)]})
    if not periods:
        return

    def answers(tau: float) -> list[tuple[int, list[tuple[int, int, int, bool | None]]]]:
        found = hybrid_exact.exact_fewest(tables, tau, max_q, caps, caps_rc)
        out = []
        for q in range(1, max_q + 1):
            count = found.fewest(q)
            plan = ([(s.start, s.end, s.replicas, s.recompute) for s in found.stages(tables, q)]
                    if count <= devices else [])
            out.append((min(count, devices + 1), plan))
        return out

    for tau in data.draw(st.lists(st.sampled_from(periods), min_size=1, max_size=3)):
        pruned = answers(tau)
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(hybrid_exact.Prune, "apply", lambda self, states, replicas: None)
            whole = answers(tau)
        assert pruned == whole
