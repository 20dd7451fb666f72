"""Activation memory as autograd keeps it: the bytes each FX unit saves for backward.

A training step holds, per micro-batch in flight, exactly the tensors autograd saved for the
backward pass (a linear's input, GELU's input, layer norm's mean and rstd, a dropout mask), not
every operator output: views and tensors no backward reads are freed as the forward goes on.
So the exported program (``model.pt2``, written beside the ONNX file by
:func:`onnx_partition.export`) is run once, node by node, inside
``torch.autograd.graph.saved_tensors_hooks``: every tensor packed for backward is counted by its
*storage* (:class:`torch.multiprocessing.reductions.StorageWeakRef`, so two views of one buffer
count once, and a tensor saved by two ops counts once, at the first), and the storage's bytes
go to the FX node running when it was first saved. Parameters, buffers and constants are left
out (the memory model counts the weights apart), except a buffer the program updates (batch
norm's running statistics): the training stage modules read it through a copy so that the
update cannot touch a saved tensor (:mod:`onnx_partition.runtime.train.modules`), and what
backward saves of that copy is held per micro-batch, so it counts.

The run is made under :class:`torch._subclasses.fake_tensor.FakeTensorMode` by default: fake
tensors carry shape, dtype and storage size but no data, so GPT-2 medium at 1024 tokens (or a
7B model's layer) is counted without the memory it describes. ``fake=False`` runs on real
tensors (the tests check both count the same bytes).

**Mixed precision** (``precision="bf16"`` or ``"fp16"``): the run is made under autocast
with that dtype over the fp32 parameters, as ``train --precision bf16`` runs a stage
(:mod:`onnx_partition.runtime.train.rank`), so every saved tensor has the dtype autocast really
keeps: a matrix product's inputs as their half casts (a weight's cast too where backward needs
it: autocast caches one cast per weight per region, and the trainer opens one region per
micro-batch, so each micro-batch in flight holds its own), what follows in the dtype it
computes in, a loss in fp32. ``policy="cpu"`` runs torch's CPU autocast; ``"cuda"`` (a GPU
plan's) applies CUDA autocast's policy op by op (:mod:`onnx_partition.cost.autocast`: CUDA
autocast is disabled where CUDA is not available, and autograd cannot build a fake CUDA
tensor's graph there). Two fixes keep the fake count equal to a real run's: a mixed-type
normalisation's statistics get the fp32 the CPU kernel gives them (:data:`_NORMS`), and the
program's ``_assert_tensor_metadata`` checks (of the dtypes traced at export, which autocast
moves) are skipped.

:func:`saved_bytes_per_node` maps the units onto the ONNX graph the solvers see: a unit's bytes
on its first ONNX node (in graph order), the unit's other nodes 0, the way a train costs file
keys a unit's times. An FX node without ONNX nodes (untagged) gives its bytes to the first
tagged node it feeds (else the last tagged node before it), as
:mod:`onnx_partition.runtime.train.modules` runs it there.

**The trainer's loss** (``loss``: a program without its own, given no labels) is run after the
program on its outputs; what it saves and its backward's gradients go to the node that made the
first output, so the last stage counts them as it counts an in-graph loss's.
"""

from __future__ import annotations

import contextlib
import operator
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple, cast

from onnx_partition.cost.autocast import POLICIES, PRECISIONS, AutocastPolicy, cast_call
from onnx_partition.cost.fused_attention import device_attention, meta_attention
from onnx_partition.errors import PartitionError
from onnx_partition.graph import OpGraph
from onnx_partition.graph.fxtag import fx_unit
from onnx_partition.settings.partition import TrainSpec

if TYPE_CHECKING:
    from collections.abc import Callable

    import torch
    from torch.export import ExportedProgram

    #: the trainer's loss of a program's user outputs (in output order)
    OutputsLoss = Callable[[Sequence[torch.Tensor]], torch.Tensor]

__all__ = ["HALF_DTYPES", "PRECISIONS", "PerNode", "SavedBytes", "autocast_for", "check_precision",
           "counted_per_node", "kept_gradient_bytes", "program_inputs", "saved_and_kept_per_node",
           "saved_by_module", "saved_bytes", "saved_bytes_per_node", "traced_on_meta",
           "working_gradient_bytes"]


#: Training precisions a plan can be priced for (:data:`PRECISIONS`): fp32, or autocast to a
#: half dtype over fp32 parameters (``partition --precision``; ``train --precision`` runs fp32
#: and bf16). The torch dtype (by name) autocast computes in, per half precision.
HALF_DTYPES = {"bf16": "bfloat16", "fp16": "float16"}


def check_precision(precision: str) -> str:
    """``precision`` if it is one of :data:`PRECISIONS`, else :class:`PartitionError`."""
    if precision not in PRECISIONS:
        raise PartitionError(f"unknown precision {precision!r}; choose one of "
                             f"{', '.join(PRECISIONS)}")
    return precision


def autocast_for(precision: str) -> contextlib.AbstractContextManager[object]:
    """torch's CPU ``torch.autocast`` to ``precision``'s half dtype (a CPU run's policy; a
    GPU's is applied op by op, :mod:`onnx_partition.cost.autocast`), or nothing for fp32."""
    import torch

    if check_precision(precision) == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device_type="cpu", dtype=getattr(torch, HALF_DTYPES[precision]))


@dataclass(frozen=True)
class SavedBytes:
    """Bytes saved for backward per FX node (program order; nodes saving nothing left out),
    their total (each storage once) and the bytes of the parameters the run left out."""

    per_node: dict[str, int]
    total: int
    weights: int
    #: bytes of the output gradient ZB-H1 keeps per FX node from ``I`` to ``W``
    #: (:func:`kept_gradient_bytes`; nodes keeping nothing left out)
    kept: dict[str, int] = field(default_factory=dict)
    #: bytes of the gradients live while each FX node's backward runs
    #: (:func:`working_gradient_bytes`; nodes with none left out)
    working: dict[str, int] = field(default_factory=dict)


def _counter() -> tuple[dict[str, int], list[str], Any, Any]:
    """(per-node bytes, the running node holder, the pack hook, seen storages)."""
    from torch.multiprocessing.reductions import StorageWeakRef

    per_node: dict[str, int] = {}
    current = [""]
    seen: set[Any] = set()

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        key = StorageWeakRef(storage)
        if key not in seen:
            seen.add(key)
            per_node[current[0]] = per_node.get(current[0], 0) + int(storage.nbytes())
        return tensor

    return per_node, current, pack, seen


def saved_by_module(module: torch.nn.Module, *args: torch.Tensor,
                    precision: str = TrainSpec().precision) -> int:
    """Bytes ``module(*args)`` saves for backward (unique storages, its parameters and buffers
    left out; under ``precision``'s autocast): the reference count the tests and the
    whole-program check compare with."""
    import torch
    from torch.multiprocessing.reductions import StorageWeakRef

    per_node, _, pack, seen = _counter()
    for tensor in [*module.parameters(), *module.buffers()]:
        seen.add(StorageWeakRef(tensor.untyped_storage()))
    with autocast_for(precision), _mixed_norm_stats(precision), \
            torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        module(*args)  # the dispatch mode changes nothing on real tensors (their kernels
        # already keep mixed statistics in fp32); under FakeTensorMode it makes them so
    return sum(per_node.values())


def program_inputs(program: ExportedProgram, shapes: Sequence[Sequence[int]]
                   ) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """Shape and dtype of each user input of ``program`` at the given shapes (dtypes are the
    program's)."""
    from torch.export.graph_signature import InputKind

    nodes = {n.name: n for n in program.graph.nodes}
    user = [nodes[s.arg.name] for s in program.graph_signature.input_specs
            if s.kind == InputKind.USER_INPUT]
    if len(user) != len(shapes):
        raise PartitionError(f"the program has {len(user)} inputs, {len(shapes)} shapes given: "
                             "was the program exported with this model?")
    out = []
    for node, shape in zip(user, shapes, strict=True):
        val = node.meta.get("val")
        dtype = getattr(val, "dtype", None)
        if dtype is None:
            raise PartitionError(f"the program's input {node.name} is not a tensor")
        out.append((tuple(int(d) for d in shape), dtype))
    return out


def saved_bytes(program: ExportedProgram, shapes: Sequence[Sequence[int]], *,
                fake: bool = True, seed: int = 0, precision: str = TrainSpec().precision,
                policy: str | AutocastPolicy = "cpu", loss: OutputsLoss | None = None
                ) -> SavedBytes:
    """Bytes each FX node of ``program`` saves for backward, its user inputs at ``shapes``
    (random values; integer inputs in ``[0, 2)`` so indices stay valid), dropout on as in
    training, computed in ``precision`` (fp32, or autocast to bf16/fp16: module docstring)
    under autocast's ``policy``: ``cpu``, torch's CPU autocast; ``cuda`` (or an
    :class:`~onnx_partition.cost.autocast.AutocastPolicy`), that policy applied op by op
    (:mod:`onnx_partition.cost.autocast`). ``fake=True`` (default) computes it under
    ``FakeTensorMode``: no memory, any shape. ``loss``: the trainer's loss of the program's
    user outputs, run after it outside autocast (:func:`_count_loss`): what it saves and the
    gradients of its backward are counted on the node that made the first output."""
    import torch

    check_precision(precision)
    specs = program_inputs(program, shapes)
    per_node, current, pack, seen = _counter()
    if isinstance(policy, str) and policy not in POLICIES:
        raise PartitionError(f"unknown autocast policy {policy!r}; choose "
                             f"{', '.join(POLICIES)}")
    # torch's own autocast on CPU; another device's policy (or a given one) applied by hand,
    # and CPU's too on a weightless model (meta tensors have no autocast)
    weightless = any(traced_on_meta(program, s.arg.name)
                     for s in program.graph_signature.input_specs)
    by_hand = (None if policy == "cpu" and not weightless
               else POLICIES[policy] if isinstance(policy, str) else policy)
    half = None if precision == "fp32" else getattr(torch, HALF_DTYPES[precision])
    args, weights, mode = _program_feeds(program, specs, fake, seed, seen)
    kept: dict[str, int] = {}
    working: dict[str, int] = {}
    interpreter = _counting(program, current, by_hand, half, kept, working)
    region = autocast_for(precision) if by_hand is None else contextlib.nullcontext()
    fakes = mode if mode is not None else contextlib.nullcontext()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), fakes:
        with region, _mixed_norm_stats(precision) if mode is not None \
                else contextlib.nullcontext():
            outputs = interpreter.run(*args)
        if loss is not None:
            _count_loss(program, outputs, loss, current, working)
    order = [n.name for n in program.graph.nodes if n.name in per_node]
    return SavedBytes({n: per_node[n] for n in order}, sum(per_node.values()), weights,
                      {n.name: kept[n.name] for n in program.graph.nodes if kept.get(n.name)},
                      {n.name: working[n.name] for n in program.graph.nodes
                       if working.get(n.name)})


def _count_loss(program: ExportedProgram, outputs: Any, loss: OutputsLoss, current: list[str],
                working: dict[str, int]) -> None:
    """Run ``loss`` on the program's user outputs as the trainer does after the last stage
    (outside autocast), its saved tensors counted by the hook around it and the most gradient
    bytes of its backward's ops (:func:`_inner_working`, the outputs its data) into
    ``working``, both on the FX node that made the first user output (``cross_entropy``: its
    log-softmax's output saved, two logits-sized gradients in its backward)."""
    import torch.fx
    from torch.export.graph_signature import OutputKind

    specs = program.graph_signature.output_specs
    values = outputs if isinstance(outputs, (tuple, list)) else (outputs,)
    made = [v for v, spec in zip(values, specs, strict=True)
            if spec.kind == OutputKind.USER_OUTPUT]
    ends = [a for a, spec in zip(program.graph.output_node().args[0], specs, strict=True)
            if spec.kind == OutputKind.USER_OUTPUT]
    if not made or not isinstance(ends[0], torch.fx.Node):
        return
    current[0] = ends[0].name
    inner = _inner_working(made)
    with inner:
        loss(made)
    if inner.most:
        working[current[0]] = max(working.get(current[0], 0), inner.most)


def kept_gradient_bytes(value: Any, inputs: Sequence[Any], data: Sequence[bool]) -> int:
    """Bytes of the output gradient ZB-H1's input pass keeps for its weight pass at an op
    that made ``value`` (its outputs read) from ``inputs``, of which those flagged in ``data``
    are made from the model's inputs (:func:`onnx_partition.runtime.train.passes.input_pass`'s
    frontier nodes): an op reading both a tensor requiring grad made from trainable
    parameters alone (a weight, its transpose or cast) and an activation (one requiring grad
    made from the inputs) keeps the gradient of each floating output that requires grad, one
    of its size and dtype (a linear's ``dY``, a layer norm's); any other op keeps none (an
    embedding reads its weight and integer indices: no activation)."""
    import torch

    grads = [d for t, d in zip(inputs, data, strict=True)
             if isinstance(t, torch.Tensor) and t.requires_grad]
    if all(grads) or not any(grads):  # no weight, or no activation (or neither)
        return 0
    outs = value if isinstance(value, (tuple, list)) else (value,)
    return sum(int(o.numel() * o.element_size()) for o in outs
               if isinstance(o, torch.Tensor) and o.requires_grad and o.is_floating_point())


def working_gradient_bytes(outputs: Sequence[Any], activations: Sequence[Any]) -> int:
    """Bytes of the gradients live while the backward of one aten op runs: that of each of its
    floating ``outputs`` (arriving) and of each of its floating ``activations`` that requires
    grad (its inputs made from the model's inputs; produced), each storage once at its
    largest view (a view's gradient is a view of its base's). A weight's gradient is left out
    (the memory model counts the parameters' gradients apart), as is anything not floating
    (indices, masks). The loss's log-softmax holds two logits-sized gradients this way,
    besides the output it saved; :func:`_inner_working` applies it to every aten op an FX node
    runs (``cross_entropy_loss``: its log-softmax and its NLL)."""
    import torch
    from torch.multiprocessing.reductions import StorageWeakRef

    sizes: dict[Any, int] = {}
    for t, made in [*((o, True) for o in outputs), *((a, False) for a in activations)]:
        if (isinstance(t, torch.Tensor) and t.is_floating_point()
                and (made or t.requires_grad)):
            key = StorageWeakRef(t.untyped_storage())
            sizes[key] = max(sizes.get(key, 0), int(t.numel() * t.element_size()))
    return sum(sizes.values())


def _views() -> tuple[frozenset[Any], frozenset[Any]]:
    """Aten ops whose backward makes no gradient: aliases torch does not mark as views
    (``_unsafe_view``: a linear's reshape back to 3-d), reshaping it in place; and ops handing
    each input a view of the arriving one (``cat``'s ``narrow``, ``stack``'s ``unbind``)."""
    import torch

    aten = torch.ops.aten
    return frozenset({aten._unsafe_view.default}), frozenset({aten.cat.default, aten.stack.default})


def _inner_working(data: Sequence[Any]) -> Any:
    """A dispatch mode that finds, over the aten ops one FX node runs (a composite op's own,
    below autograd, where autograd has marked their inputs but not yet their results), the
    most :func:`working_gradient_bytes` one holds (``most``): of each op reading a tensor
    requiring grad and one made from ``data`` (the node's activation inputs, and what the
    node's ops make of them), its results and its inputs made from ``data`` (a ``cat``'s are
    views of its result's: unet's Concat measured one). Views make nothing new, nor do ops of
    weights alone (a transpose, a cast: a weight's gradient)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    views, sliced = _views()

    class InnerWorking(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.most = 0
            self.data = {id(t): t for t in data if isinstance(t, torch.Tensor)}

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                               kwargs: Any = None) -> Any:
            out = func(*args, **(kwargs or {}))
            ins = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
            acts = [t for t in ins if self.data.get(id(t)) is t]
            if not acts:
                return out
            made = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
            self.data.update((id(t), t) for t in made)
            graded = any(t.requires_grad and t.is_floating_point() for t in ins)
            if graded and not (getattr(func, "is_view", False) or func in views):
                produced = [] if func in sliced else acts  # views of the arriving gradient
                self.most = max(self.most, working_gradient_bytes(made, produced))
            return out

    return InnerWorking()


def _counting(program: ExportedProgram, current: list[str], by_hand: AutocastPolicy | None,
              half: torch.dtype | None, kept: dict[str, int] | None = None,
              working: dict[str, int] | None = None) -> torch.fx.Interpreter:
    """An interpreter of ``program`` that names the node running in ``current[0]`` (for the
    saved-tensor hook), under a policy applied by hand casts each op as it says, and counts
    into ``kept`` each node's :func:`kept_gradient_bytes` and into ``working`` the most
    :func:`working_gradient_bytes` of its aten ops (:func:`_inner_working`)."""
    import torch
    import torch.fx

    cache: dict[Any, Any] = {}  # one autocast region: one cast per weight
    from torch.export.graph_signature import InputKind

    data = {s.arg.name for s in program.graph_signature.input_specs  # made from the inputs
            if s.kind == InputKind.USER_INPUT}

    class Counting(torch.fx.Interpreter):
        def run_node(self, n: torch.fx.Node) -> Any:
            current[0] = n.name
            ins = n.all_input_nodes
            if kept is None or not ins or n.op == "output":  # a placeholder (a user input is
                return super().run_node(n)  # data), a constant made in the graph, the end
            marks = [a.name in data for a in ins]
            values = [self.env.get(a) for a in ins]
            inner = _inner_working([v for v, d in zip(values, marks, strict=True) if d])
            if working is not None:
                with inner:
                    value = super().run_node(n)
            else:
                value = super().run_node(n)
            if any(marks):
                data.add(n.name)
            outs = value
            if isinstance(value, (tuple, list)):  # the gradients of the outputs read only
                outs = [value[cast(int, u.args[1])] for u in n.users
                        if u.target is operator.getitem]
            nbytes = kept_gradient_bytes(outs, values, marks)
            if nbytes:
                kept[n.name] = nbytes
            if working is not None and inner.most:
                working[n.name] = inner.most
            return value

        def call_function(self, target: Any, args: Any, kwargs: Any) -> Any:
            if half is not None and target is torch.ops.aten._assert_tensor_metadata.default:
                return None  # asserts the dtype traced at export (fp32), which autocast moves
            if by_hand is None or half is None:
                return self._call(target, args, kwargs)
            return cast_call(by_hand, half, cache, target, args, kwargs, self._call)

        def _call(self, target: Any, args: Any, kwargs: Any) -> Any:
            if meta_attention(target, args, kwargs):  # the fused kernel, not meta's math
                return device_attention(*args, **kwargs)
            return super().call_function(target, args, kwargs)

    return Counting(program.graph_module)


def _program_feeds(program: ExportedProgram, specs: Sequence[tuple[tuple[int, ...], torch.dtype]],
                   fake: bool, seed: int, seen: set[Any]) -> tuple[list[Any], int, Any]:
    """The program's arguments in input-spec order (user inputs random at ``specs``; weights,
    buffers and constants from the program; with ``fake``, all fake under the
    ``FakeTensorMode`` returned; trainable ones requiring a gradient, mutated buffers copied)
    and the trainable weights' bytes; the storages no saved tensor counts are added to
    ``seen``."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.export.graph_signature import InputKind
    from torch.multiprocessing.reductions import StorageWeakRef

    sig = program.graph_signature
    mutated = set(sig.buffers_to_mutate.values())  # buffers the program updates

    def weight(spec: Any) -> torch.Tensor:
        target = str(spec.target)
        if spec.kind == InputKind.PARAMETER:
            return program.state_dict[target]
        if spec.kind == InputKind.BUFFER and spec.persistent is not False:
            return program.state_dict[target]
        return program.constants[target]

    generator = torch.Generator().manual_seed(seed)
    real_inputs = [torch.randint(0, 2, shape, generator=generator).to(dtype)
                   if not (dtype.is_floating_point or dtype.is_complex)
                   else torch.randn(shape, generator=generator).to(dtype)
                   for shape, dtype in specs]
    mode = FakeTensorMode(allow_non_fake_inputs=False) if fake else None
    args: list[Any] = []
    weights = 0
    user = iter(real_inputs)
    for spec in sig.input_specs:
        if spec.kind == InputKind.USER_INPUT:
            value = next(user)
            if mode is not None and traced_on_meta(program, spec.arg.name):
                value = value.to("meta")  # a weightless module's input traced with its weights
            args.append(mode.from_tensor(value) if mode is not None else value)
            continue
        value = weight(spec)
        trainable = spec.kind == InputKind.PARAMETER and value.is_floating_point()
        copy = mode.from_tensor(value) if mode is not None else value.detach()
        if trainable:
            copy = copy.detach().requires_grad_(True)
            weights += int(value.untyped_storage().nbytes())
        if str(spec.target) in mutated:  # the stage module reads it through a copy, which
            copy = copy.clone()  # backward may save (batch norm's running statistics)
        else:
            seen.add(StorageWeakRef(copy.untyped_storage()))
        args.append(copy)
    return args, weights, mode


def traced_on_meta(program: ExportedProgram, name: str) -> bool:
    """The program's input ``name`` was traced as a meta tensor (floating inputs of a module
    exported on meta, :func:`onnx_partition.export`)."""
    node = next((n for n in program.graph.nodes if n.op == "placeholder" and n.name == name),
                None)
    value = node.meta.get("val") if node is not None else None
    return bool(getattr(value, "is_meta", False))


#: Normalisations whose CPU kernels keep the statistics (every output after the first) in fp32
#: when a half input meets fp32 weights (``param_scalar_type``, aten ``layer_norm.cpp``,
#: ``group_norm.cpp``, ``Normalization.cpp``), which their fake (meta) kernels give in the
#: input's dtype.
_NORMS = ("native_layer_norm", "native_group_norm", "native_batch_norm",
          "_native_batch_norm_legit", "_native_batch_norm_legit_functional")


def _mixed_norm_stats(precision: str) -> contextlib.AbstractContextManager[object]:
    """Under FakeTensorMode and a half ``precision``: a dispatch mode that gives a mixed-type
    normalisation's statistics the dtype the CPU kernel gives them (:data:`_NORMS`), so the
    fake count equals a real run's; nothing for fp32."""
    if precision == "fp32":
        return contextlib.nullcontext()
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    class MixedNormStats(TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                               kwargs: Any = None) -> Any:
            out = func(*args, **(kwargs or {}))
            if func.overloadpacket.__name__ not in _NORMS or not isinstance(out, tuple):
                return out
            tensors = [a for a in args if isinstance(a, torch.Tensor)]
            half = tensors[0].dtype in (torch.bfloat16, torch.float16)
            if not half or not any(t.dtype == torch.float32 for t in tensors[1:]):
                return out
            return (out[0], *(o.float() if isinstance(o, torch.Tensor) and o.dtype
                              == tensors[0].dtype and o.numel() else o for o in out[1:]))

    return MixedNormStats()


def saved_bytes_per_node(graph: OpGraph, program: str | Path | ExportedProgram, *,
                         fake: bool = True, precision: str = TrainSpec().precision,
                         policy: str = "cpu") -> list[float]:
    """Saved bytes per OpGraph node index (the solvers' activation bytes for a train plan):
    each FX unit's on its first ONNX node, at ``graph``'s input shapes (the micro-batch), in
    ``precision`` under autocast's ``policy`` (``cpu`` or ``cuda``, :func:`saved_bytes`)."""
    return counted_per_node(graph, program, fake=fake, precision=precision,
                            policy=policy).saved


def saved_and_kept_per_node(graph: OpGraph, program: str | Path | ExportedProgram, *,
                            fake: bool = True, precision: str = TrainSpec().precision,
                            policy: str = "cpu") -> tuple[list[float], list[float]]:
    """:func:`saved_bytes_per_node` and, from the same run, the bytes ZB-H1 keeps from ``I``
    to ``W`` per OpGraph node (:attr:`SavedBytes.kept`, mapped the same way)."""
    counted = counted_per_node(graph, program, fake=fake, precision=precision, policy=policy)
    return counted.saved, counted.kept


class PerNode(NamedTuple):
    """One run's figures per OpGraph node index: the bytes saved for backward and ZB-H1's
    kept gradients (each summed over the FX nodes the node carries), and the most gradient
    bytes live at once in the backward of one of those FX nodes (``working``: a maximum,
    :attr:`SavedBytes.working`)."""

    saved: list[float]
    kept: list[float]
    working: list[float]


def counted_per_node(graph: OpGraph, program: str | Path | ExportedProgram, *,
                     fake: bool = True, precision: str = TrainSpec().precision,
                     policy: str = "cpu", loss: OutputsLoss | None = None) -> PerNode:
    """:func:`saved_bytes` of ``program`` (and the trainer's ``loss``) at ``graph``'s input
    shapes (the micro-batch) mapped onto the OpGraph nodes by :func:`unit_homes`: saved and
    kept bytes summed on each home, the working set its largest (the backward runs one op at
    a time)."""
    import torch
    import torch.fx

    if not isinstance(program, torch.export.ExportedProgram):
        from onnx_partition.graph.program import load_program  # weights beside the program

        program = load_program(program)
    shapes = [graph.input_shapes[name] for name in graph.inputs]
    counted = saved_bytes(program, shapes, fake=fake, precision=precision, policy=policy,
                          loss=loss)
    homes = unit_homes(graph, program)
    out = [0.0] * len(graph.nodes)
    kept = [0.0] * len(graph.nodes)
    working = [0.0] * len(graph.nodes)
    for figures, per_node in ((out, counted.per_node), (kept, counted.kept)):
        for name, nbytes in per_node.items():
            if name in homes:
                figures[homes[name]] += nbytes
    for name, nbytes in counted.working.items():
        if name in homes:
            working[homes[name]] = max(working[homes[name]], float(nbytes))
    return PerNode(out, kept, working)


def unit_homes(graph: OpGraph, program: ExportedProgram) -> dict[str, int]:
    """FX call node name -> the OpGraph index carrying its costs: a tagged unit's first ONNX
    node (graph order), an untagged node's by the rule of the module docstring. Empty when the
    ONNX graph carries no FX tags."""
    protos = graph.protos()
    first: dict[str, int] = {}
    for g in graph.compute_nodes:
        unit = fx_unit(protos[graph.nodes[g].key])
        if unit is not None:
            first.setdefault(unit, g)
    if not first:
        return {}
    nodes = {n.name: n for n in program.graph.nodes}
    order = [n.name for n in program.graph.nodes]
    position = {name: i for i, name in enumerate(order)}
    return {n.name: _home(n.name, first, nodes, order, position)
            for n in program.graph.nodes if n.op == "call_function"}


def _home(name: str, first: Mapping[str, int], nodes: Mapping[str, Any],
          order: Sequence[str], position: Mapping[str, int]) -> int:
    """OpGraph index that carries FX node ``name``'s bytes (module docstring)."""
    if name in first:
        return first[name]
    frontier, visited = [nodes[name]], {name}
    while frontier:  # breadth first through users, nearest tagged user wins
        following = []
        for node in frontier:
            for user in sorted(node.users, key=lambda u: position[u.name]):
                if user.name in first:
                    return first[user.name]
                if user.name not in visited:
                    visited.add(user.name)
                    following.append(user)
        frontier = following
    for earlier in reversed(order[:position[name]]):
        if earlier in first:
            return first[earlier]
    return min(first.values())
