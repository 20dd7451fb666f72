"""The analytic backward of a train plan per aten op, from the program it trains.

Where no device is at hand to profile (``profile --mode train``), a train plan on a GPU is priced
by the roofline model. One backward factor for every ONNX node (2 for dense ops, 1 for others)
misses what torch's autograd really runs: a linear's backward is two matrix products (and a bias
sum), an element-wise op's reads what it saved and the incoming gradient, softmax and layer
norm have their own kernels, and an embedding's is a scatter-add into a zeroed table the size
of the vocabulary. So the exported program (``model.pt2`` beside the ONNX file) is run once
under ``FakeTensorMode`` at the graph's input shapes (the micro-batch; no memory, any size),
weights needing gradients as in training, and each ``call_function`` node becomes an
:class:`~onnx_partition.cost.analytic.AtenOp` (its arguments' shapes, item sizes and whether
they need a gradient) priced by :func:`~onnx_partition.cost.analytic.aten_backward_ms`.

Each FX node's backward lands on the ONNX node that carries its unit's costs
(:func:`onnx_partition.cost.saved.unit_homes`: a unit's first ONNX node, as a train costs file
keys a unit's times and as the saved bytes are placed).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from onnx_partition.cost.analytic import AtenOp, DeviceSpec, aten_backward_ms
from onnx_partition.cost.annotate import NodeCosts
from onnx_partition.cost.saved import program_inputs, traced_on_meta, unit_homes
from onnx_partition.errors import PartitionError
from onnx_partition.graph import OpGraph

if TYPE_CHECKING:
    from torch.export import ExportedProgram

__all__ = ["ANALYTIC_BACKWARD", "aten_ops", "backward_per_node", "with_aten_backward"]

#: plan.json ``costs.backward`` of a train plan whose backward was priced per aten op.
ANALYTIC_BACKWARD = "analytic per aten op"


def _describe(value: Any) -> tuple[tuple[int, ...] | None, int, bool]:
    import torch

    if isinstance(value, torch.Tensor):
        return tuple(int(d) for d in value.shape), value.element_size(), value.requires_grad
    return None, 0, False


def _name(target: Any) -> str:
    packet = getattr(target, "_overloadpacket", None)
    return str(getattr(packet, "__name__", None) or getattr(target, "__name__", str(target)))


def aten_ops(program: ExportedProgram, shapes: Sequence[Sequence[int]]) -> dict[str, AtenOp]:
    """Every ``call_function`` node of ``program`` (``getitem`` aside) as an
    :class:`AtenOp`, run under ``FakeTensorMode`` with its user inputs at ``shapes`` and its
    floating-point parameters needing gradients."""
    import operator

    import torch
    import torch.fx
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.export.graph_signature import InputKind

    mode = FakeTensorMode(allow_non_fake_inputs=False)
    specs = iter(program_inputs(program, shapes))
    args: list[Any] = []
    for spec in program.graph_signature.input_specs:
        if spec.kind == InputKind.USER_INPUT:
            shape, dtype = next(specs)
            on = "meta" if traced_on_meta(program, spec.arg.name) else "cpu"
            with mode:  # a fake tensor: shape and dtype, no data
                args.append(torch.empty(shape, dtype=dtype, device=on))
            continue
        target = str(spec.target)
        persistent = spec.kind == InputKind.PARAMETER or (
            spec.kind == InputKind.BUFFER and spec.persistent is not False)
        value = program.state_dict[target] if persistent else program.constants[target]
        copy = mode.from_tensor(value).detach()
        if spec.kind == InputKind.PARAMETER and value.is_floating_point():
            copy.requires_grad_(True)
        args.append(copy)
    found: dict[str, AtenOp] = {}

    class Recording(torch.fx.Interpreter):
        def run_node(self, n: torch.fx.Node) -> Any:
            result = super().run_node(n)
            if n.op == "call_function" and n.target is not operator.getitem:
                values = torch.fx.node.map_arg(n.args, lambda a: self.env[a])
                ins = [_describe(v) for v in values]
                outs = [_describe(v) for v in
                        (result if isinstance(result, list | tuple) else [result])]
                found[n.name] = AtenOp(_name(n.target), [s for s, _, _ in ins],
                                       [z for _, z, _ in ins], [g for _, _, g in ins],
                                       [s for s, _, _ in outs], [z for _, z, _ in outs])
            return result

    with mode, torch.enable_grad():
        Recording(program.graph_module).run(*args)
    return found


def backward_per_node(graph: OpGraph, program: str | Path | ExportedProgram,
                      device: DeviceSpec) -> list[float]:
    """Backward ms per OpGraph node index: each FX node's
    :func:`~onnx_partition.cost.analytic.aten_backward_ms` on ``device``, on its unit's home
    node, at ``graph``'s input shapes. Empty when the graph carries no FX tags."""
    import torch

    if not isinstance(program, torch.export.ExportedProgram):
        from onnx_partition.graph.program import load_program  # weights beside the program

        program = load_program(program)
    homes = unit_homes(graph, program)
    if not homes:
        return []
    ops = aten_ops(program, [graph.input_shapes[name] for name in graph.inputs])
    out = [0.0] * len(graph.nodes)
    for name, op in ops.items():
        if name in homes:
            out[homes[name]] += aten_backward_ms(op, device)
    return out


def with_aten_backward(graph: OpGraph, node_costs: NodeCosts, model: Path, device: DeviceSpec,
                       loaded: ExportedProgram | None = None) -> tuple[NodeCosts, bool]:
    """``node_costs`` with its backward priced per aten op (:func:`backward_per_node`) of the
    program beside ``model`` (``model.pt2``; ``loaded``: that program, already read) on
    ``device``, and whether it was: without a program, or FX tags in the graph, the backward
    factor stays."""
    program = model.with_suffix(".pt2")
    if loaded is None and not program.is_file():
        return node_costs, False
    try:
        backward = backward_per_node(graph, program if loaded is None else loaded, device)
    except Exception as exc:  # a program torch cannot run at these shapes
        first = str(exc).splitlines()[0] if str(exc) else ""
        raise PartitionError(f"could not price the backward of program {program}: "
                             f"{type(exc).__name__}: {first}") from None
    if not backward:
        return node_costs, False
    backward = [0.0 if n.free else b for n, b in zip(graph.nodes, backward, strict=True)]
    return NodeCosts(node_costs.forward_ms, backward, node_costs.source,
                     node_costs.measured), True
