"""A stage's backward split in two passes (ZB-H1's ``I`` and ``W``) and its recomputation.

**The split** (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024, section 2). A stage's
autograd graph runs from its roots (the tensors it sent on, or the loss) down to its leaves:
the received tensors that require grad, whose gradients the stage below waits for, and the
parameters, whose gradients only the optimizer step needs. :func:`input_pass` computes the
leaves' gradients alone (``torch.autograd.grad`` with respect to the leaves, which runs only the
nodes on a path from a root to a leaf, and in each of them only the outputs those paths need:
a linear layer computes ``dX``, not ``dW``). Before it runs, a pre-hook is put on each *frontier*
node: a node on the input path from which a path that leaves it reaches a parameter; the hook
keeps the gradient that reached the node. :func:`weight_pass` later starts ``torch.autograd.
backward`` from those nodes with those gradients, towards the parameters, adding to their
``.grad``: no node of the input path is run twice. The parameters are grouped by the frontier nodes
they hang from (union-find), one call per group, so a call never runs a node of the input path on
its way to its own parameters unless that node is in its group too; there a second pre-hook puts
back the gradient the node had in the input pass (the whole of it: the part arriving through the
group's other nodes is already in it), so nothing is counted twice. One call over all the groups
would be as exact but not cheaper: from an upper group's frontier node the engine would run the
whole input path down to the lower groups' frontier nodes again (measured on gpt small's middle
stage: the weight pass then costs a whole backward, 70 ms against 42). The cost the split adds is
kept off the input pass where it can be: the grouping runs in the weight pass (``W`` fills the
pipeline's bubbles, ``I`` is on its critical path), the parameters' accumulators are found in the
graph walk the input pass makes anyway (not by a view per parameter), and each call accumulates
into ``.grad`` in place (``torch.autograd.backward`` with ``inputs``, as the whole backward does;
entered past its argument checks, :func:`_accumulate`) instead of adding a returned gradient into a
new tensor. The walk is made for every micro-batch: the graph is built anew by every forward, and a
key telling that two graphs have the same shape would need the same walk.
Roots that reach no leaf (a stage with no received floating tensor, such as the first, or an
output made from parameters alone) have no input pass: :func:`weight_pass` runs their whole
backward. torch's pipelining (``stage_backward_input``/``stage_backward_weight``) splits the
same way; it leaves out such roots' parameters.

The graph is kept from the input pass to the weight pass (``retain_graph``) and freed when the
:class:`WeightPass` is dropped; what only the input path needed is freed once its roots are.

**Recomputation** (activation checkpointing at stage granularity, Chen et al. 2016):
:func:`kept_forward` runs the stage's forward under ``torch.no_grad`` (autograd saves nothing;
the stage keeps only its inputs and the RNG state) and :func:`rebuild` runs it again
with gradients at the start of the stage's ``B`` or ``I``, under the saved RNG state (dropout
draws the same masks), on copies of the module's buffers (batch norm's running statistics move
once per micro-batch, not twice). One rebuild serves both halves of a split backward.
``torch.utils.checkpoint`` (non-reentrant) recomputes inside each backward call instead, so
an ``I`` and the ``W`` calls after it would each run the forward again.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge

__all__ = ["RngState", "WeightPass", "input_pass", "kept_forward", "rebuild", "split_call_ms",
           "weight_pass"]

Grads = tuple[torch.Tensor | None, ...]


@dataclass
class _Group:
    """Parameters whose gradients hang from the same frontier nodes."""

    params: list[torch.Tensor]
    nodes: list[Node]


@dataclass
class WeightPass:
    """What an input pass leaves for its weight pass (:func:`weight_pass`): each parameter with
    the frontier nodes it hangs from (grouped in the weight pass, off the input pass's critical
    path), and the gradient each frontier node got in the input pass."""

    hung: list[tuple[torch.Tensor, list[Node]]]
    kept: dict[Node, Grads | None]
    roots: list[torch.Tensor]  # roots reaching no leaf: their whole backward runs in W
    root_grads: list[torch.Tensor | None]


def _node(t: torch.Tensor) -> Node:
    return get_gradient_edge(t).node


def _graph(roots: Sequence[Node]) -> dict[Node, list[Node]]:
    """Every node reachable from ``roots``, with its parents (the nodes feeding it gradient)."""
    parents: dict[Node, list[Node]] = {r: [] for r in roots}
    todo = deque(roots)
    while todo:
        node = todo.popleft()
        for child, _ in node.next_functions:
            if child is None:
                continue
            if child not in parents:
                parents[child] = []
                todo.append(child)
            parents[child].append(node)
    return parents


def _above(starts: Sequence[Node], parents: dict[Node, list[Node]],
           stop: set[Node] | frozenset[Node] = frozenset()) -> tuple[set[Node], list[Node]]:
    """The nodes from which one of ``starts`` is reachable (walking parents), not walking
    past the nodes of ``stop``; and the ``stop`` nodes met, in the order met."""
    seen, met = set(starts), []
    todo = deque(starts)
    while todo:
        for parent in parents.get(todo.popleft(), ()):
            if parent in stop:
                if parent not in met:
                    met.append(parent)
            elif parent not in seen:
                seen.add(parent)
                todo.append(parent)
    return seen, met


def _hung(params: Sequence[torch.Tensor], parents: dict[Node, list[Node]],
          path: set[Node]) -> list[tuple[torch.Tensor, list[Node]]]:
    """Each parameter used by this graph from the input path, with the frontier nodes it hangs
    from (the nodes of ``path`` its off-path subgraph is entered from)."""
    accumulators = {id(n.variable): n for n in parents
                    if not n.next_functions and hasattr(n, "variable")}
    hung = []
    for p in params:
        node = accumulators.get(id(p))
        if node is None:  # a view of it, only where the walk did not find its accumulator
            node = _node(p)
        if node not in parents:
            continue  # not used by this micro-batch's graph
        _, met = _above([node], parents, path)
        if met:  # else reached only from roots off the input path
            hung.append((p, met))
    return hung


def _groups(hung: Sequence[tuple[torch.Tensor, list[Node]]]) -> list[_Group]:
    """Group the parameters by the frontier nodes they hang from (union-find over nodes)."""
    owner: dict[Node, int] = {}  # frontier node -> group id
    link: list[int] = []

    def find(i: int) -> int:
        while link[i] != i:
            link[i] = link[link[i]]
            i = link[i]
        return i

    for _, met in hung:
        gid = len(link)
        link.append(gid)
        for n in met:
            if n in owner:
                link[find(owner[n])] = gid
            owner[n] = gid
    merged: dict[int, _Group] = {}
    for p, met in hung:
        group = merged.setdefault(find(owner[met[0]]), _Group([], []))
        group.params.append(p)
        group.nodes.extend(n for n in met if n not in group.nodes)
    return list(merged.values())


def input_pass(roots: Sequence[torch.Tensor], grads: Sequence[torch.Tensor | None],
               leaves: Sequence[torch.Tensor], params: Sequence[torch.Tensor]
               ) -> tuple[list[torch.Tensor | None], WeightPass]:
    """The gradients of ``leaves`` (None where unused) from ``roots`` seeded with ``grads``
    (None: ones, for a scalar loss), and what the weight pass of ``params`` needs. No
    parameter's ``.grad`` changes."""
    params = [p for p in params if p.requires_grad]
    if not leaves:  # nothing to send back: all in W, no graph walk
        return [], WeightPass([], {}, list(roots), list(grads))
    root_nodes = [_node(r) for r in roots]
    parents = _graph(root_nodes)
    leaf_nodes = [n for n in (_node(t) for t in leaves) if n in parents]
    path, _ = _above(leaf_nodes, parents)
    on = [i for i, n in enumerate(root_nodes) if n in path]
    off = [i for i in range(len(roots)) if i not in on]
    hung = _hung(params, parents, path)
    kept: dict[Node, Grads | None] = {n: None for _, met in hung for n in met}
    later = WeightPass(hung, kept, [roots[i] for i in off], [grads[i] for i in off])
    if not on:
        return [None] * len(leaves), later
    handles = [node.register_prehook(_keeper(kept, node)) for node in kept]
    try:
        got = torch.autograd.grad([roots[i] for i in on], list(leaves),
                                  [grads[i] for i in on], retain_graph=True, allow_unused=True)
    finally:
        for handle in handles:
            handle.remove()
    return list(got), later


def _keeper(store: dict[Node, Grads | None], node: Node) -> Callable[[Grads], None]:
    def keep(grad_outputs: Grads) -> None:
        store[node] = grad_outputs
    return keep


def weight_pass(held: WeightPass) -> None:
    """Add the parameters' gradients that ``held``'s input pass left out to their ``.grad``:
    one ``torch.autograd.backward`` per group, accumulating in place (``inputs``: the group's
    parameters) as the whole backward does."""
    for group in _groups(held.hung):
        edges: list[GradientEdge] = []
        seeds: list[torch.Tensor] = []
        for node in group.nodes:
            for i, g in enumerate(held.kept[node] or ()):
                if g is not None:
                    edges.append(GradientEdge(node, i))
                    seeds.append(g)
        if not edges:
            continue
        handles = []
        if len(group.nodes) > 1:  # a node reached through another one keeps its whole gradient
            for node in group.nodes:
                got = held.kept[node]
                if got is not None:
                    handles.append(node.register_prehook(_putter(got)))
        try:
            _accumulate(edges, seeds, group.params)
        finally:
            for handle in handles:
                handle.remove()
    if held.roots:  # the graph's last use: each node's saved tensors freed as it runs, as
        # in a whole backward (kept, a first stage's W held them all to its end: +14% there)
        torch.autograd.backward(held.roots, held.root_grads)
    held.hung.clear()
    held.kept.clear()
    held.roots.clear()
    held.root_grads.clear()


def split_call_ms(*, layers: int = 4, width: int = 32, rows: int = 4, repeats: int = 20,
                  device: str = "cpu") -> float:
    """What the split adds per weight group on this machine: ``(I + W - B) / groups``, medians
    of ``repeats``, on a stage of ``layers`` blocks (linear, GELU, layer norm; ``width``
    features, ``rows`` rows; two groups each) fed a received tensor, as a rank runs it; small
    enough that the walk and the calls are all there is (``cost.engine_price.split_ms``)."""
    from statistics import median
    from time import perf_counter

    blocks: list[torch.nn.Module] = []
    for _ in range(layers):
        blocks += [torch.nn.Linear(width, width), torch.nn.GELU(), torch.nn.LayerNorm(width)]
    stage = torch.nn.Sequential(*blocks).to(device)
    params = list(stage.parameters())
    seed = torch.randn(rows, width, device=device)
    whole, split = [], []
    for _ in range(repeats + 2):
        x = seed.clone().requires_grad_()
        out = stage(x)
        began = perf_counter()
        torch.autograd.backward([out], [torch.ones_like(out)])
        whole.append(perf_counter() - began)
        x = seed.clone().requires_grad_()
        out = stage(x)
        began = perf_counter()
        _, later = input_pass([out], [torch.ones_like(out)], [x], params)
        weight_pass(later)
        split.append(perf_counter() - began)
    extra = median(split[2:]) - median(whole[2:])
    return max(extra, 0.0) * 1000.0 / (2 * layers)


def _accumulate(edges: Sequence[GradientEdge], seeds: Sequence[torch.Tensor],
                params: Sequence[torch.Tensor]) -> None:
    """``torch.autograd.backward(edges, seeds, retain_graph=True, inputs=params)`` without its
    Python-side checks of the seeds against the edges (``_make_grads``: a third of a small
    stage's weight pass, measured on gpt tiny): the seeds are the gradients autograd itself
    gave those edges in the input pass. Through torch's engine entry
    (``torch.autograd.graph._engine_run_backward``, which ``backward`` calls) where this torch
    has it, else ``backward`` itself."""
    if _ENGINE is None:
        torch.autograd.backward(list(edges), list(seeds), retain_graph=True, inputs=list(params))
        return
    _ENGINE(tuple(edges), tuple(seeds), True, False, tuple(params), allow_unreachable=True,
            accumulate_grad=True)


_ENGINE: Callable[..., Any] | None = getattr(torch.autograd.graph, "_engine_run_backward", None)


def _putter(grads: Grads) -> Callable[[Grads], Grads]:
    def put(_: Grads) -> Grads:
        return grads
    return put


@dataclass(frozen=True)
class RngState:
    """The RNG state a forward started from (CPU, and the CUDA device's)."""

    cpu: torch.Tensor
    cuda: torch.Tensor | None
    device: torch.device


def kept_forward(run: Callable[[], Any], device: torch.device) -> tuple[Any, RngState]:
    """``run()`` (the stage, and the loss on the last stage) without an autograd graph, and
    the RNG state it started from, for :func:`rebuild`."""
    rng = RngState(torch.get_rng_state(),
                   torch.cuda.get_rng_state(device) if device.type == "cuda" else None, device)
    with torch.no_grad():
        return run(), rng


def rebuild(run: Callable[[], Any], module: torch.nn.Module, rng: RngState) -> Any:
    """``run()`` again with gradients, drawing what :func:`kept_forward` drew (the RNG state
    outside is left as it was) and leaving ``module``'s buffers as they were before."""
    owners = [(m, n, b) for m in module.modules() for n, b in m._buffers.items() if b is not None]
    for m, n, b in owners:  # the rebuild moves copies (its graph may keep them), not the buffers
        m._buffers[n] = b.detach().clone()
    cuda = [rng.device.index or 0] if rng.cuda is not None else []
    try:
        with torch.random.fork_rng(devices=cuda):
            torch.set_rng_state(rng.cpu)
            if rng.cuda is not None:
                torch.cuda.set_rng_state(rng.cuda, rng.device)
            with torch.enable_grad():
                return run()
    finally:
        for m, n, b in owners:
            m._buffers[n] = b
