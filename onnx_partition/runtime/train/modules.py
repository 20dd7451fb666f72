"""Stage modules: one ``torch.fx.GraphModule`` per stage of a train plan, cut from the program.

The model was exported by :func:`onnx_partition.export` in train mode, so every ONNX node's tag
(``pkg.torch.onnx.fx_node``) names a node of the saved program ``model.pt2``, and the partitioner
kept the ONNX nodes of one FX node in one stage. Hence (docs/design.md, "Training: FX mapping,
relay, tied weights"):

* an FX node tagged on stage k's ONNX nodes runs in stage k;
* an untagged ``getitem`` runs where the tuple it reads is made; any other untagged FX node runs
  in the first stage among its users' (in reverse program order; one without users runs with
  the latest stage it reads from, or nowhere if no output or side effect needs it);
* stage k's inputs and outputs are plan.json's, by name: a model input is the program's user
  input at the same position, a model output its user output at the same position, and any
  other cut tensor the FX node of that name (the exporter names ONNX values after FX nodes);
  an integer (a symbolic size) crosses a cut as a 0-d int64 tensor;
* parameters, buffers and constants live in every stage that reads them, under their original
  name; parameters tied in the original (one tensor under several names, e.g. GPT-2's ``wte``
  and ``lm_head``) take the first name in the program's signature in every stage and in
  :func:`whole_module`, and are reported in :attr:`StageModule.tied`;
* the program's buffer mutations (batch norm's running statistics) are copied into the stage's
  buffers at the end of the forward that computes them;
* a node that creates a tensor on a fixed device (the exporter writes ``device=cpu`` into
  ``arange``, ``full``, ``zeros``...) takes instead the device of the module's empty,
  non-persistent buffer ``_device_anchor``, so ``module.to(device)`` moves everything it makes.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import onnx
import torch
import torch.fx
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind, OutputKind

from onnx_partition.errors import PartitionError
from onnx_partition.fileio import sha256_file
from onnx_partition.graph.fxtag import fx_node_name
from onnx_partition.graph.program import load_program as read_program
from onnx_partition.plan import Plan, read_plan

__all__ = ["LazyStage", "StageModule", "eval_module", "lazy_stages", "load_program",
           "require_trainable", "stage_modules", "whole_module"]

#: Ops that draw dropout masks, with the position of their ``train`` flag or probability.
_DROPOUT_FLAG = {torch.ops.aten.native_dropout.default: 2, torch.ops.aten.dropout.default: 2}
_SDPA = torch.ops.aten.scaled_dot_product_attention.default
#: Batch norm ops, each with its ``training`` flag at argument 5.
_BATCH_NORM = (torch.ops.aten._native_batch_norm_legit_functional.default,
               torch.ops.aten._native_batch_norm_legit.default,
               torch.ops.aten.native_batch_norm.default, torch.ops.aten.batch_norm.default)
#: The empty buffer whose device the tensor-creating nodes of a stage module follow.
DEVICE_ANCHOR = "_device_anchor"


@dataclass
class StageModule:
    """One pipeline stage: ``module(*inputs) -> tuple of outputs``, tensors named as plan.json."""

    index: int
    module: torch.nn.Module
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    # parameter name -> indices of all stages holding a copy of it (only when >= 2 do)
    tied: dict[str, tuple[int, ...]] = field(default_factory=dict)


def require_trainable(plan_dir: str | Path) -> Plan:
    """The plan in ``plan_dir`` if it can be trained: made with ``--mode train`` from a model
    exported with its program, the program present and unaltered (sha256). Otherwise a
    :class:`PartitionError` saying how to make a trainable plan."""
    plan = read_plan(plan_dir)
    how = ("export the model with `onnx-partition export` or onnx_partition.export (which "
           "writes MODEL.pt2 beside MODEL.onnx), then `onnx-partition partition MODEL.onnx "
           "--mode train ...`")
    if plan.mode != "train":
        raise PartitionError(f"plan {plan_dir} was made with --mode {plan.mode}, not for "
                             f"training: {how}")
    if not plan.program:
        raise PartitionError(f"plan {plan_dir} has no exported program beside its model: {how}")
    path = Path(plan_dir) / plan.program
    _check_program_place(Path(plan_dir), plan, path)
    if not path.is_file():
        raise PartitionError(f"the plan's program {path} is missing: {how}")
    digest = sha256_file(path)
    if digest != plan.program_sha256:
        raise PartitionError(f"the plan's program {path} was altered (sha256 {digest[:12]}..., "
                             f"plan.json says {plan.program_sha256[:12]}...): {how}")
    return plan


def _check_program_place(plan_dir: Path, plan: Plan, path: Path) -> None:
    """A program is code (``torch.export.load`` unpickles it): it is loaded only from the plan
    folder, the folder holding it, or the folder of the plan's model (where ``export`` writes
    it), never from wherever a copied plan.json points."""
    where, root = path.resolve(), plan_dir.resolve()
    beside = {root.parent, *([(plan_dir / plan.model).resolve().parent] if plan.model else [])}
    if path.suffix != ".pt2" or not (root in where.parents or where.parent in beside):
        raise PartitionError(f"plan {plan_dir}: its program {plan.program} is not a .pt2 file "
                             "in or beside the plan folder or beside its model; a program is "
                             "code, loaded only from there")


def load_program(plan_dir: str | Path, plan: Plan) -> ExportedProgram:
    """The plan's exported program (checked by :func:`require_trainable`); the last two loaded
    are kept, as loading is slow and the stage modules copy what they use."""
    path = (Path(plan_dir) / plan.program).resolve()
    return _load(str(path), plan.program_sha256)


@functools.lru_cache(maxsize=2)
def _load(path: str, sha256: str) -> ExportedProgram:
    return read_program(path)


def stage_modules(
    plan_dir: str | Path, *, deterministic: bool = False, only: Collection[int] | None = None
) -> list[StageModule]:
    """One module per stage, built from plan.json and the program it names (checked by sha256).
    ``deterministic=True`` turns dropout off (for ``--check``). ``only``: build just these
    stages (a rank builds its own; ``tied`` still counts every stage)."""
    cut = _Cut(plan_dir, deterministic)
    wanted = range(cut.count) if only is None else sorted(set(only))
    for k in wanted:
        if not 0 <= k < cut.count:
            raise PartitionError(f"stage {k} is not in the plan's 0..{cut.count - 1}")
    return [cut.stage(k) for k in wanted]


def lazy_stages(plan_dir: str | Path, *, deterministic: bool = False) -> list[LazyStage]:
    """Every stage's names and ties at once, each module built (its weights copied) only when
    first read: a training rank builds only the stage it serves."""
    cut = _Cut(plan_dir, deterministic)
    return [LazyStage(k, tuple(s.inputs), tuple(s.outputs), cut.tied_of(k), cut)
            for k, s in enumerate(cut.plan.stages)]


@dataclass
class LazyStage:
    """A :class:`StageModule` whose ``module`` is built on first access."""

    index: int
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    tied: dict[str, tuple[int, ...]]
    cut: _Cut = field(repr=False)
    built: torch.nn.Module | None = field(default=None, repr=False)

    @property
    def module(self) -> torch.nn.Module:
        if self.built is None:
            self.built = self.cut.stage(self.index).module
        return self.built


class _Cut:
    """A plan's stage graphs and ties (cheap), from which stage modules are built."""

    def __init__(self, plan_dir: str | Path, deterministic: bool) -> None:
        plan_dir = Path(plan_dir)
        self.plan = plan = require_trainable(plan_dir)
        self.count = len(plan.stages)
        self.program = program = _Program(load_program(plan_dir, plan), plan)
        stage_of = program.assign([_stage_fx_nodes(plan_dir, plan, k)
                                   for k in range(self.count)])
        self.graphs = [program.graph_of(
            nodes=[n for n in program.order if stage_of.get(n.name) == k],
            inputs=s.inputs, outputs=s.outputs, deterministic=deterministic)
            for k, s in enumerate(plan.stages)]
        holders: dict[str, list[int]] = {}
        for k, (_, attrs) in enumerate(self.graphs):
            for name in attrs:
                if program.kind_of(name) == "parameter":
                    holders.setdefault(name, []).append(k)
        self.tied = {name: tuple(ks) for name, ks in holders.items() if len(ks) > 1}

    def tied_of(self, k: int) -> dict[str, tuple[int, ...]]:
        return {n: ks for n, ks in self.tied.items() if k in ks}

    def stage(self, k: int) -> StageModule:
        s = self.plan.stages[k]
        return StageModule(index=k, module=self.program.module(*self.graphs[k]),
                           inputs=tuple(s.inputs), outputs=tuple(s.outputs),
                           tied=self.tied_of(k))


def whole_module(plan_dir: str | Path, *, deterministic: bool = False) -> torch.nn.Module:
    """The whole program as one module: ``forward(*model inputs in plan.inputs order) -> tuple
    of model outputs in plan.outputs order``, parameters named as in the stage modules."""
    plan_dir = Path(plan_dir)
    plan = require_trainable(plan_dir)
    program = _Program(load_program(plan_dir, plan), plan)
    return program.module(*program.graph_of(
        nodes=list(program.order), inputs=[s.name for s in plan.inputs],
        outputs=[s.name for s in plan.outputs], deterministic=deterministic))


def program_names(plan_dir: str | Path) -> dict[str, list[str]]:
    """Parameter/buffer name in the stage modules -> every original name of that tensor (more
    than one for tied parameters): what :mod:`onnx_partition.runtime.train.save` maps to
    initializers."""
    plan_dir = Path(plan_dir)
    plan = require_trainable(plan_dir)
    program = _Program(load_program(plan_dir, plan), plan)
    names: dict[str, list[str]] = {}
    for original, canonical in program.canonical.items():
        names.setdefault(canonical, []).append(original)
    return names


def _stage_fx_nodes(plan_dir: Path, plan: Plan, k: int) -> list[str]:
    """FX node names tagged on stage k's cut nodes (from its stage file; constants left out)."""
    stage = plan.stages[k]
    model = onnx.load(str(plan_dir / stage.file), load_external_data=False)
    own = set(stage.nodes)
    names = [fx_node_name(node) for node in model.graph.node if node.name in own]
    return [n for n in names if n is not None]


def _to_int(value: torch.Tensor) -> int:
    """A symbolic size received across a cut (a 0-d tensor) back to a Python int."""
    return int(value.item())


def _from_value(value: Any) -> torch.Tensor:
    """A non-tensor value (a size) sent across a cut as a 0-d int64 tensor."""
    return value if isinstance(value, torch.Tensor) else torch.tensor(int(value))


def _assign(buffer: torch.Tensor, value: torch.Tensor) -> None:
    """A buffer mutation of the program (running statistics), outside autograd."""
    with torch.no_grad():
        buffer.copy_(value)


class _Program:
    """The exported program's graph, signature and tensors, read once."""

    def __init__(self, program: ExportedProgram, plan: Plan) -> None:
        self.graph = program.graph
        self.order = [n for n in self.graph.nodes if n.op == "call_function"]
        self.nodes = {n.name: n for n in self.graph.nodes}
        sig = program.graph_signature
        self.tensor: dict[str, torch.Tensor] = {}  # placeholder name -> its value
        self.target: dict[str, str] = {}  # placeholder name -> original FQN / constant name
        self.kind: dict[str, str] = {}  # placeholder name -> parameter | buffer | constant
        self.source: dict[str, str] = {}  # name in the built modules -> a placeholder of it
        user_inputs: list[torch.fx.Node] = []
        seen: dict[object, str] = {}
        self.canonical: dict[str, str] = {}  # original name -> name in the built modules
        for spec in sig.input_specs:
            name = spec.arg.name
            if spec.kind == InputKind.USER_INPUT:
                user_inputs.append(self.nodes[name])
                continue
            target = str(spec.target)
            if spec.kind == InputKind.PARAMETER:
                value, kind = program.state_dict[target], "parameter"
            elif spec.kind == InputKind.BUFFER:
                persistent = spec.persistent is not False
                value = program.state_dict[target] if persistent else program.constants[target]
                kind = "buffer" if persistent else "constant"
            elif spec.kind == InputKind.CONSTANT_TENSOR:
                value, kind = program.constants[target], "constant"
            else:
                raise PartitionError(f"the program's input {name} ({spec.kind.name}) is not "
                                     "supported for training")
            assert isinstance(value, torch.Tensor)
            self.tensor[name], self.kind[name] = value, kind
            key = _storage_key(value) if kind == "parameter" else name
            self.canonical[target] = seen.setdefault(key, target)
            self.target[name] = self.canonical[target]
            self.source.setdefault(self.canonical[target], name)
        self.user_outputs: list[torch.fx.Node] = []
        self.mutations: list[tuple[torch.fx.Node, str]] = []  # (value, buffer placeholder)
        output = next(n for n in self.graph.nodes if n.op == "output")
        values = list(output.args[0])
        buffer_ph = {str(s.target): s.arg.name for s in sig.input_specs
                     if s.kind == InputKind.BUFFER}
        for spec, value in zip(sig.output_specs, values, strict=True):
            if spec.kind == OutputKind.USER_OUTPUT:
                self.user_outputs.append(value)
            elif spec.kind == OutputKind.BUFFER_MUTATION:
                self.mutations.append((value, buffer_ph[str(spec.target)]))
            else:
                raise PartitionError(f"the program's output {spec.kind.name} is not supported "
                                     "for training")
        self.mutated = {buffer for _, buffer in self.mutations}
        # call nodes computed from weights and constants alone (a causal mask, a transposed
        # weight): like the ONNX stages' free constants, each stage needing one recomputes it
        self.static: set[str] = set()
        for node in self.order:
            if all(a.name in self.target or a.name in self.static for a in node.all_input_nodes):
                self.static.add(node.name)
        if len(user_inputs) != len(plan.inputs) or len(self.user_outputs) != len(plan.outputs):
            raise PartitionError(
                f"the program has {len(user_inputs)} inputs and {len(self.user_outputs)} "
                f"outputs, the plan's model {len(plan.inputs)} and {len(plan.outputs)}: was the "
                "program exported with this model?")
        # ONNX value name -> FX node: model inputs and outputs by position, others by name
        self.value = {spec.name: node for spec, node in zip(plan.inputs, user_inputs)}
        self.value.update({spec.name: node for spec, node in zip(plan.outputs, self.user_outputs)
                           if isinstance(node, torch.fx.Node)})

    def resolve(self, name: str) -> torch.fx.Node:
        node = self.value.get(name) or self.nodes.get(name)
        if node is None:
            raise PartitionError(f"tensor {name!r} of the plan names no value of the program: "
                                 "was the model exported by onnx_partition.export?")
        return node

    def assign(self, tagged: Sequence[Sequence[str]]) -> dict[str, int]:
        """Stage of every call node: tagged ones where their ONNX nodes are, the rest by the
        rules in the module docstring."""
        stage_of: dict[str, int] = {}
        for k, names in enumerate(tagged):
            for name in names:
                if name not in self.nodes:
                    raise PartitionError(f"the plan names FX node {name!r}, which the program "
                                         "lacks: was the model exported with this program?")
                if stage_of.setdefault(name, k) != k:
                    raise PartitionError(f"FX node {name!r} is split across stages "
                                         f"{stage_of[name]} and {k}: partition the model again")
        for node in self.order:  # a tuple stays where it is made
            if node.name not in stage_of and node.target is operator.getitem:
                source = node.args[0]
                if isinstance(source, torch.fx.Node) and source.name in stage_of:
                    stage_of[node.name] = stage_of[source.name]
        for node in reversed(self.order):
            if node.name in stage_of:
                continue
            users = [stage_of[u.name] for u in node.users if u.name in stage_of]
            if users:
                stage_of[node.name] = min(users)
        live = self.live()
        for node in self.order:  # no user in any stage: with the latest stage it reads from
            if node.name not in stage_of and node.name in live:
                reads = [stage_of[a.name] for a in node.all_input_nodes if a.name in stage_of]
                stage_of[node.name] = max(reads, default=0)
        return stage_of

    def live(self) -> set[str]:
        """Call nodes an output, a buffer update or a side effect needs: the others (shape
        checks whose results nobody reads, on a second input such as ``labels``) run nowhere
        when untagged, as a stage may not receive what they read."""
        output = next(n for n in self.graph.nodes if n.op == "output")
        stack = [*output.all_input_nodes, *(n for n in self.order if n.is_impure())]
        live: set[str] = set()
        while stack:
            node = stack.pop()
            if node.name not in live:
                live.add(node.name)
                stack.extend(node.all_input_nodes)
        return live

    def graph_of(
        self,
        *,
        nodes: Sequence[torch.fx.Node],
        inputs: Sequence[str],
        outputs: Sequence[str],
        deterministic: bool,
    ) -> tuple[torch.fx.Graph, dict[str, torch.fx.Node]]:
        """The graph running ``nodes`` (program order) from ``inputs`` to ``outputs``, and its
        weight reads (name -> get_attr node), for :meth:`module`."""
        graph = torch.fx.Graph()
        env: dict[torch.fx.Node, torch.fx.Node] = {}
        for name in inputs:
            node = self.resolve(name)
            placeholder = graph.placeholder(_identifier(name))
            env[node] = (placeholder if _is_tensor(node)
                         else graph.call_function(_to_int, (placeholder,)))
        attrs: dict[str, torch.fx.Node] = {}
        members = {n.name for n in nodes}
        device: list[torch.fx.Node] = []  # the anchor's device, read once when first needed

        def copy_of(node: torch.fx.Node) -> torch.fx.Node:
            fixed = isinstance(node.kwargs.get("device"), torch.device)
            if fixed and not device:
                device.append(graph.call_function(_device_of, (graph.get_attr(DEVICE_ANCHOR),)))
            copy = graph.node_copy(node, lambda a: env[a])
            if fixed:
                copy.kwargs = {**copy.kwargs, "device": device[0]}
            return copy

        def read(arg: torch.fx.Node) -> torch.fx.Node:
            if arg in env:
                return env[arg]
            if arg.op == "placeholder" and arg.name in self.target:
                target = self.target[arg.name]
                if target not in attrs:
                    attrs[target] = graph.get_attr(target)
                # a buffer the program updates is read through a copy: the update must not
                # touch a tensor autograd saved
                env[arg] = (graph.call_function(torch.clone, (attrs[target],))
                            if arg.name in self.mutated else attrs[target])
                return env[arg]
            if arg.name in self.static:  # made from weights and constants alone: recompute
                for source in arg.all_input_nodes:
                    read(source)
                env[arg] = copy_of(arg)
                return env[arg]
            raise PartitionError(f"a stage needs {arg.name!r}, which it neither computes nor "
                                 "receives: partition the model again")

        for node in nodes:
            for arg in node.all_input_nodes:
                read(arg)
            copy = copy_of(node)
            if deterministic:
                _no_dropout(copy)
            if copy.target == torch.ops.aten.view.default:
                # a tensor received from another process is contiguous, not strided as it was
                # in the whole program: reshape is the same view where the strides allow one,
                # a copy where they do not (found on a Llama decoder cut between processes)
                copy.target = torch.ops.aten.reshape.default
            env[node] = copy
        for value, buffer in self.mutations:
            if isinstance(value, torch.fx.Node) and value.name in members:
                read(self.nodes[buffer])
                graph.call_function(_assign, (attrs[self.target[buffer]], env[value]))
        results = []
        for name in outputs:
            node = self.resolve(name)
            results.append(env[node] if _is_tensor(node)
                           else graph.call_function(_from_value, (read(node),)))
        graph.output(tuple(results))
        graph.lint()
        return graph, attrs

    def kind_of(self, target: str) -> str:
        """``parameter``, ``buffer`` or ``constant``: what the weight named ``target`` is."""
        return self.kind[self.source[target]]

    def module(
        self, graph: torch.fx.Graph, attrs: dict[str, torch.fx.Node]
    ) -> torch.fx.GraphModule:
        root = torch.nn.Module()
        constants = []
        for target in attrs:
            placeholder = self.source[target]
            value, kind = self.tensor[placeholder], self.kind[placeholder]
            *path, leaf = target.split(".")
            owner = root
            for part in path:
                if not hasattr(owner, part):
                    owner.add_module(part, torch.nn.Module())
                owner = getattr(owner, part)
            copy = value.detach().clone()
            if kind == "parameter":
                owner.register_parameter(leaf, torch.nn.Parameter(
                    copy, requires_grad=copy.is_floating_point() or copy.is_complex()))
            else:
                owner.register_buffer(leaf, copy, persistent=kind == "buffer")
                if kind == "constant":
                    constants.append(target)
        if any(n.op == "get_attr" and n.target == DEVICE_ANCHOR for n in graph.nodes):
            root.register_buffer(DEVICE_ANCHOR, _anchor_on(self.tensor), persistent=False)
            constants.append(DEVICE_ANCHOR)
        module = torch.fx.GraphModule(root, graph)
        for target in constants:  # GraphModule registers every copied tensor as persistent
            *path, leaf = target.split(".")
            owner = module.get_submodule(".".join(path)) if path else module
            owner._non_persistent_buffers_set.add(leaf)
        return module


def _device_of(anchor: torch.Tensor) -> torch.device:
    return anchor.device


def _anchor_on(tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    """The empty anchor, on the device of the program's weights (cpu when it has none or they
    are weightless, on meta)."""
    device = next(iter(tensors.values())).device if tensors else torch.device("cpu")
    return torch.empty(0, device="cpu" if device.type == "meta" else device)


def _storage_key(value: torch.Tensor) -> object:
    """Tensors with equal keys are one tensor under several names (tied parameters); a loaded
    program keeps the sharing as shared storage, not as one object. Meta tensors (a weightless
    program) have no storage: they are told apart by identity."""
    if value.is_meta:
        return (id(value),)
    return (value.untyped_storage().data_ptr(), value.storage_offset(), tuple(value.shape),
            tuple(value.stride()), value.dtype)


def _is_tensor(node: torch.fx.Node) -> bool:
    return isinstance(node.meta.get("val"), torch.Tensor) or node.op == "placeholder"


def _identifier(name: str) -> str:
    text = "".join(c if c.isalnum() else "_" for c in name)
    return text if text and not text[0].isdigit() else f"v_{text}"


def eval_module(module: torch.nn.Module) -> torch.nn.Module:
    """``module`` as ``model.eval()`` would run it, sharing its parameters and buffers: the
    exported train-mode program has dropout and batch statistics written into its graph, so
    ``.eval()`` changes nothing in it. The copy's graph has dropout off, batch norm on its
    running statistics, and no buffer updates (a validation pass must neither draw from the
    training's random stream nor move the running statistics). A module that is not an FX
    graph is taken to honour ``.eval()`` and returned as it is."""
    if not isinstance(module, torch.fx.GraphModule):
        return module
    graph = torch.fx.Graph()
    graph.output(graph.graph_copy(module.graph, {}))
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        if node.target is _assign:
            graph.erase_node(node)
        elif node.target in _BATCH_NORM and len(node.args) > 5:
            node.args = (*node.args[:5], False, *node.args[6:])
        else:
            _no_dropout(node)
    graph.eliminate_dead_code()
    return torch.fx.GraphModule(module, graph)


def _no_dropout(node: torch.fx.Node) -> None:
    """Dropout off: the ``train`` flag of dropout ops false, attention dropout zero."""
    if node.target in _DROPOUT_FLAG:
        args = list(node.args)
        position = _DROPOUT_FLAG[node.target]
        if len(args) > position:
            args[position] = False
            node.args = tuple(args)
        else:
            node.kwargs = {**node.kwargs, "train": False}
    elif node.target == _SDPA:
        args = list(node.args)
        if len(args) > 4:
            args[4] = 0.0
            node.args = tuple(args)
        elif "dropout_p" in node.kwargs:
            node.kwargs = {**node.kwargs, "dropout_p": 0.0}
