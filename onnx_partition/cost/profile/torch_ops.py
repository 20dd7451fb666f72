"""``profile --mode train``: each FX unit's forward and backward time in torch eager, the
executor that trains the plan, written as a train costs file.

A train plan is trained by torch eager on the exported program (``model.pt2`` beside the ONNX
file, :func:`onnx_partition.export`), not by onnxruntime, and its backward differs per operator
(softmax, layer norm, embedding, attention) from any one factor of the forward. So:

1. **One run** of the program at the micro-batch shape (the ONNX graph's input shapes) on the
   device records every FX node's inputs (random values; integer inputs in ``[0, 2)``, valid as
   indices).
2. **Units.** Each ``call_function`` node is a unit (a ``getitem`` belongs to the op whose tuple
   it reads, as the partitioner's units do: :func:`onnx_partition.graph.fxtag.fx_unit`).
   Units are grouped by *signature* (target, every argument's shape, dtype, strides and whether
   it needs a gradient, the non-tensor arguments): one unit per signature is measured, so a
   transformer's repeated layers cost one layer's profiling.
3. **Timing.** Forward: the op on leaf copies of its inputs (gradients on where the run had
   them), autograd recording; backward: ``torch.autograd.grad`` of its outputs with ones, each
   the shortest of ``repeats`` runs after ``warmup`` (CUDA: synchronised), less what timing
   one op alone adds (a one-element add's forward and backward; at least 5% of the time is
   kept; on CPU at one thread in thread CPU time, :class:`_Timer`). Units with nothing to
   differentiate have backward 0. A unit that reads both weights
   (the program's parameters) and activations also has its backward timed as two passes,
   ``torch.autograd.grad`` with respect to the activations alone (the input gradient, what a
   zero-bubble schedule's ``I`` runs) and to the weights alone (``W``); its backward is split
   in their proportion (``backward_input_ms + backward_weight_ms = backward_ms``); a unit
   reading no weights is all input gradient, one reading only weights all weight gradient.
4. **Calibration.** The whole program's forward and its backward (from a loss that is the sum
   of its outputs) are timed apart, medians of ``repeats``; the units' forward times are scaled
   to sum to the whole forward and their backward times to the whole backward, which takes in
   what one op alone cannot show (allocation, autograd's bookkeeping, cache effects). On CPU
   two factors for a pipeline of processes on one machine go beside them (plan.json's
   ``compute_scale`` applies them): ``side_by_side`` (:mod:`.side_by_side`) and
   ``cold_cache``, the whole program from caches evicted before each pass, as a rank's are
   after its wait for a peer (:mod:`.cold_cache`; ``COLD_ROUNDS`` rounds at least for a short
   program).
5. **The engine.** The optimizer step (SGD and AdamW) on the program's parameters, and on CPU
   the hop and barrier between two processes over gloo (:func:`onnx_partition.cost.engine_price.
   measure_engine`): the costs file's ``engine``, which prices a train plan's per-step work and
   its hops (:func:`onnx_partition.cost.engine_price.price_engine`).

Measured with ``threads`` torch threads (``torch.set_num_threads``): what each training rank
uses. The costs file is keyed by ONNX node: a unit's times on its first ONNX node (in graph
order), the unit's other nodes 0, untagged FX nodes on the node that runs them (as
:mod:`onnx_partition.cost.saved` places their bytes); it records the executor
(``torch <version> eager``), ``mode: train`` and the provenance every costs file has
(fingerprint, input shapes, batch size, device: :mod:`onnx_partition.cost.costs_file`).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from statistics import median
from typing import TYPE_CHECKING, Any

from onnx_partition.cost.annotate import write_costs
from onnx_partition.cost.costs_file import provenance
from onnx_partition.cost.profile.cold_cache import measure_cold_cache
from onnx_partition.cost.profile.engine import measure_engine
from onnx_partition.cost.profile.side_by_side import measure_side_by_side
from onnx_partition.cost.saved import HALF_DTYPES, check_precision, program_inputs, unit_homes
from onnx_partition.errors import PartitionError
from onnx_partition.graph import OpGraph, load
from onnx_partition.settings.partition import TrainSpec
from onnx_partition.values import device_index

if TYPE_CHECKING:
    import torch
    from torch.export import ExportedProgram

__all__ = ["TrainProfile", "apply_fp32_math", "executor", "placed_program", "profile_train",
           "profile_train_to_file"]

Progress = Callable[[int, int], None]
#: Fewest rounds of the cold-cache factor for a program whose forward and backward take under
#: COLD_SHORT_MS (inception's ratio of two medians wandered by 0.1 over 5 rounds; a longer
#: program keeps ``repeats``: it is both steadier and less sensitive, gpt's 1.00-1.02).
COLD_ROUNDS = 20
COLD_SHORT_MS = 100.0


@dataclass(frozen=True)
class TrainProfile:
    """Calibrated per-node times (ONNX node key -> ms, every compute node) and how they were
    got."""

    forward_ms: dict[str, float]
    backward_ms: dict[str, float]
    backward_input_ms: dict[str, float]  # the input-gradient part of backward_ms
    whole_forward_ms: float
    whole_backward_ms: float
    raw_forward_ms: float  # sums of the units' times before calibration
    raw_backward_ms: float
    device: str
    executor: str
    unique_signatures: int
    reused: int
    settings: dict[str, object] = field(default_factory=dict)
    provenance: dict[str, object] = field(default_factory=dict)
    engine: dict[str, Any] = field(default_factory=dict)  # cost.profile.engine.measure_engine


def executor() -> str:
    """What runs a train plan: ``torch <version> eager``."""
    import torch

    return f"torch {torch.__version__} eager"


def profile_train(
    graph: OpGraph,
    program: str | Path | ExportedProgram,
    *,
    device: str = "cpu",
    repeats: int = 10,
    warmup: int = 2,
    threads: int = 1,
    progress: Progress | None = None,
    precision: str = TrainSpec().precision,
    engine: bool = True,
    split: Callable[[], float] | None = None,
    probe: Callable[[Mapping[str, Any]], Mapping[str, Any]] | None = None,
) -> TrainProfile:
    """Measure every FX unit of ``program`` in torch eager on ``device`` at ``graph``'s input
    shapes (the module docstring), under autocast to ``precision``'s half dtype unless fp32
    (as ``train --precision`` runs it: each op's casts timed with it), and, with ``engine``,
    the engine's own work (the optimizer steps on the fp32 master weights; on CPU the
    two-process hops and barrier; with ``split``, the engine's split backward per weight group;
    on CPU with ``probe``, the engine run on a small pipeline:
    :func:`~onnx_partition.cost.profile.engine.measure_engine`)."""
    import torch

    if repeats < 1 or warmup < 0 or threads < 1:
        raise PartitionError(f"need repeats >= 1, warmup >= 0, threads >= 1; got {repeats}, "
                             f"{warmup}, {threads}")
    index = device_index(device)
    if index is not None and not torch.cuda.is_available():
        raise PartitionError(f"device {device!r}: this torch has no CUDA device")
    target = torch.device("cpu" if index is None else f"cuda:{index}")
    if not isinstance(program, torch.export.ExportedProgram):
        from onnx_partition.graph.program import load_program  # weights beside the program

        program = load_program(program)
    program = placed_program(program, target)
    apply_fp32_math()  # TF32 off: a measured plan is priced (plan.json math) in IEEE fp32
    region = (contextlib.nullcontext() if check_precision(precision) == "fp32" else
              torch.autocast(target.type, dtype=getattr(torch, HALF_DTYPES[precision])))
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with region:
            timer = _Timer(target, repeats, warmup, threads)
            inputs, values = _record(program, graph, target)
            measured, unique, reused = _time_units(program, values, timer, progress)
            floor = _op_floor(target, timer)
            whole_fwd, whole_bwd, side, cold = _time_whole(program, inputs, target, timer,
                                                           threads)
        sig = program.graph_signature
        params = [program.state_dict[n].to(target) for n in sig.parameters
                  if n in program.state_dict]
        work = measure_engine(params, repeats=repeats, threads=threads,
                              hops=index is None, split=split, probe=probe) if engine else {}
    finally:
        torch.set_num_threads(before)
    fwd, bwd, grad_in, (raw_fwd, raw_bwd), (fscale, bscale) = _per_node(
        graph, program, measured, floor, whole_fwd, whole_bwd)
    name = "cpu" if index is None else f"cuda:{index}"
    settings: dict[str, object] = {
        "mode": "train", "repeats": repeats, "warmup": warmup, "threads": threads,
        "precision": precision, "math": "fp32" if precision == "fp32" else precision,
        "whole_forward_ms": whole_fwd, "whole_backward_ms": whole_bwd,
        "forward_scale": fscale, "backward_scale": bscale,
        "op_overhead_ms": {"forward": floor[0], "backward": floor[1]},
        **({"side_by_side": side} if side is not None else {}),
        **({"cold_cache": cold} if cold is not None else {}),
        "calibration": "shortest unit time scaled so forward and backward each sum to the "
                       "median whole-program forward and backward"}
    return TrainProfile({k: round(v, 6) for k, v in fwd.items()},
                        {k: round(v, 6) for k, v in bwd.items()},
                        {k: round(min(v, bwd[k]), 6) for k, v in grad_in.items()},
                        whole_fwd, whole_bwd,
                        raw_fwd, raw_bwd, name, executor(), unique, reused, settings,
                        provenance(graph, name), work)


def _op_floor(target: torch.device, timer: _Timer) -> tuple[float, float]:
    """What timing one op alone adds: a one-element add's forward and backward ms."""
    import operator as _op

    import torch

    return _time_op(_op.add, (torch.ones(1, device=target, requires_grad=True), 1.0),
                    {}, timer)[:2]


def _per_node(graph: OpGraph, program: ExportedProgram,
              measured: Mapping[str, tuple[float, float, float]], floor: tuple[float, float],
              whole_fwd: float, whole_bwd: float
              ) -> tuple[dict[str, float], dict[str, float], dict[str, float],
                         tuple[float, float], tuple[float, float]]:
    """Each ONNX node's forward, backward and input-gradient ms from the units' times: the
    floor taken off each unit (at least 5% kept), scaled so forward and backward each sum to
    the whole program's, each unit on its home node; with the units' raw sums and the two
    scales."""
    # what timing one op alone adds (a one-element add's forward and backward), off each unit
    shares = {n: share for n, (_, _, share) in measured.items()}
    units = {n: (max(f - floor[0], 0.05 * f), max(b - floor[1], 0.05 * b) if b > 0 else 0.0)
             for n, (f, b, _) in measured.items()}
    raw_fwd = sum(f for f, _ in units.values())
    raw_bwd = sum(b for _, b in units.values())
    fscale = whole_fwd / raw_fwd if raw_fwd > 0 else 1.0
    bscale = whole_bwd / raw_bwd if raw_bwd > 0 else 1.0
    homes = unit_homes(graph, program)
    keys = [graph.nodes[g].key for g in graph.compute_nodes]
    fwd = dict.fromkeys(keys, 0.0)
    bwd = dict.fromkeys(keys, 0.0)
    grad_in = dict.fromkeys(keys, 0.0)
    for name, (f, b) in units.items():
        home = graph.nodes[homes[name]].key if name in homes else None
        if home is None:
            continue
        fwd[home] += f * fscale
        bwd[home] += b * bscale
        grad_in[home] += b * bscale * shares[name]
    return fwd, bwd, grad_in, (raw_fwd, raw_bwd), (fscale, bscale)


def profile_train_to_file(
    model: str | Path,
    output: str | Path,
    *,
    device: str = "cpu",
    batch_size: int | None = None,
    input_shapes: Mapping[str, Sequence[int]] | None = None,
    repeats: int = 10,
    warmup: int = 2,
    threads: int = 1,
    progress: Progress | None = None,
    precision: str = TrainSpec().precision,
    split: Callable[[], float] | None = None,
    probe: Callable[[Mapping[str, Any]], Mapping[str, Any]] | None = None,
) -> TrainProfile:
    """:func:`profile_train` of the program beside ``model`` (``model.pt2``), written to
    ``output`` (atomically, never over the model), the ``precision`` it was measured in
    recorded (``partition`` warns when a plan is priced for another); ``split`` and ``probe``
    as there."""
    model = Path(model)
    program = model.with_suffix(".pt2")
    if not program.is_file():
        raise PartitionError(f"--mode train profiles the program {program}, which is missing: "
                             "export the model with `onnx-partition export` or "
                             "onnx_partition.export (they write it beside the ONNX file)")
    if Path(output).resolve() in (model.resolve(), program.resolve()):
        raise PartitionError(f"-o {output} would overwrite the model")
    graph = load(model, input_shapes=input_shapes, batch_size=batch_size)
    result = profile_train(graph, program, device=device, repeats=repeats, warmup=warmup,
                           threads=threads, progress=progress, precision=precision,
                           split=split, probe=probe)
    nodes = {k: {"forward_ms": result.forward_ms[k], "backward_ms": result.backward_ms[k],
                 "backward_input_ms": result.backward_input_ms[k],
                 "backward_weight_ms": round(result.backward_ms[k]
                                             - result.backward_input_ms[k], 6)}
             for k in result.forward_ms}
    write_costs(Path(output), nodes, device=result.device, source="profile --mode train",
                mode="train", executor=result.executor, precision=precision,
                whole_model_ms=round(result.whole_forward_ms + result.whole_backward_ms, 6),
                raw_sum_ms=round(result.raw_forward_ms + result.raw_backward_ms, 6),
                unique_signatures=result.unique_signatures, reused=result.reused,
                settings=result.settings, **result.provenance,
                **({"engine": result.engine} if result.engine else {}))
    return result


class _Timer:
    """Shortest (or median) time of a callable on one device: wall time synchronised on CUDA;
    on CPU with one torch thread the thread's CPU time (``time.thread_time``: all of the op's
    work runs on it, and other processes on a busy machine do not stretch it; a profile taken
    at load 9-16 timed hf-gpt2's whole forward at 2311 ms wall and 1080 ms CPU, and its run
    then computed in 0.46x the wall price)."""

    def __init__(self, device: torch.device, repeats: int, warmup: int,
                 threads: int = 1) -> None:
        import torch

        self.sync: Callable[[], None] = ((lambda: torch.cuda.synchronize(device))
                                         if device.type == "cuda" else (lambda: None))
        self.clock: Callable[[], float] = (time.thread_time if device.type == "cpu"
                                           and threads == 1 else time.perf_counter)
        self.repeats, self.warmup = repeats, warmup

    def times(self, prepare: Callable[[], Any], run: Callable[[Any], Any]) -> list[float]:
        """ms of ``run(prepare())`` per repeat (``prepare`` untimed)."""
        out = []
        for i in range(self.warmup + self.repeats):
            state = prepare()
            self.sync()
            start = self.clock()
            run(state)
            self.sync()
            if i >= self.warmup:
                out.append((self.clock() - start) * 1e3)
        return out


def placed_program(program: ExportedProgram, device: torch.device) -> ExportedProgram:
    """``program`` with every node that creates a tensor on a fixed device (the exporter writes
    ``device=cpu`` into ``arange``, ``full``, ``zeros``...) making it on ``device`` instead, as
    the engine's stage modules do (:mod:`onnx_partition.runtime.train.modules`): a copy when
    any node changes, ``program`` itself otherwise."""
    import copy

    import torch

    def fixed(node: torch.fx.Node) -> bool:
        there = node.kwargs.get("device")
        return isinstance(there, torch.device) and there != device

    if not any(fixed(n) for n in program.graph.nodes):
        return program
    program = copy.deepcopy(program)
    for node in program.graph.nodes:
        if fixed(node):
            node.kwargs = {**node.kwargs, "device": device}
    program.graph_module.recompile()
    return program


def apply_fp32_math() -> None:
    """torch's TF32 flags off (matrix products and convolutions in IEEE fp32), as the engine
    sets them for an fp32 plan (:func:`onnx_partition.runtime.train.math_mode.apply_math`)."""
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


def _program_args(program: ExportedProgram, inputs: Sequence[torch.Tensor],
                  device: torch.device) -> list[Any]:
    """The graph module's arguments: weights (parameters as leaves needing gradients) and the
    user inputs, in signature order."""
    from torch.export.graph_signature import InputKind

    user = iter(inputs)
    args: list[Any] = []
    for spec in program.graph_signature.input_specs:
        if spec.kind == InputKind.USER_INPUT:
            args.append(next(user))
            continue
        target = str(spec.target)
        persistent = spec.kind == InputKind.PARAMETER or (
            spec.kind == InputKind.BUFFER and spec.persistent is not False)
        value = program.state_dict[target] if persistent else program.constants[target]
        copy = value.detach().to(device)
        if spec.kind == InputKind.PARAMETER and copy.is_floating_point():
            copy.requires_grad_(True)
        args.append(copy)
    return args


def _record(program: ExportedProgram, graph: OpGraph, device: torch.device
            ) -> tuple[list[torch.Tensor], dict[str, Any]]:
    """Random user inputs and every node's value from one run of the program."""
    import torch
    import torch.fx

    shapes = [graph.input_shapes[n] for n in graph.inputs]
    generator = torch.Generator().manual_seed(0)
    inputs = [torch.randn(shape, generator=generator).to(dtype).to(device)
              if dtype.is_floating_point else
              torch.randint(0, 2, shape, generator=generator).to(dtype).to(device)
              for shape, dtype in program_inputs(program, shapes)]
    values: dict[str, Any] = {}

    class Recording(torch.fx.Interpreter):
        def run_node(self, n: torch.fx.Node) -> Any:
            result = super().run_node(n)
            values[n.name] = result
            return result

    Recording(program.graph_module).run(*_program_args(program, inputs, device))
    return inputs, values


def _signature(node: torch.fx.Node, args: Any, kwargs: Any) -> str:
    import torch

    def describe(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return ("T", tuple(value.shape), str(value.dtype), tuple(value.stride()),
                    value.requires_grad)
        if isinstance(value, list | tuple):
            return tuple(describe(v) for v in value)
        return repr(value)

    return repr((str(node.target), describe(args), describe(kwargs)))


def _time_units(program: ExportedProgram, values: dict[str, Any], timer: _Timer,
                progress: Progress | None
                ) -> tuple[dict[str, tuple[float, float, float]], int, int]:
    """(forward ms, backward ms, the input gradient's share of the backward) per unit (FX call
    node, getitems folded into their op), the signatures measured and the units that reused
    another's measurement."""
    import operator

    import torch
    import torch.fx
    from torch.export.graph_signature import InputKind

    nodes = [n for n in program.graph.nodes if n.op == "call_function"
             and n.target is not operator.getitem]
    params = {spec.arg.name for spec in program.graph_signature.input_specs
              if spec.kind == InputKind.PARAMETER and hasattr(spec.arg, "name")}
    weights = frozenset(id(values[n]) for n in params if n in values)
    measured: dict[str, tuple[float, float, float]] = {}
    out: dict[str, tuple[float, float, float]] = {}
    reused = 0
    for i, node in enumerate(nodes):
        args = torch.fx.node.map_arg(node.args, lambda a: values[a.name])
        kwargs = torch.fx.node.map_arg(node.kwargs, lambda a: values[a.name])
        reads = [a.name in params for a in node.all_input_nodes]
        key = _signature(node, args, kwargs) + repr(reads)
        if key in measured:
            reused += 1
        else:
            measured[key] = _time_op(node.target, args, kwargs, timer, weights)
        out[node.name] = measured[key]
        if progress is not None:
            progress(i + 1, len(nodes))
    return out, len(measured), reused


def _time_op(target: Any, args: Any, kwargs: Any, timer: _Timer,
             weights: frozenset[int] = frozenset()) -> tuple[float, float, float]:
    """Shortest forward and backward ms of one op on leaf copies of its inputs, and the share
    of the backward that is the input gradient (the arguments whose ``id`` is not in
    ``weights``): 1 without weights, 0 with only weights, else the two passes' times timed
    apart in proportion."""
    import torch
    from torch.utils._pytree import tree_flatten, tree_map

    def leaves() -> tuple[Any, Any, list[torch.Tensor]]:
        grads: list[torch.Tensor] = []

        def copy(value: Any) -> Any:
            if not isinstance(value, torch.Tensor):
                return value
            leaf = value.detach()
            if value.requires_grad:
                leaf.requires_grad_(True)
                grads.append(leaf)
                if id(value) in weights:
                    marked.add(id(leaf))
            return leaf

        marked.clear()
        return tree_map(copy, args), tree_map(copy, kwargs), grads

    marked: set[int] = set()

    def forward(state: tuple[Any, Any, list[torch.Tensor]]) -> Any:
        with torch.enable_grad():
            return target(*state[0], **state[1])

    try:
        fwd = min(timer.times(leaves, forward))
    except Exception:  # an op that cannot run alone (in place on a view): left to calibration
        return 0.0, 0.0, 1.0

    def prepared() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        state = leaves()
        result = forward(state)
        outputs = [t for t in tree_flatten(result)[0]
                   if isinstance(t, torch.Tensor) and t.requires_grad]
        return outputs, state[2]

    outputs, wrt = prepared()
    if not outputs or not wrt:
        return fwd, 0.0, 1.0
    is_weight = [id(t) in marked for t in wrt]

    def backward(state: tuple[list[torch.Tensor], list[torch.Tensor]], part: bool | None = None
                 ) -> None:
        outs, inputs = state
        if part is not None:  # only the weights' (True) or only the activations' gradients
            inputs = [t for t, w in zip(inputs, is_weight, strict=True) if w == part]
        torch.autograd.grad(outs, inputs, [torch.ones_like(o) for o in outs],
                            allow_unused=True)

    try:
        bwd = min(timer.times(prepared, backward))
        share = 0.0 if all(is_weight) else 1.0
        if any(is_weight) and not all(is_weight):
            grad_in = min(timer.times(prepared, lambda s: backward(s, False)))
            grad_w = min(timer.times(prepared, lambda s: backward(s, True)))
            share = grad_in / (grad_in + grad_w) if grad_in + grad_w > 0 else 0.5
    except Exception:  # no backward alone: left to calibration
        bwd, share = 0.0, 1.0
    return fwd, bwd, share


def _time_whole(program: ExportedProgram, inputs: Sequence[torch.Tensor],
                device: torch.device, timer: _Timer, threads: int = 1
                ) -> tuple[float, float, dict[str, Any] | None, dict[str, Any] | None]:
    """Median ms of the whole program's forward and of its backward (loss: sum of outputs),
    and on CPU how much slower both are beside a second training process
    (:func:`~onnx_partition.cost.profile.side_by_side.measure_side_by_side`) and from cold
    caches (:func:`~onnx_partition.cost.profile.cold_cache.measure_cold_cache`); None, None
    on CUDA."""
    import torch
    from torch.utils._pytree import tree_flatten

    args = _program_args(program, inputs, device)
    module = program.graph_module

    def forward(_: Any) -> Any:
        with torch.enable_grad():
            return module(*args)

    forward_times = timer.times(lambda: None, forward)

    def prepared() -> torch.Tensor:
        result = forward(None)
        outs = [t for t in tree_flatten(result)[0]
                if isinstance(t, torch.Tensor) and t.requires_grad]
        if not outs:
            raise PartitionError("the program's outputs need no gradient: nothing to train")
        return sum((o.float().sum() for o in outs), torch.zeros((), device=device))

    backward_times = timer.times(prepared, lambda loss: loss.backward())
    cold = None if device.type != "cpu" else measure_cold_cache(
        lambda: prepared(), lambda loss: loss.backward(),
        repeats=max(timer.repeats, COLD_ROUNDS) if median(forward_times) + median(
            backward_times) < COLD_SHORT_MS else timer.repeats, warmup=timer.warmup)
    for a in args:
        if isinstance(a, torch.Tensor):
            a.grad = None
    side = None if device.type != "cpu" else measure_side_by_side(
        program, args, repeats=timer.repeats, warmup=timer.warmup, threads=threads)
    return median(forward_times), median(backward_times), side, cold
