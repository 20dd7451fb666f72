"""One request for the command line and the Python API (issue 32, item 1): every ``partition``
option and its API spelling give the same plan.json (compared as ``tools/compare_plans.py``
compares, timing fields aside), and a cluster given in Python resolves its named GPU's memory
and link as ``--cluster FILE`` and ``--gpu`` do."""

from __future__ import annotations

import dataclasses
import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from support.defaults import literal_defaults

from onnx_partition.cli import main
from onnx_partition.cost.cluster import Cluster, Link, load_cluster
from onnx_partition.cost.devices import pinned_cpu
from onnx_partition.errors import PartitionError
from onnx_partition.graph import load
from onnx_partition.partition import partition
from onnx_partition.settings.partition import SearchSpec, TrainSpec

#: What compare_plans leaves out: timings, versions, the folder's own listing.
TIMINGS = {"partition_s", "planning_s", "seconds", "wall_s", "version", "manifest", "plan_dir"}
V100 = {"kind": "cuda", "gpu": "v100", "machines": 1, "devices_per_machine": 2}
FLEET = {"format": "onnx-partition/cluster@2", "inter": {"bandwidth_gbps": 25, "latency_ms": 0.02},
         "groups": [{"gpu": "a100-80gb", "devices_per_machine": 2},
                    {"gpu": "v100", "devices_per_machine": 2, "memory_gb": 32}]}


def _strip(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _strip(v) for k, v in value.items() if k not in TIMINGS}
    if isinstance(value, list):
        return [_strip(v) for v in value]
    return value


def _plan(out: Path) -> dict[str, Any]:
    return _strip(json.loads((out / "plan.json").read_text()))


@pytest.fixture(scope="module")
def files(exported: Callable[[str, str], Path], tmp_path_factory: pytest.TempPathFactory
          ) -> dict[str, Path]:
    """The tiny GPT recipe (with its program, and a copy without), costs files measured on a
    CPU and on a V100, a V100 cluster.json and a fleet's."""
    root = tmp_path_factory.mktemp("request")
    model = exported("gpt", "tiny")
    bare = root / "bare" / "gpt.onnx"
    bare.parent.mkdir()
    shutil.copy(model, bare)  # no program beside it
    keys = [n.key for n in load(model, batch_size=2).nodes]
    paths = {"model": model, "bare": bare}
    for name, device in (("cpu", "cpu"), ("v100", "cuda:0")):
        paths[name] = root / f"costs-{name}.json"
        paths[name].write_text(json.dumps({
            "format": "onnx-partition/costs@1", "unit": "ms", "device": device,
            "nodes": {k: {"forward_ms": 0.01 * (1 + i % 7)} for i, k in enumerate(keys)}}))
    for name, body in (("cluster", V100), ("fleet", FLEET)):
        paths[name] = root / f"{name}.json"
        paths[name].write_text(json.dumps(body))
    return paths


#: (name, command-line options, the API's keywords of the same plan, the model); every plan
#: at batch size 2. Each of partition's options appears in at least one case.
CASES: list[tuple[str, list[str], Callable[[dict[str, Path]], dict[str, Any]], str]] = [
    ("stages", ["-s", "3"], lambda f: {"num_stages": 3}, "model"),
    ("order", ["-s", "2", "--order", "dfs"], lambda f: {"num_stages": 2, "ordering": "dfs"},
     "model"),
    ("solver-baseline", ["-s", "3", "--solver", "parameters"],
     lambda f: {"num_stages": 3, "solver": "parameters"}, "model"),
    ("solver-ilp", ["-s", "2", "--solver", "ilp", "--time-limit", "20"],
     lambda f: {"num_stages": 2, "solver": "ilp", "time_limit_s": 20.0}, "model"),
    ("exact-budget", ["-s", "3", "--exact-budget", "0"],
     lambda f: {"num_stages": 3, "exact_budget_s": 0.0}, "model"),
    ("input-shape", ["-s", "2", "--input-shape", "input_ids=2,8"],
     lambda f: {"num_stages": 2, "input_shapes": {"input_ids": [2, 8]}},
     "model"),
    ("microbatches", ["-s", "2", "--microbatches", "4"],
     lambda f: {"num_stages": 2, "microbatches": 4}, "model"),
    ("link", ["-s", "2", "--bandwidth", "5", "--latency", "0.1"],
     lambda f: {"num_stages": 2, "link": Link(5.0, 0.1)}, "model"),
    ("bandwidth", ["-s", "2", "--bandwidth", "5"],
     lambda f: {"num_stages": 2, "link": Link(5.0)}, "model"),
    ("device-kind", ["-s", "2", "--device-kind", "cuda"],
     lambda f: {"num_stages": 2, "device_kind": "cuda"}, "model"),
    ("gpu", ["-s", "2", "--gpu", "a100-40gb:fp32"],
     lambda f: {"num_stages": 2, "gpu": "a100-40gb:fp32"}, "model"),
    ("cpu-pinned", ["-s", "2", "--cpu-tflops", "0.5", "--cpu-gbps", "20"],
     lambda f: {"num_stages": 2, "device": pinned_cpu(0.5, 20.0)}, "model"),
    ("costs", ["-s", "2", "--costs", "{cpu}"], lambda f: {"num_stages": 2, "costs": f["cpu"]},
     "model"),
    ("strict-costs-fits", ["-s", "2", "--costs", "{cpu}", "--strict-costs"],
     lambda f: {"num_stages": 2, "costs": f["cpu"], "strict_costs": True}, "model"),
    ("devices", ["--devices", "2"], lambda f: {"num_stages": None,
                                                "cluster": Cluster(devices_per_machine=2)},
     "model"),
    ("machines-links-memory", ["--devices", "2", "--machines", "2", "--device-memory", "1GB",
                               "--inter-bandwidth", "5", "--inter-latency", "0.1", "-s", "2"],
     lambda f: {"num_stages": 2, "cluster": Cluster(machines=2, devices_per_machine=2,
                                                    memory_gb=1.0, inter=Link(5.0, 0.1))},
     "model"),
    ("devices-gpu", ["--devices", "2", "--gpu", "v100"],
     lambda f: {"num_stages": None, "cluster": Cluster(devices_per_machine=2, kind="cuda",
                                                       gpu="v100")}, "model"),
    ("cluster-file", ["--cluster", "{cluster}"], lambda f: {"num_stages": None,
                                                            "cluster": f["cluster"]}, "model"),
    ("cluster-file-gpu", ["--cluster", "{cluster}", "--gpu", "h100"],
     lambda f: {"num_stages": None, "cluster": f["cluster"], "gpu": "h100"}, "model"),
    ("fleet-kind-costs", ["--cluster", "{fleet}", "--costs", "v100={v100}"],
     lambda f: {"num_stages": None, "cluster": f["fleet"], "kind_costs": {"v100": f["v100"]}},
     "model"),
    ("train", ["-s", "2", "--mode", "train"], lambda f: {"num_stages": 2, "mode": "train"},
     "model"),
    ("train-schedule-recompute", ["-s", "2", "--mode", "train", "--schedule", "zb-h1",
                                  "--recompute", "all"],
     lambda f: {"num_stages": 2, "mode": "train", "schedule": "zb-h1", "recompute": "all"},
     "model"),
    ("train-precision", ["-s", "2", "--mode", "train", "--precision", "bf16", "--gpu", "h100"],
     lambda f: {"num_stages": 2, "mode": "train", "precision": "bf16", "gpu": "h100"},
     "model"),
    ("train-no-program", ["-s", "2", "--mode", "train", "--no-program"],
     lambda f: {"num_stages": 2, "mode": "train"}, "bare"),
    ("train-cluster-costs", ["--devices", "2", "--mode", "train", "--costs", "{cpu}",
                             "--microbatches", "4"],
     lambda f: {"num_stages": None, "mode": "train", "costs": f["cpu"], "microbatches": 4,
                "cluster": Cluster(devices_per_machine=2)}, "model"),
]


@pytest.mark.parametrize(("name", "cli", "api", "which"), CASES, ids=[c[0] for c in CASES])
def test_the_command_line_and_the_api_plan_alike(
        files: dict[str, Path], tmp_path: Path, name: str, cli: list[str],
        api: Callable[[dict[str, Path]], dict[str, Any]], which: str) -> None:
    model = files[which]
    args = [a.format(**{k: str(v) for k, v in files.items()}) for a in cli]
    assert main(["-q", "partition", str(model), "--batch-size", "2", "-o",
                 str(tmp_path / "cli"), *args]) == 0
    keywords = {"batch_size": 2, **api(files)}
    stages = keywords.pop("num_stages")
    partition(model, stages, tmp_path / "api", **keywords)
    ours, theirs = _plan(tmp_path / "api"), _plan(tmp_path / "cli")
    if name == "solver-ilp" and ours != theirs:  # CP-SAT's workers may find another optimum
        assert ours["ilp"]["optimal"] and theirs["ilp"]["optimal"]
        assert ours["ilp"]["bottleneck_ms"] == pytest.approx(theirs["ilp"]["bottleneck_ms"])
        return
    assert ours == theirs


def test_force_and_strict_costs_refuse_alike(files: dict[str, Path], tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    """A folder that is no plan is replaced with ``--force``/``force=True`` only; a costs file
    measured on a CPU is refused for a GPU cluster with ``--strict-costs``/``strict_costs``."""
    model = files["model"]
    for out in ("cli", "api"):
        (tmp_path / out).mkdir()
        (tmp_path / out / "mine.txt").write_text("not a plan")
    base = ["-q", "partition", str(model), "--batch-size", "2", "-s", "2"]
    assert main([*base, "-o", str(tmp_path / "cli")]) == 2
    refused = capsys.readouterr().err.strip().removeprefix("error: ")
    with pytest.raises(PartitionError) as api:
        partition(model, 2, tmp_path / "api", batch_size=2)
    assert str(api.value).replace(str(tmp_path / "api"), "OUT") == refused.replace(
        str(tmp_path / "cli"), "OUT")
    assert main([*base, "-o", str(tmp_path / "cli"), "--force"]) == 0
    partition(model, 2, tmp_path / "api", batch_size=2, force=True)
    assert _plan(tmp_path / "api") == _plan(tmp_path / "cli")
    strict = ["--devices", "2", "--device-kind", "cuda", "--costs", str(files["cpu"]),
              "--strict-costs"]
    assert main([*base[:-2], *strict, "-o", str(tmp_path / "s")]) == 2
    said = capsys.readouterr().err.strip().removeprefix("error: ")
    with pytest.raises(PartitionError, match="--strict-costs") as api:
        partition(model, None, tmp_path / "s2", batch_size=2, costs=files["cpu"],
                  strict_costs=True, cluster=Cluster(devices_per_machine=2, kind="cuda"))
    assert str(api.value) == said


def test_a_cluster_given_in_python_resolves_its_gpu_as_the_command_line(
        files: dict[str, Path], tmp_path: Path) -> None:
    """``partition(cluster=load_cluster(path))`` plans on the named GPU's datasheet memory
    (less the CUDA context) and NVLink, as ``--cluster path`` does: the same plan but for
    the words saying where the figures came from."""
    model = files["model"]
    assert main(["-q", "partition", str(model), "--batch-size", "2", "-o",
                 str(tmp_path / "cli"), "--cluster", str(files["cluster"])]) == 0
    partition(model, None, tmp_path / "api", batch_size=2,
              cluster=load_cluster(files["cluster"]))
    ours, theirs = _plan(tmp_path / "api"), _plan(tmp_path / "cli")
    assert theirs["cluster"]["memory_gb"] == 31.5
    assert theirs["cluster"]["intra"] == {"bandwidth_gbps": 150.0, "latency_ms": 0.005}
    assert ours["cluster"] == theirs["cluster"]
    assert ours["device_model"].pop("sources")["memory"].startswith("31.5 GB per device")
    theirs["device_model"].pop("sources")
    assert ours == theirs


# ---------------------------------------------------------------- no default written twice

#: The settings a plan is planned with, each written once in onnx_partition.settings.partition.
PLANNING = {f.name for spec in (TrainSpec, SearchSpec) for f in dataclasses.fields(spec)}
PACKAGE = Path(__file__).resolve().parents[1] / "onnx_partition"
#: Names shared with a setting that mean something else where they stand.
ALLOWED_LITERALS = {
    ("solve/dp.py", "split_sequence", "precision"): "the bisection's numeric tolerance",
    ("solve/hybrid_model.py", "HybridConfig", "precision"): "the bisection's tolerance (unused)",
    ("solve/hybrid_model.py", "HybridStage", "recompute"): "one stage's flag, a bool",
    ("solve/hybrid_model.py", "HybridConfig", "recompute"):
        "the mode the DP is run in, resolved from the request (none: keep every activation)",
    ("solve/scoring.py", "RunSpec", "recompute"): "likewise, the resolved mode",
    ("solve/fleet_dp.py", "fleet_dp", "recompute"): "likewise, the resolved mode",
    ("solve/fleet_dp.py", "stage_period", "recompute"): "likewise, the resolved mode",
    ("solve/fleet_scoring.py", "FleetPlan", "schedule"): "the schedule a candidate was scored "
                                                         "under, a record, not an option",
    ("solve/hybrid_judge.py", "judge_hybrid", "time_limit_s"): "the judge's own CP-SAT limit",
    ("solve/hybrid_proof.py", "HybridProof", "ordering"): "a proof record's field (none: '')",
}


def test_no_planning_default_is_written_outside_the_settings() -> None:
    """The partitioner's driver, its request, the solvers and partition's options take every
    default of a planning setting (micro-batches, schedule, recompute, precision, optimizer,
    mode, ordering, solver, limits) from :mod:`onnx_partition.settings.partition`."""
    files = [*(PACKAGE / "solve").rglob("*.py"), *(PACKAGE / "request").rglob("*.py"),
             *(PACKAGE / n for n in ("partition.py", "assemble.py", "pricing.py",
                                     "graph_arrays.py")), PACKAGE / "cli" / "args.py"]
    found = sorted((path.relative_to(PACKAGE).as_posix(), owner, name) for path in files
                   for owner, name in literal_defaults(path.read_text(), PLANNING,
                                                       declaring_prefix="_partition"))
    assert not set(found) - set(ALLOWED_LITERALS), "\n".join(
        map(str, sorted(set(found) - set(ALLOWED_LITERALS))))
    assert set(ALLOWED_LITERALS) <= set(found), "stale allowances"


def test_the_planning_check_sees_a_literal() -> None:
    source = ("def plan(problem, *, microbatches: int = 8, schedule=TrainSpec.schedule): pass\n"
              "def _partition_args(p):\n    p.add_argument('--solver', default='dp')\n")
    assert literal_defaults(source, PLANNING, declaring_prefix="_partition") == [
        ("plan", "microbatches"), ("--solver", "solver")]
