"""The planner's memory is the stage files' at every boundary (issue 20, "One figure
everywhere"): for any cut, the bytes the planner checks per stage (its per-stage sums and the
hybrid DP's interval tables) equal :func:`~onnx_partition.graph_arrays.stage_sizes`' count of the
stage files, which is what the plan states and ``simulate`` and ``report`` replay, term by
term: weights (a tied weight in every stage reading it, a constant in every stage copying it,
an initializer output in the last stage), trainable bytes, activations, and what the runtime
receives and sends (:func:`~onnx_partition.pipeline.layout.relay_names`: a tensor relayed
through a stage counts in both its buffers)."""

from __future__ import annotations

import numpy as np
import onnx.parser
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.graphs import SKIP, relay_model
from support.memory import both_counts, planner_inputs

from onnx_partition.graph import from_model, load
from onnx_partition.graph.emit import cut_stages
from onnx_partition.graph_arrays import stage_sizes, trainable_parameters
from onnx_partition.pipeline.memory import StageBytes


@st.composite
def cuts(draw: st.DrawFn, n: int) -> list[int]:
    """Boundaries ``0 < b1 < ... < n`` of 2 to 4 stages over ``n`` positions."""
    stages = draw(st.integers(2, min(4, n)))
    inner = draw(st.lists(st.integers(1, n - 1), min_size=stages - 1, max_size=stages - 1,
                          unique=True))
    return [0, *sorted(inner), n]


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), data=st.data())
def test_random_models_agree_at_every_boundary(seed: int, data: st.DataObject) -> None:
    rng = np.random.default_rng(seed)
    graph = from_model(relay_model(rng))
    trainable = data.draw(st.none() | st.sets(st.sampled_from(sorted(graph.initializer_bytes))))
    inputs = planner_inputs(graph, trainable)
    bounds = data.draw(cuts(inputs.problem.num_nodes))
    for train in (True, False):
        assert both_counts(inputs, bounds, train=train).disagreements() == []


@pytest.fixture(scope="module")
def recipes(exported) -> dict:
    out = {}
    for name in ("gpt", "bert", "encdec", "resnet"):
        model = exported(name)
        out[name] = planner_inputs(load(model, batch_size=2), trainable_parameters(model))
    return out


@pytest.mark.parametrize("name", ["gpt", "bert", "encdec", "resnet"])
@settings(max_examples=6, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_recipes_agree_at_every_boundary(name: str, recipes: dict,
                                         data: st.DataObject) -> None:
    """Residual streams, the encoder's output read by every decoder layer, an attention mask
    and model inputs relayed to a later stage: each counted in every stage it crosses."""
    inputs = recipes[name]
    bounds = data.draw(cuts(inputs.problem.num_nodes))
    assert both_counts(inputs, bounds, train=True).disagreements() == []


def test_a_relayed_tensor_is_in_both_buffers_of_every_stage_it_crosses() -> None:
    """SKIP cut [a b | c d | e f y], rows of 2 x 4 floats (32 bytes): ``a`` skips stage 1 and
    ``z`` is read only by stage 2, so stage 0 receives x and z and sends a, b, z; stage 1
    receives b, a, z and sends d, a, z; the weight ``w`` is in every stage."""
    graph = from_model(onnx.parser.parse_model(SKIP), batch_size=2)
    stage_of = {i: (0, 0, 1, 1, 2, 2, 2)[k] for k, i in enumerate(graph.compute_nodes)}
    sizes = stage_sizes(graph, cut_stages(graph, stage_of, 3), train=True)
    assert sizes == [StageBytes(64.0, 64.0, 64.0, 96.0, None),
                     StageBytes(64.0, 64.0, 96.0, 96.0, None),
                     StageBytes(64.0, 96.0, 96.0, 0.0, None)]
    inputs = planner_inputs(graph)
    assert both_counts(inputs, [0, 2, 4, 7], train=True).disagreements() == []


OUTPUT_WEIGHT = """
<ir_version: 8, opset_import: ["" : 17]>
g (float[N, 4] x, float[N, 4] unread) => (float[N, 4] y, float[4, 4] w)
  <float[4, 4] w = {1.0,2,0,0, 0,1,0,0, 0,0,1,0, 0,0,3,1}>
{
  a = MatMul(x, w)
  y = Relu(a)
}
"""


def test_an_initializer_output_is_held_by_the_last_stage_and_an_unread_input_by_none(
) -> None:
    """``w`` is read by stage 0 and is a graph output, so the last stage file holds it too
    (64 bytes each, the planner's holder LAST); the input nobody reads is received by no
    stage."""
    graph = from_model(onnx.parser.parse_model(OUTPUT_WEIGHT), batch_size=2)
    inputs = planner_inputs(graph)
    counts = both_counts(inputs, [0, 1, 2], train=True)
    assert [s.params for s in counts.files] == [64.0, 64.0]
    assert [s.received for s in counts.files] == [32.0, 32.0]
    assert counts.disagreements() == []
