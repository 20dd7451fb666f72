"""tools/bench_pipedream.py: the PipeDream profile graph it writes from our graph and costs,
its refusal of a folder that is not PipeDream, and its row when PipeDream runs past its limit."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest
from support.graphs import SKIP, save

ROOT = Path(__file__).resolve().parents[1]


def bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_pipedream",
                                                  ROOT / "tools" / "bench_pipedream.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve their module
    spec.loader.exec_module(module)
    return module


def test_the_profile_graph_holds_every_operator_input_and_edge(tmp_path: Path) -> None:
    model = save(SKIP, tmp_path / "skip.onnx")
    costs, profile, ops = bench().write_inputs(model, tmp_path)
    assert ops == 7
    nodes = json.loads(costs.read_text())["nodes"]
    assert len(nodes) == 7 and all(v["forward_ms"] > 0 for v in nodes.values())
    lines = profile.read_text().splitlines()
    heads = [line for line in lines if not line.startswith("\t")]
    edges = {tuple(line.strip().split(" -- ")) for line in lines if line.startswith("\t")}
    assert [h.split(" -- ")[1] for h in heads[:2]] == ["Input0", "Input1"]  # x, z: dropped
    for head in heads:  # PipeDream's Node.from_str: id -- desc -- four "key=value" fields
        fields = head.split(" -- ")[2].split(", ")
        assert [f.split("=")[0] for f in fields] == [
            "forward_compute_time", "backward_compute_time", "activation_size",
            "parameter_size"]
        float(fields[2].split("=")[1])
    # a = MatMul(x, w) feeds b and e = Add(d, a); z feeds only the last node, y = Mul(f, z)
    assert ("input0", "node0") in edges and ("node0", "node4") in edges
    assert ("input1", "node6") in edges and len(edges) == 9


def test_a_folder_without_pipedream_is_refused(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match=r"has no optimizer/optimizer_graph_hierarchical\.py"):
        bench().optimizer_dir(tmp_path, tmp_path)


def test_past_the_limit_pipedream_shows_as_more_than_it() -> None:
    module = bench()
    ours = [module.Run(2.0, 0.5, 1.25)]
    row = module.row("gpt2", "pipeline", 9, ours, [None], 100.0)
    assert "| > 100.00 | 0.50 | 2.00 | > 200.0x | > 50.0x | (none) | 1.2500 |" in row
    done = module.row("gpt2", "pipeline", 9, ours, [module.Run(10.0, None, 1.5)], 100.0)
    assert "| 10.00 | 0.50 | 2.00 | 20.0x | 5.0x | 1.5000 | 1.2500 |" in done
