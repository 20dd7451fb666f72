"""costs.json provenance and its checks in ``partition --costs`` (cost.costs_file).

Real profiles of tiny models (a fraction of a second each, cache in the test's folder).
"""

from __future__ import annotations

import json
import os
import sys

import onnxruntime as ort
import pytest
from support.graphs import CHAIN, SKIP, save

from onnx_partition.cli import main
from onnx_partition.cost.costs_file import batch_size_of, fingerprint
from onnx_partition.cost.profile import CACHE_ENV
from onnx_partition.graph import load


@pytest.fixture
def chain(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    return save(CHAIN, tmp_path / "m.onnx")


def profiled(path, out, batch=2):
    assert main(["profile", str(path), "--batch-size", str(batch), "--repeats", "3",
                 "-o", str(out)]) == 0
    return json.loads(out.read_text())


def plan_of(folder):
    return json.loads((folder / "plan.json").read_text())


def test_profile_records_where_and_what_it_measured(chain, tmp_path, capsys):
    body = profiled(chain, tmp_path / "c.json", batch=3)
    assert body["fingerprint"] == fingerprint(load(chain, batch_size=3))
    assert body["input_shapes"] == {"x": [3, 4]} and body["batch_size"] == 3
    assert body["device"] == "cpu" and body["device_kind"] == "cpu" and body["device_name"]
    assert body["onnxruntime"] == ort.__version__


def test_fingerprint_ignores_the_batch_but_not_the_edges(tmp_path):
    path = save(CHAIN, tmp_path / "m.onnx")
    assert fingerprint(load(path, batch_size=2)) == fingerprint(load(path, batch_size=8))
    assert batch_size_of(load(path, batch_size=8)) == 8
    rewired = save(CHAIN.replace("y = Add(f, a)", "y = Add(f, x)"), tmp_path / "r.onnx")
    assert fingerprint(load(rewired, batch_size=2)) != fingerprint(load(path, batch_size=2))


def test_costs_of_another_model_are_refused(chain, tmp_path, capsys):
    other = save(SKIP, tmp_path / "skip.onnx")
    profiled(other, tmp_path / "other.json")
    capsys.readouterr()
    code = main(["partition", str(chain), "-s", "2", "--batch-size", "2", "--costs",
                 str(tmp_path / "other.json"), "-o", str(tmp_path / "p")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1
    assert err[0].startswith("error: ") and "another graph" in err[0]
    assert not (tmp_path / "p").exists()


def test_costs_at_another_batch_are_warned_and_rescaled_linearly(chain, tmp_path, capsys):
    costs = tmp_path / "c.json"
    profiled(chain, costs, batch=2)
    capsys.readouterr()
    assert main(["partition", str(chain), "-s", "2", "--costs", str(costs),
                 "-o", str(tmp_path / "p2")]) == 0  # batch and shapes from costs.json
    at2 = plan_of(tmp_path / "p2")
    assert at2["batch_size"] == 2 and at2["input_shapes"] == {"x": [2, 4]}
    assert "measured at batch" not in capsys.readouterr().err
    assert main(["partition", str(chain), "-s", "2", "--batch-size", "8", "--costs", str(costs),
                 "-o", str(tmp_path / "p8")]) == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert [line for line in err if "batch size 2" in line and "scaled by 4" in line]
    at8 = plan_of(tmp_path / "p8")
    assert at8["costs"]["check"]["scale"] == 4.0 and at8["batch_size"] == 8
    total2, total8 = at2["predicted"]["total_compute_ms"], at8["predicted"]["total_compute_ms"]
    assert total8 == pytest.approx(4 * total2, rel=1e-4)


def test_partial_and_old_costs_files(chain, tmp_path, capsys):
    body = profiled(chain, tmp_path / "c.json")
    keys = sorted(body["nodes"])
    partial = {**body, "nodes": {k: body["nodes"][k] for k in keys[:2]}}
    (tmp_path / "partial.json").write_text(json.dumps(partial))
    capsys.readouterr()
    assert main(["partition", str(chain), "-s", "2", "--costs", str(tmp_path / "partial.json"),
                 "-o", str(tmp_path / "p")]) == 0
    err = capsys.readouterr().err
    assert f"covers 2 of {len(keys)} compute nodes" in err and len(err.splitlines()) == 2
    # the contract's minimum: only nodes.<key>.forward_ms; works, with one line saying so
    old = {"nodes": {k: {"forward_ms": v["forward_ms"]} for k, v in body["nodes"].items()}}
    (tmp_path / "old.json").write_text(json.dumps(old))
    assert main(["partition", str(chain), "-s", "2", "--batch-size", "2", "--costs",
                 str(tmp_path / "old.json"), "-o", str(tmp_path / "q")]) == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "cannot be checked" in err[0]
    assert plan_of(tmp_path / "q")["costs"]["measured_nodes"] == len(keys)


_OPENS: list[str] = []  # paths opened while a test listens (the audit hook stays for the process)
_LISTENING: list[bool] = [False]


def _on_open(event: str, args: tuple) -> None:
    if event == "open" and _LISTENING[0] and isinstance(args[0], str | bytes | os.PathLike):
        _OPENS.append(os.path.realpath(os.fsdecode(args[0])))


sys.addaudithook(_on_open)


@pytest.mark.parametrize("extra", [[], ["--batch-size", "4"], ["--devices", "2"]],
                             ids=["recorded-shapes", "batch-size", "cluster"])
def test_partition_reads_the_costs_file_once(chain, tmp_path, capsys, extra):
    """Every open of costs.json in the process (Python's ``open`` audit event, whatever opens
    it) during one ``partition --costs`` call: one."""
    costs = tmp_path / "c.json"
    profiled(chain, costs, batch=2)
    _OPENS.clear()
    _LISTENING[0] = True
    try:
        code = main(["partition", str(chain), "-s", "2", "--costs", str(costs), *extra,
                     "-o", str(tmp_path / "p")])
    finally:
        _LISTENING[0] = False
    assert code == 0, capsys.readouterr().err
    assert _OPENS.count(os.path.realpath(costs)) == 1
