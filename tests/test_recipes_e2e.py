"""Every recipe x S: valid stage files; chained and pipelined runs equal the whole model."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from support.outputs import assert_same, run_chained, run_whole

from onnx_partition.graph import load
from onnx_partition.partition import partition
from onnx_partition.plan import read_plan
from onnx_partition.runtime import PipelineSession
from onnx_partition.runtime.infer.check import random_feeds

RECIPES = ["resnet", "inception", "unet", "gpt", "bert", "encdec"]


@pytest.mark.parametrize("stages", [2, 3, 4, 8])
@pytest.mark.parametrize("name", RECIPES)
def test_recipe_partitions_exactly(exported, tmp_path, name, stages):
    model = exported(name, "tiny")
    out = tmp_path / "plan"
    plan = partition(model, stages, out, batch_size=4)

    assert [s.index for s in plan.stages] == list(range(stages))
    graph = load(model, batch_size=4)
    cut = [key for s in plan.stages for key in s.nodes]
    assert len(cut) == len(set(cut)), "a node is in two stages"
    assert set(cut) == {n.key for n in graph.nodes if not n.free}, "a node was dropped"
    constants = {key for s in plan.stages for key in s.constants}
    assert constants <= {n.key for n in graph.nodes if n.free}
    assert all(s.nodes for s in plan.stages), "empty stage"
    made_before: set[str] = {i.name for i in plan.inputs}
    for stage in plan.stages:
        path = out / stage.file
        onnx.checker.check_model(str(path), full_check=True)
        assert set(stage.inputs) <= made_before, "a tensor flows backwards"
        made_before |= set(stage.outputs)
        names = {n.name for n in onnx.load(str(path), load_external_data=False).graph.node}
        assert set(stage.nodes) <= names, "stage nodes carry their keys as names"

    feeds = random_feeds(read_plan(out), batch_size=4, seed=stages)
    expected = run_whole(model, feeds)
    assert_same(run_chained(out, feeds), expected)
    session = PipelineSession(out, microbatches=4)
    outputs = session.run(None, feeds)
    assert_same(dict(zip(
                    [o.name for o in session.get_outputs()], outputs)), expected)
    assert session.last_stats.microbatches == 4


def test_pipeline_session_streams_many_microbatches(exported, tmp_path):
    model = exported("resnet", "tiny")
    partition(model, 3, tmp_path / "plan", batch_size=2)
    session = PipelineSession(tmp_path / "plan", microbatches=8)
    feeds = random_feeds(session.plan, batch_size=16, seed=1)
    (logits,) = session.run(None, feeds)
    expected = run_whole(model, feeds)
    assert_same({session.get_outputs()[0].name: logits}, expected)
    assert np.all(np.isfinite(logits))
    assert set(session.last_stats.busy_ms) == {(0, 0), (1, 0), (2, 0)}
