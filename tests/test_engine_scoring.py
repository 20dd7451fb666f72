"""The hybrid planner ranks train candidates by the engine terms their final figure is priced
with (cost/engine_price.py's :class:`EngineTerms`, the numbers ``price_engine`` writes): exact on a
two-node chain where the work per hop turns the choice from a pipeline to one device; inference
plans ignore them; the terms are those ``price_engine`` writes."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from support.engine import probed_engine, write_train_costs
from support.problems import chain

from onnx_partition.cost.annotate import load_costs
from onnx_partition.cost.cluster import Cluster, Link
from onnx_partition.cost.engine_price import (
    BARRIERS_PER_STEP,
    EngineTerms,
    engine_terms,
    measured_step_ms,
)
from onnx_partition.solve.planner import plan_cluster
from onnx_partition.solve.scoring import RunSpec, score

#: Two nodes of 1 ms forward (2 ms backward), 4 MB of parameters each, no activation bytes;
#: two devices on a 1 GB/s link without latency, 2 micro-batches.
PROBLEM, ARRAYS = chain([1.0, 1.0], params=[4e6, 4e6], nbytes=0.0)
RUN = RunSpec(Cluster(1, 2, memory_gb=80.0, kind="cuda", intra=Link(1.0, 0.0)), train=True,
              microbatches=2)
HOPS = EngineTerms(0.0, 0.0, 0.0, 0.0, 5.0, {})  # only 5 ms of the engine's work per hop


def test_the_work_per_hop_turns_the_choice_from_a_pipeline_to_one_device() -> None:
    """By hand, 1F1B: two stages, 2 micro-batches: F0 F1 | F0 B0 F1 B1 | B0 B1 ends at 9 ms;
    one device, 2 x (2 + 4) = 12; two replicas, 6 + the ring all-reduce of 8 MB at 1 GB/s,
    8 ms = 14. With 5 ms per hop the pipeline's critical path is stage 0's F0 (1), the hop (5),
    stage 1's F0 B0 F1 B1 (6), the hop back (5) and stage 0's B1 (2): 19, and one device,
    without hops, wins."""
    bare, _ = plan_cluster(PROBLEM, ARRAYS, RUN)
    assert (bare.stage_of, bare.replicas, bare.sim.iteration_ms) == ([0, 1], [1, 1], 9.0)
    priced = dataclasses.replace(RUN, engine=HOPS)
    assert score(PROBLEM, ARRAYS, [0, 1], [1, 1], priced, "pp").sim.iteration_ms == 19.0
    assert score(PROBLEM, ARRAYS, [0, 0], [2], priced, "dp").sim.iteration_ms == 14.0
    chosen, _ = plan_cluster(PROBLEM, ARRAYS, priced)
    assert (chosen.stage_of, chosen.replicas, chosen.sim.iteration_ms) == ([0, 0], [1], 12.0)
    # the sends the plan states stay the link's: price_engine adds the hop's work once
    assert list(score(PROBLEM, ARRAYS, [0, 1], [1, 1], priced, "pp").costs.send_ms) == [0.0]


def test_step_accumulation_and_actions_are_priced_per_stage() -> None:
    """1 ms + 1e-6 ms per parameter byte per step and 0.5 ms per action: each of two stages of
    4 MB steps 5 ms, one device holding both 9 ms; every action is 0.5 ms longer."""
    terms = EngineTerms(1e-6, 1.0, 0.0, 0.5, 0.0, {})
    priced = dataclasses.replace(RUN, engine=terms)
    pp = score(PROBLEM, ARRAYS, [0, 1], [1, 1], priced, "pp")
    assert [s.step_ms for s in pp.costs.stages] == [5.0, 5.0]
    assert [s.action_ms for s in pp.costs.stages] == [0.5, 0.5]
    one = score(PROBLEM, ARRAYS, [0, 0], [1], priced, "one")
    assert one.costs.stages[0].step_ms == 9.0
    # one device: 4 actions of 0.5 ms more and a 9 ms step after 12 ms of compute
    assert one.sim.iteration_ms == pytest.approx(12.0 + 4 * 0.5 + 9.0)


def test_inference_ignores_the_engine_terms() -> None:
    infer = dataclasses.replace(RUN, train=False)
    bare, _ = plan_cluster(PROBLEM, ARRAYS, infer)
    priced, _ = plan_cluster(PROBLEM, ARRAYS, dataclasses.replace(infer, engine=HOPS))
    assert (priced.stage_of, priced.replicas, priced.sim.iteration_ms) == (
        bare.stage_of, bare.replicas, bare.sim.iteration_ms)


def test_the_terms_are_a_costs_files_engine_as_price_engine_reads_it(tmp_path: Path) -> None:
    """A probe's barrier and hop, the optimizer step shared out by bytes, the accumulation."""
    engine = probed_engine(probe_barrier_ms=0.75)
    path = write_train_costs(tmp_path / "costs.json", engine, {})
    terms = engine_terms(load_costs(path), None, "adamw")
    weights = [100.0, 900.0]
    assert terms.step_ms(weights) == pytest.approx(measured_step_ms(weights, "adamw", engine))
    assert terms.step_ms(weights) == pytest.approx([0.2 + BARRIERS_PER_STEP * 0.75,
                                                    1.8 + BARRIERS_PER_STEP * 0.75])
    assert terms.accumulate_ms(weights) == pytest.approx([0.05, 0.45])
    assert (terms.action_ms, terms.hop_ms) == (0.3, 2.0)
    sgd = engine_terms(load_costs(path), None, "sgd")
    assert sgd.step_ms([1000.0]) == pytest.approx([1.0 + BARRIERS_PER_STEP * 0.75])


def test_tied_parameters_and_the_split_backward_are_priced_per_stage() -> None:
    """Three nodes holding 1, 2 and 3 trainable tensors of their own and one 1 MB tied
    parameter read by nodes 0 and 2: cut after node 1, each stage holds the tied one (tied
    bytes 1e6 each: one hop of 0.5 + 1 ms on a 1 GB/s, 0.5 ms link) and 4 trainable tensors
    (2 weight groups, 0.25 ms each under ZB-H1; none for stage 0, whose I is empty); cut
    nowhere, nothing is tied."""
    problem, arrays = chain([1.0, 1.0, 1.0], nbytes=0.0)
    arrays = dataclasses.replace(arrays, weight_bytes=[0.0] * 3, trainable_bytes=[0.0] * 3,
                                 shared=[(1e6, 1e6, (0, 2))], trainable_tensors=[1, 2, 3],
                                 ties_train=True)
    tied, tensors = arrays.stage_engine([0, 0, 1], 2)
    assert (list(tied), list(tensors)) == ([1e6, 1e6], [4.0, 4.0])
    tied, tensors = arrays.stage_engine([0, 0, 0], 1)
    assert (list(tied), list(tensors)) == ([0.0], [7.0])
    terms = EngineTerms(0.0, 0.0, 0.0, 0.0, 0.0, {}, split_call_ms=0.25,
                        link_latency_ms=0.5, link_gbps=1.0)
    run = dataclasses.replace(RUN, engine=terms, train_schedule="zb-h1")
    costs = score(problem, arrays, [0, 0, 1], [1, 1], run, "pp").costs
    assert [s.step_ms for s in costs.stages] == [1.5, 1.5]
    assert [s.split_ms for s in costs.stages] == [0.0, 0.5]
    costs = score(problem, arrays, [0, 0, 1], [1, 1],
                  dataclasses.replace(run, train_schedule="1f1b"), "pp").costs
    assert [s.split_ms for s in costs.stages] == [0.0, 0.0]
    untied = dataclasses.replace(arrays, ties_train=False)  # no program: nothing trains
    assert list(untied.stage_engine([0, 0, 1], 2)[0]) == [0.0, 0.0]
