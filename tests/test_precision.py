"""Mixed precision priced as autocast runs it (``partition --precision``): the bytes a block saves
under bf16 autocast by hand, equal under FakeTensorMode and on real tensors; a bf16 train plan
of gpt tiny below its fp32 plan, recorded in plan.json, and trained in bf16 by default (the
run's measured saved bytes equal the plan's); the refusals in one line, exit 2."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from support.blocks import HIDDEN, ROWS, WIDTH, Block

from onnx_partition import export
from onnx_partition.cli import main
from onnx_partition.cli.summary.partition import plan_table
from onnx_partition.cost.analytic import DeviceSpec
from onnx_partition.cost.devices import for_precision, gpu
from onnx_partition.cost.saved import saved_by_module, saved_bytes
from onnx_partition.partition import partition
from onnx_partition.plan import read_plan

# by hand under CPU bf16 autocast: linear saves the bf16 cast of its input x (x needs no
# gradient, so the weight's cast is not saved), GELU its bf16 input (linear's output), layer
# norm (left in the input's dtype by CPU autocast) its bf16 input and, its weight being fp32,
# mean and rstd in fp32 (one per row)
HAND_BF16 = {"linear": ROWS * WIDTH * 2, "gelu": ROWS * HIDDEN * 2,
             "layer_norm": ROWS * HIDDEN * 2 + 2 * ROWS * 4}


@pytest.fixture(scope="module")
def block(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(0)
    return export(Block(), (torch.randn(ROWS, WIDTH),),
                  tmp_path_factory.mktemp("block") / "block.onnx")


@pytest.mark.parametrize("fake", [True, False])
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_saved_bytes_under_autocast_equal_a_hand_count(block: Path, fake: bool,
                                                       precision: str) -> None:
    program = torch.export.load(str(block.with_suffix(".pt2")))
    counted = saved_bytes(program, [(ROWS, WIDTH)], fake=fake, precision=precision)
    assert counted.per_node == HAND_BF16  # fp16 keeps the same sizes
    assert saved_by_module(Block(), torch.randn(ROWS, WIDTH), precision=precision) == sum(
        HAND_BF16.values())
    assert saved_bytes(program, [(ROWS, WIDTH)], fake=fake).total == (
        ROWS * WIDTH + 2 * ROWS * HIDDEN) * 4 + 2 * ROWS * 4  # fp32: the same tensors, 4 B


def test_a_weight_cast_is_saved_once_per_run() -> None:
    """A linear whose input needs a gradient saves its weight's bf16 cast: a copy of the
    weight per micro-batch in flight (autocast's cache lives for one region)."""
    torch.manual_seed(0)
    two = torch.nn.Sequential(torch.nn.Linear(WIDTH, HIDDEN, bias=False),
                              torch.nn.Linear(HIDDEN, HIDDEN, bias=False))
    x = torch.randn(ROWS, WIDTH)
    # first: x's cast; second: its bf16 input (the first's output) and its weight's cast
    assert saved_by_module(two, x, precision="bf16") == (ROWS * WIDTH + ROWS * HIDDEN
                                                         + HIDDEN * HIDDEN) * 2


def test_a_gpu_prices_half_precision_at_its_half_peak() -> None:
    h100 = gpu("h100")
    assert for_precision(h100, "fp32") == h100
    half = for_precision(h100, "bf16")
    assert (half.name, half.peak_gflops) == ("h100:bf16", 989.4e3)
    cpu = DeviceSpec("cpu", peak_gflops=100.0, mem_gbps=10.0, launch_overhead_ms=0.0)
    assert for_precision(cpu, "bf16") == cpu


@pytest.fixture(scope="module")
def gpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("precision")
    assert main(["export", "gpt", "--size", "tiny", "-o", str(root / "gpt.onnx")]) == 0
    return root / "gpt.onnx"


def _plan(model: Path, out: Path, precision: str) -> None:
    assert main(["partition", str(model), "--stages", "2", "--mode", "train", "--batch-size",
                 "8", "--cpu-tflops", "0.1", "--exact-budget", "0", "--precision", precision,
                 "-o", str(out)]) == 0


@pytest.fixture(scope="module")
def plans(gpt: Path) -> Path:
    """gpt tiny's 2-stage train plans in fp32 and bf16, in ``plans/fp32``, ``plans/bf16``."""
    for precision in ("fp32", "bf16"):
        _plan(gpt, gpt.parent / "plans" / precision, precision)
    return gpt.parent / "plans"


def test_bf16_plan_below_fp32_and_trained_in_bf16(plans: Path,
                                                  capfd: pytest.CaptureFixture[str]) -> None:
    fp32, bf16 = (json.loads((plans / p / "plan.json").read_text()) for p in ("fp32", "bf16"))
    assert (fp32["precision"], bf16["precision"]) == ("fp32", "bf16")
    assert bf16["activations"]["total_bytes"] < fp32["activations"]["total_bytes"]
    for a, b in zip(fp32["stages"], bf16["stages"], strict=True):
        assert b["predicted"]["weights_bytes"] == a["predicted"]["weights_bytes"]  # fp32 kept
    # train defaults to the plan's bf16: stage 0 (integer inputs) saves, counted in the run,
    # exactly the plan's bf16 count (an fp32 run saves the fp32 bytes); stage 1 at most it,
    # less by the casts autocast caches for its received leaves (docs/design.md)
    assert main(["train", str(plans / "bf16"), "--nproc", "2", "--steps", "1",
                 "--microbatches", "2", "--batch-size", "8", "--json"]) == 0
    report = json.loads(capfd.readouterr().out)
    measured = [s["activation_bytes"] for s in report["measured"]["stages"]]
    planned = [s["predicted"]["activation_bytes"] for s in bf16["stages"]]
    assert measured[0] == planned[0] != fp32["stages"][0]["predicted"]["activation_bytes"]
    assert all(m <= p for m, p in zip(measured, planned, strict=True))
    assert sum(measured) >= 0.95 * sum(planned)


@pytest.mark.parametrize("argv, says", [
    (["--mode", "train", "--precision", "fp8"], "--precision 'fp8' is not one of"),
    (["--precision", "bf16"], "needs --mode train"),
])
def test_bad_precision_is_one_line(gpt: Path, tmp_path: Path, argv: list[str], says: str,
                                   capfd: pytest.CaptureFixture[str]) -> None:
    assert main(["partition", str(gpt), "--stages", "2", "-o", str(tmp_path / "p"),
                 *argv]) == 2
    err = capfd.readouterr().err
    assert says in err and len(err.strip().splitlines()) == 1


def test_train_refuses_fp16_with_its_reason(plans: Path, tmp_path: Path,
                                            capfd: pytest.CaptureFixture[str]) -> None:
    """A plan priced for fp16 (plan.json ``precision``, which train defaults to)."""
    shutil.copytree(plans.parent, tmp_path / "copy", ignore=shutil.ignore_patterns("fp32"))
    plan_json = tmp_path / "copy" / "plans" / "bf16" / "plan.json"
    plan_json.write_text(plan_json.read_text().replace('"precision": "bf16"',
                                                       '"precision": "fp16"'))
    capfd.readouterr()
    assert main(["train", str(plan_json.parent), "--steps", "1"]) == 2
    err = capfd.readouterr().err
    assert "loss scaling" in err and len(err.strip().splitlines()) == 1


def test_the_summary_names_the_precision(plans: Path) -> None:
    assert "train in bf16," in plan_table(read_plan(plans / "bf16"))
    assert "train, " in plan_table(read_plan(plans / "fp32"))


def test_a_gpu_plan_counts_cudas_policy(block: Path, tmp_path: Path) -> None:
    """A GPU plan's activations by CUDA autocast's policy (layer norm in fp32: its input and
    statistics 4 bytes), its matrix products at the GPU's half peak; the trainer's mean
    squared error after it saves the fp32 output and its target (4 bytes each)."""
    plan = partition(block, 1, tmp_path / "gpu", mode="train", precision="bf16",
                     device=gpu("h100"), batch_size=ROWS, check=False)
    assert plan.extra["activations"]["autocast"] == "cuda"
    assert plan.extra["activations"]["total_bytes"] == (
        ROWS * WIDTH * 2 + ROWS * HIDDEN * 2 + ROWS * HIDDEN * 4 + 2 * ROWS * 4
        + 2 * ROWS * HIDDEN * 4)
    assert plan.device_model is not None and plan.device_model["name"] == "h100:bf16"
    cpu = partition(block, 1, tmp_path / "cpu", mode="train", precision="bf16",
                    device=DeviceSpec("cpu", 100.0, 10.0, 0.0), batch_size=ROWS, check=False)
    assert cpu.extra["activations"]["autocast"] == "cpu"
    assert cpu.extra["activations"]["total_bytes"] == (sum(HAND_BF16.values())
                                                       + 2 * ROWS * HIDDEN * 4)


def test_a_costs_file_records_its_precision(gpt: Path, tmp_path: Path) -> None:
    """``profile --mode train --precision bf16`` measures under autocast and says so; a plan
    priced for another precision by it is warned about, one for the same is not."""
    costs = tmp_path / "bf16.json"
    assert main(["profile", str(gpt), "--mode", "train", "--precision", "bf16", "--batch-size",
                 "2", "--repeats", "1", "-o", str(costs)]) == 0
    body = json.loads(costs.read_text())
    assert body["precision"] == "bf16"
    # on CPU the command line runs the engine probe into the costs file's engine
    probe = body["engine"]["probe"]
    assert probe["action_ms"] > 0 and probe["hop_ms"] >= 0 and probe["barrier_ms"] >= 0
    for precision, warned in (("fp32", True), ("bf16", False)):
        plan = partition(gpt, 2, tmp_path / precision, costs=costs, mode="train",
                         precision=precision, exact_budget_s=0, check=False)
        notes = " ".join(plan.extra["costs"]["check"]["notes"])
        assert ("was measured in bf16; this plan is priced for fp32" in notes) is warned, notes
    assert main(["profile", str(gpt), "--precision", "bf16", "-o", str(tmp_path / "x.json")]) == 2
