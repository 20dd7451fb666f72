"""One action of a training rank's schedule (the simulator's action list for its device,
:func:`onnx_partition.pipeline.schedules.build`), executed on its stage; the step loop around
them is :mod:`onnx_partition.runtime.train.rank`.

* ``kF m``: take micro-batch ``m``'s tensors (stage 0: read or make only its rows, a
  :class:`~onnx_partition.runtime.train.rows.StepRows`'s, or cut a whole batch; else receive
  them from the rank of stage ``k-1`` serving ``m``; the last stage reads its targets' rows
  alike, held until the backward frees the loss's graph); the floating tensors an earlier
  stage made become leaves that require grad; run the stage module; send the relay set on
  (last stage: the loss of the model outputs against the targets, times the micro-batch's
  weight: ``1/M``, or its share of the step's counted tokens for cross-entropy; see
  :mod:`onnx_partition.runtime.train.loss`). The inputs and outputs stay stashed, with their
  autograd graph, until ``kB m``.
* ``kB m``: receive the gradients of the floating tensors sent on (last stage: none, the loss
  is the root), ``torch.autograd.backward`` them (a relayed tensor is its own leaf, so its
  gradient passes straight through and adds to this stage's own use of it), and send the
  leaves' gradients back (zeros for a tensor this stage did not use).
* ``kI m`` (ZB-H1): as ``kB m``, but only the leaves' gradients are computed and sent back
  (:func:`passes.input_pass`); the graph stays stashed with the gradients that reached its
  weight branches.
* ``kW m``: the parameters' gradients of micro-batch ``m`` from those
  (:func:`passes.weight_pass`), added to ``.grad``; the stash is freed. A stage whose leaves
  need no gradient (the first) computes nothing in ``I`` and its whole backward in ``W``.

**Recomputation.** A stage with ``recompute`` in the plan runs its forward (and the loss)
without an autograd graph, stashing only its inputs and the RNG state, and builds the graph
again at the start of its ``B`` or ``I`` (:func:`passes.rebuild`; its time counts as backward).

A stage module or loss that raises ends the action with ``RankFailure("compute", ...)``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from onnx_partition.errors import one_line
from onnx_partition.pipeline.layout import Layout
from onnx_partition.pipeline.schedules import Action, Kind
from onnx_partition.runtime.launch.ranks import RankFailure
from onnx_partition.runtime.train import passes
from onnx_partition.runtime.train.comm import Tensors, TensorWire
from onnx_partition.runtime.train.loss import upcast
from onnx_partition.runtime.train.meters import Clock, SavedCounter, counting
from onnx_partition.runtime.train.optim import autocast
from onnx_partition.runtime.train.rank_io import LossFn, StageLike, microbatch

__all__ = ["ACTIONS", "RankState", "Stash", "StepState", "first_source", "forward"]


@dataclass
class Stash:
    """A micro-batch between its forward and its backward."""

    leaves: Tensors  # received tensors that require grad
    sent: Tensors  # tensors sent on (autograd graph kept), or {"": loss} on the last stage
    run: Callable[..., Tensors] | None = None  # recomputing: the forward, run again at B or I
    rng: passes.RngState | None = None  # recomputing: the RNG state the forward started from
    later: passes.WeightPass | None = None  # after kI m: what kW m needs


@dataclass(frozen=True)
class RankState:
    """What this rank keeps through training: its stage, its place and its wire."""

    lay: Layout
    k: int  # the stage served
    stage: StageLike
    module: torch.nn.Module
    loss_fn: LossFn
    wire: TensorWire
    device: torch.device
    count: int  # micro-batches per step
    model_inputs: set[str]
    model_outputs: list[str]
    clock: Clock
    bf16: bool = False  # autocast the stage module to bfloat16
    saved: SavedCounter | None = None  # counts what the first step's forwards save
    recompute: bool = False  # keep only the inputs; run the forward again at B or I
    params: list[torch.nn.Parameter] = field(default_factory=list)  # for the split backward

    @property
    def last(self) -> bool:
        return self.k == self.lay.stages - 1


@dataclass
class StepState:
    """One step's state on this rank: its batch, the stashed micro-batches and the sums."""

    inputs: Mapping[str, torch.Tensor]
    targets: Mapping[str, torch.Tensor]
    stash: dict[int, Stash] = field(default_factory=dict)
    fwd: float = 0.0  # seconds of forward compute (with the loss), read at the step's end
    bwd: float = 0.0  # seconds of backward compute
    loss_sum: torch.Tensor | float = 0.0  # on the device until the step ends (no host sync)
    weights: list[float] = field(default_factory=list)  # last stage: each micro-batch's share


def forward(me: RankState, st: StepState, action: Action) -> None:
    """``kF m``: take micro-batch ``m``'s tensors, run the stage (and on the last stage the
    loss), send the relay set on and stash what the backward needs (a recomputing stage: its
    inputs and RNG state, the graph built again at its ``B`` or ``I``)."""
    lay, k, m, count, device = me.lay, me.k, action.microbatch, me.count, me.device
    if k == 0:  # only the micro-batch's rows are read (a StepRows) or cut; its own tensors
        # (a slice of a whole batch would keep that batch's storage, and autograd's saved inputs
        # would count it)
        env = {n: v.to(device) if device.type != "cpu" else v.clone() for n, v in
               microbatch(st.inputs, m, count, lay.recv_names[0]).items()}
    else:
        env = me.wire.recv(lay.rank_of(k - 1, m), m, lay.recv_names[k])
    leaves = {}
    for n in list(env):
        if env[n].is_floating_point() and n not in me.model_inputs:
            env[n] = leaves[n] = env[n].detach().requires_grad_()
    want = ({n: v.to(device) for n, v in microbatch(st.targets, m, count).items()}
            if me.last and st.targets else {})
    weight = st.weights[m] if me.last else 1.0

    def run(saved: SavedCounter | None = None) -> Tensors:
        """The stage on ``env``: what it sends on, or ``{"": loss}`` on the last stage;
        ``saved`` counts what the stage module and the loss after it save (once per
        micro-batch: a recomputing stage's rebuild, whose activations live one backward at a
        time)."""
        with counting(saved):
            with autocast(device, me.bf16):
                outs = me.module(*[env[n] for n in me.stage.inputs])
            if isinstance(outs, torch.Tensor):
                outs = (outs,)
            if me.bf16:  # hops and the loss in fp32 (the wire has no bfloat16; lossless upcast)
                outs = upcast(outs)
            made = {**env, **dict(zip(me.stage.outputs, outs, strict=True))}
            if me.last:
                return {"": me.loss_fn({n: made[n] for n in me.model_outputs}, want) * weight}
        return {n: made[n] for n in lay.send_names[k]}

    t0 = me.clock.start()
    rng = None
    try:
        if me.recompute:  # its forward saves nothing; the rebuild's activations are counted
            sent, rng = passes.kept_forward(run, device)
        else:
            sent = run(me.saved)
    except Exception as exc:
        raise RankFailure("compute", f"{action}: {one_line(exc)}") from exc
    me.clock.stop(0, t0)
    if me.last:
        st.loss_sum = st.loss_sum + sent[""].detach()
    else:
        me.wire.send(lay.rank_of(k + 1, m), m, lay.send_names[k], sent)
    st.stash[m] = Stash(leaves, sent, run if me.recompute else None, rng)


def _roots(me: RankState, st: StepState, action: Action,
           held: Stash) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
    """A backward's start: the graph built again on a recomputing stage, the gradients of what
    was sent on received (last stage: none, the loss is the root); the roots that require
    grad and their gradients."""
    lay, k, m = me.lay, me.k, action.microbatch
    if held.run is not None and held.rng is not None:
        run = held.run
        t0 = me.clock.start()
        try:
            held.sent = passes.rebuild(lambda: run(me.saved), me.module, held.rng)
        except Exception as exc:
            raise RankFailure("compute", f"{action}: {one_line(exc)}") from exc
        me.clock.stop(1, t0)
        held.run = held.rng = None
    if me.last:
        loss = held.sent[""]
        return ([loss], [None]) if loss.requires_grad else ([], [])
    names = _grad_names(held.sent, lay.send_names[k], me.model_inputs)
    got = me.wire.recv_like(lay.rank_of(k + 1, m), names, held.sent)
    pairs = [(held.sent[n], got[n]) for n in names if held.sent[n].requires_grad]
    return [t for t, _ in pairs], [g for _, g in pairs]


def _send_back(me: RankState, action: Action, held: Stash,
               grads: Mapping[str, torch.Tensor | None]) -> None:
    """Send the leaves' gradients to the stage below (zeros for a tensor this stage did not
    use)."""
    if me.k > 0:
        lay, k, m = me.lay, me.k, action.microbatch
        names = _grad_names(held.leaves, lay.recv_names[k], me.model_inputs)
        back = {n: g if (g := grads.get(n)) is not None else torch.zeros_like(held.leaves[n])
                for n in names}
        me.wire.send(lay.rank_of(k - 1, m), m, names, back, header=False)


def _backward(me: RankState, st: StepState, action: Action) -> None:
    """``kB m``: receive the gradients of what was sent on, backpropagate them and send the
    leaves' gradients back."""
    held = st.stash.pop(action.microbatch)
    roots, grads = _roots(me, st, action, held)
    t0 = me.clock.start()
    try:
        if roots:
            torch.autograd.backward(roots, grads)
    except Exception as exc:
        raise RankFailure("compute", f"{action}: {one_line(exc)}") from exc
    me.clock.stop(1, t0)
    _send_back(me, action, held, {n: t.grad for n, t in held.leaves.items()})


def _input(me: RankState, st: StepState, action: Action) -> None:
    """``kI m``: receive the gradients of what was sent on, compute the leaves' gradients alone
    (:func:`passes.input_pass`) and send them back; the graph stays stashed for ``kW m``."""
    held = st.stash[action.microbatch]
    roots, grads = _roots(me, st, action, held)
    names = list(held.leaves)
    t0 = me.clock.start()
    try:
        got, held.later = passes.input_pass(roots, grads, [held.leaves[n] for n in names],
                                            me.params)
    except Exception as exc:
        raise RankFailure("compute", f"{action}: {one_line(exc)}") from exc
    me.clock.stop(1, t0)
    held.sent = {}  # what only the input gradients needed is freed with the roots
    del roots, grads
    _send_back(me, action, held, dict(zip(names, got, strict=True)))
    held.leaves = {}  # consumed: what W needs of them its graph keeps


def _weight(me: RankState, st: StepState, action: Action) -> None:
    """``kW m``: the parameters' gradients of micro-batch ``m`` (:func:`passes.weight_pass`),
    added to ``.grad``; the micro-batch's graph is freed."""
    held = st.stash.pop(action.microbatch)
    if held.later is None:
        raise RankFailure("compute", f"{action}: no input-gradient pass before it")
    t0 = me.clock.start()
    try:
        passes.weight_pass(held.later)
    except Exception as exc:
        raise RankFailure("compute", f"{action}: {one_line(exc)}") from exc
    me.clock.stop(1, t0)


ACTIONS: dict[Kind, Callable[[RankState, StepState, Action], None]] = {
    Kind.F: forward, Kind.B: _backward, Kind.I: _input, Kind.W: _weight}


def first_source(me: RankState, action: Action) -> int | None:
    """The rank ``action`` first receives from (None: it receives nothing)."""
    if action.kind is Kind.F:
        return me.lay.rank_of(me.k - 1, action.microbatch) if me.k > 0 else None
    return None if me.last or action.kind is Kind.W else me.lay.rank_of(me.k + 1, action.microbatch)


def _grad_names(tensors: Mapping[str, torch.Tensor], names: Sequence[str],
                model_inputs: set[str]) -> list[str]:
    """The names whose gradients cross this hop: floating tensors that a stage made (both
    ends see the same dtypes, so both derive the same list)."""
    return [n for n in names
            if n in tensors and tensors[n].is_floating_point() and n not in model_inputs]
