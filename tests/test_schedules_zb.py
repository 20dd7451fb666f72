"""Zero-bubble schedules (ZB-H1, Qi et al., ICLR 2024): the action lists by hand, validation of
split backwards, the simulator's I/W passes against 1F1B and the paper's closed form, and the
memory closed form against the simulator's count."""

from __future__ import annotations

import itertools

import pytest

from onnx_partition.pipeline import schedules
from onnx_partition.pipeline.memory import peak_inflight
from onnx_partition.pipeline.schedules import Action, Kind, ScheduleError, validate, zb_h1
from onnx_partition.pipeline.simulate import PipelineCosts, StageCosts, simulate

#: Checked by hand: stage s runs 1F1B's order (p - s - 1 warm-up forwards, then F and I in
#: turn), its W passes s passes behind its I passes, the rest after the last I.
BY_HAND = {
    (2, 3): ["0F0 0F1 0I0 0W0 0F2 0I1 0W1 0I2 0W2",
             "1F0 1I0 1F1 1I1 1W0 1F2 1I2 1W1 1W2"],
    (3, 4): ["0F0 0F1 0F2 0I0 0W0 0F3 0I1 0W1 0I2 0W2 0I3 0W3",
             "1F0 1F1 1I0 1F2 1I1 1W0 1F3 1I2 1W1 1I3 1W2 1W3",
             "2F0 2I0 2F1 2I1 2F2 2I2 2W0 2F3 2I3 2W1 2W2 2W3"],
    (4, 4): ["0F0 0F1 0F2 0F3 0I0 0W0 0I1 0W1 0I2 0W2 0I3 0W3",
             "1F0 1F1 1F2 1I0 1F3 1I1 1W0 1I2 1W1 1I3 1W2 1W3",
             "2F0 2F1 2I0 2F2 2I1 2F3 2I2 2W0 2I3 2W1 2W2 2W3",
             "3F0 3I0 3F1 3I1 3F2 3I2 3F3 3I3 3W0 3W1 3W2 3W3"],
}


@pytest.mark.parametrize("p,m", sorted(BY_HAND))
def test_zb_h1_action_lists_by_hand(p: int, m: int) -> None:
    sched = zb_h1(p, m)
    assert {dev: " ".join(map(str, acts)) for dev, acts in sched.items()} == {
        (s, 0): BY_HAND[(p, m)][s] for s in range(p)}
    validate(sched, p, m, True)
    assert schedules.build("zb-h1", [1] * p, m) == sched


def test_actions_parse_and_print_i_and_w() -> None:
    assert str(Action(1, Kind.I, 3)) == "1I3"
    assert Action.parse("1W3") == Action(1, Kind.W, 3)
    assert Action.parse(" 0I0 ") == Action(0, Kind.I, 0)
    with pytest.raises(ValueError, match="not an action"):
        Action.parse("1X3")


def test_validate_split_backwards() -> None:
    sched = zb_h1(2, 2)
    sched[(1, 0)].remove(Action(1, Kind.W, 1))
    with pytest.raises(ScheduleError, match="1I1 without 1W1"):
        validate(sched, 2, 2, True)
    sched = zb_h1(2, 2)
    sched[(0, 0)].append(Action(0, Kind.B, 0))
    with pytest.raises(ScheduleError, match="0B0 and 0I0/0W0 both given"):
        validate(sched, 2, 2, True)
    sched = zb_h1(2, 2)
    sched[(0, 0)] = [a for a in sched[(0, 0)] if a.kind is Kind.F]
    with pytest.raises(ScheduleError, match="0B0 is missing"):
        validate(sched, 2, 2, True)
    with pytest.raises(ScheduleError, match="backward in an inference schedule"):
        validate(zb_h1(1, 1), 1, 1, False)


def _costs(p: int, f: float, i: float, w: float, send: float = 0.0) -> PipelineCosts:
    return PipelineCosts([StageCosts(f, i + w, backward_input_ms=i, backward_weight_ms=w,
                                     activation_bytes=10.0, static_bytes=100.0)] * p,
                         [send] * (p - 1))


@pytest.mark.parametrize("p,m", [(2, 2), (2, 5), (3, 3), (4, 4), (4, 8), (5, 12)])
def test_zb_h1_closed_form_and_memory(p: int, m: int) -> None:
    """F = I = W = 1: iteration M (F + I + W) + (p - 1)(F + I - W) (the paper's bubble, a
    third of 1F1B's (p - 1)(F + B)); every stage holds min(p, M) micro-batches, 1F1B's first
    stage's peak."""
    zb = simulate(zb_h1(p, m), _costs(p, 1.0, 1.0, 1.0))
    one = simulate(schedules.build("1f1b", [1] * p, m), _costs(p, 1.0, 1.0, 1.0))
    assert zb.iteration_ms == pytest.approx(3 * m + (p - 1))
    assert one.iteration_ms == pytest.approx(3 * m + 3 * (p - 1))
    held = peak_inflight("zb-h1", [1] * p, m)
    assert held == [min(p, m)] * p
    assert [zb.peak_inflight[(s, 0)] for s in range(p)] == held
    assert max(zb.peak_memory_bytes.values()) == max(one.peak_memory_bytes.values())
    assert zb.peak_memory_bytes[(0, 0)] == 100.0 + 10.0 * min(p, m)


@pytest.mark.parametrize("p,m,f,i,w,send", [
    (2, 4, 1.0, 1.0, 1.0, 0.0), (3, 6, 1.0, 1.5, 0.5, 0.2), (4, 8, 2.0, 1.0, 3.0, 0.5),
    (4, 4, 1.0, 2.0, 0.0, 0.0), (3, 2, 0.5, 1.0, 1.0, 1.0)])
def test_zb_h1_never_slower_than_1f1b(p: int, m: int, f: float, i: float, w: float,
                                      send: float) -> None:
    """With I + W = B, ZB-H1's simulated iteration is at most 1F1B's."""
    costs = _costs(p, f, i, w, send)
    zb = simulate(zb_h1(p, m), costs).iteration_ms
    assert zb <= simulate(schedules.build("1f1b", [1] * p, m), costs).iteration_ms + 1e-9


@pytest.mark.parametrize("replicas", [[1, 2], [2, 2, 1], [2, 1, 3], [1, 1, 1, 2]])
def test_zb_h1_with_replicas_matches_the_closed_form(replicas: list[int]) -> None:
    for m in (1, 3, 6):
        sched = zb_h1(len(replicas), m, replicas)
        validate(sched, len(replicas), m, True, replicas=replicas)
        costs = PipelineCosts([StageCosts(1.0, 2.0, replicas=d) for d in replicas],
                              [0.1] * (len(replicas) - 1))
        sim = simulate(sched, costs)
        want = peak_inflight("zb-h1", replicas, m)
        for s, d in enumerate(replicas):
            assert max(sim.peak_inflight[(s, r)] for r in range(d)) == want[s]


def test_unsplit_backward_halves() -> None:
    """A stage without the split runs I and W in half of its backward each."""
    stage = StageCosts(1.0, 3.0)
    assert stage.split() == (1.5, 1.5)
    assert StageCosts(1.0, 3.0, backward_weight_ms=1.0).split() == (2.0, 1.0)
    assert [stage.duration(k) for k in Kind] == [1.0, 3.0, 1.5, 1.5]


def test_registry_serves_every_verb() -> None:
    for name, spec in schedules.REGISTRY.items():
        assert spec.description and set(spec.modes) <= {"train", "infer"}
        assert schedules.checked_name(name.upper()) == name
    assert "zb-h1" in schedules.TRAIN_NAMES and "zb-h1" in schedules.PLANNED_NAMES
    assert set(schedules.PLANNED_NAMES) == {"1f1b", "zb-h1"}
    for p, m in itertools.product((1, 2, 3), (1, 4)):
        validate(schedules.build("zb-h1", [1] * p, m), p, m, True)


def test_lower_bound_holds_for_split_backwards_and_recomputation() -> None:
    """The planner's branch-and-bound bound (``scoring.lower_bound_ms``) never exceeds the
    simulated iteration: ZB-H1 (its deferred W passes overlap the gradient's way back) and
    1F1B, stages recomputing or not, random costs and replicas."""
    import random

    from onnx_partition.solve.scoring import lower_bound_ms

    rng = random.Random(0)
    for _ in range(300):
        p, m = rng.randint(1, 5), rng.randint(1, 10)
        replicas = [rng.choice([1, 1, 2, 3]) for _ in range(p)]
        stages = []
        for d in replicas:
            backward = rng.uniform(0.1, 5.0)
            stages.append(StageCosts(rng.uniform(0.1, 3.0), backward, d,
                                     rng.choice([0.0, rng.uniform(0.0, 5.0)]),
                                     backward_input_ms=rng.uniform(0.0, backward),
                                     recompute=rng.random() < 0.3))
        costs = PipelineCosts(stages, [rng.uniform(0.0, 2.0) for _ in range(p - 1)])
        for name, split in (("1f1b", False), ("zb-h1", True)):
            sim = simulate(schedules.build(name, replicas, m), costs)
            assert lower_bound_ms(costs, m, True, split=split) <= sim.iteration_ms + 1e-9


def test_backward_split_analytic_and_measured(tmp_path) -> None:
    """Each node's input-gradient share (``partition.grad_input_ms``): without a measured
    split a node without weights is all ``I`` and one with weights half and half; a costs
    file's ``backward_input_ms``/``backward_weight_ms`` split its backward in their ratio."""
    from support.graphs import CHAIN, save

    from onnx_partition.cost.annotate import annotate, load_costs, write_costs
    from onnx_partition.cost.devices import device_for
    from onnx_partition.graph import load
    from onnx_partition.graph_arrays import grad_input_ms

    graph = load(save(CHAIN, tmp_path / "chain.onnx"), batch_size=4)
    node_costs = annotate(graph, device=device_for("cuda", "h100"))
    got = grad_input_ms(graph, node_costs, None)
    weighted = [node.param_bytes > 0 for node in graph.nodes]
    assert any(w and b > 0 for w, b in zip(weighted, node_costs.backward_ms, strict=True))
    assert any(not w and b > 0 for w, b in zip(weighted, node_costs.backward_ms, strict=True))
    assert got == [b / 2 if w else b
                   for w, b in zip(weighted, node_costs.backward_ms, strict=True)]
    path = tmp_path / "costs.json"
    keys = [node.key for node in graph.nodes if node.op_type != "Constant"]
    write_costs(path, {k: {"forward_ms": 1.0, "backward_ms": 2.0, "backward_input_ms": 1.0,
                           "backward_weight_ms": 3.0} for k in keys}, mode="train")
    costs = load_costs(path)
    measured = annotate(graph, costs=costs)
    assert grad_input_ms(graph, measured, costs) == [
        b / 4 if node.key in keys else b
        for node, b in zip(graph.nodes, measured.backward_ms, strict=True)]
