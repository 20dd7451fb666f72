"""An autocast policy applied op by op (cost/autocast.py): torch's CPU autocast reproduced exactly
by the CPU policy applied by hand (so the mechanism is autocast's), CUDA's policy by hand on a
small block, and our op lists containing torch's own test lists of what each device casts."""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import pytest
import torch
from support.blocks import HIDDEN, ROWS, WIDTH, Block, Logits, tiny_gpt2

from onnx_partition import export
from onnx_partition.cost.autocast import CPU_POLICY, CUDA_POLICY, AutocastPolicy
from onnx_partition.cost.saved import saved_bytes


def _torch_lists() -> dict[str, dict[str, set[str]]]:
    """Op names per list of torch/testing/_internal/autocast_test_lists.py, per class (read as
    text: importing it needs torch's test dependencies)."""
    spec = importlib.util.find_spec("torch")
    assert spec is not None and spec.submodule_search_locations
    path = Path(spec.submodule_search_locations[0]) / "testing/_internal/autocast_test_lists.py"
    lists: dict[str, dict[str, set[str]]] = {}
    for cls in ast.parse(path.read_text()).body:
        if not isinstance(cls, ast.ClassDef):
            continue
        for node in ast.walk(cls):
            if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Attribute) \
                    and isinstance(node.value, ast.List):
                names = {e.elts[0].value for e in node.value.elts
                         if isinstance(e, ast.Tuple) and isinstance(e.elts[0], ast.Constant)}
                lists.setdefault(cls.name, {})[node.targets[0].attr] = {
                    str(n) for n in names}
    return lists


@pytest.mark.parametrize("cls, policy, lower, fp32", [
    ("AutocastTestLists", CUDA_POLICY, ("torch_fp16", "nn_fp16", "linalg_fp16"),
     ("torch_fp32", "nn_fp32")),
    ("AutocastCPUTestLists", CPU_POLICY, ("torch_16", "nn_16"), ("torch_fp32", "nn_fp32")),
])
def test_our_lists_contain_torchs(cls: str, policy: AutocastPolicy, lower: tuple[str, ...],
                                  fp32: tuple[str, ...]) -> None:
    lists = _torch_lists()[cls]
    assert set().union(*(lists[k] for k in lower)) <= policy.lower
    assert set().union(*(lists[k] for k in fp32)) <= policy.fp32
    assert lists["torch_need_autocast_promote"] <= policy.promote
    assert not policy.lower & policy.fp32


@pytest.fixture(scope="module")
def programs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    torch.manual_seed(0)
    root = tmp_path_factory.mktemp("autocast")
    out: dict[str, object] = {}
    for name, dropout in (("block", False), ("dropout", True)):
        model = export(Block(dropout).train(), (torch.randn(ROWS, WIDTH),),
                       root / f"{name}.onnx")
        out[name] = torch.export.load(str(model.with_suffix(".pt2")))
    out["gpt2"] = torch.export.export(Logits(tiny_gpt2()), (torch.zeros(2, 8, dtype=torch.long),),
                                      strict=False)
    return out


@pytest.mark.parametrize("name, shape", [("block", (ROWS, WIDTH)), ("dropout", (ROWS, WIDTH)),
                                         ("gpt2", (2, 8))])
@pytest.mark.parametrize("fake", [True, False])
def test_cpu_policy_by_hand_is_torchs_cpu_autocast(programs: dict[str, object], name: str,
                                                   shape: tuple[int, int], fake: bool) -> None:
    program = programs[name]
    by_torch = saved_bytes(program, [shape], fake=fake, precision="bf16")  # type: ignore[arg-type]
    by_hand = saved_bytes(program, [shape], fake=fake, precision="bf16",  # type: ignore[arg-type]
                          policy=CPU_POLICY)
    assert by_hand.per_node == by_torch.per_node
    assert by_hand.per_node != saved_bytes(program, [shape], fake=fake).per_node  # type: ignore[arg-type]


def test_cuda_policy_by_hand(programs: dict[str, object]) -> None:
    """CUDA autocast: linear saves x's half cast, GELU its half input, layer norm (fp32 list)
    its input cast back to fp32 and fp32 statistics; dropout (fused) a bool mask."""
    block = saved_bytes(programs["block"], [(ROWS, WIDTH)], precision="fp16",  # type: ignore[arg-type]
                        policy="cuda")
    assert block.per_node == {"linear": ROWS * WIDTH * 2, "gelu": ROWS * HIDDEN * 2,
                              "layer_norm": ROWS * HIDDEN * 4 + 2 * ROWS * 4}
    dropped = saved_bytes(programs["dropout"], [(ROWS, WIDTH)], precision="fp16",  # type: ignore[arg-type]
                          policy="cuda")
    assert dropped.total == block.total + ROWS * HIDDEN  # the mask: 1 byte an element
