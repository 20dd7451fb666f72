"""The training engine's split backward (ZB-H1's input- and weight-gradient passes) and its
recomputation (:mod:`onnx_partition.runtime.train.passes`), against torch's whole backward on
small stages with the graph shapes a stage can have: a chain, a skip, a parameter used on and
off the input path, one used twice along it (one use below the other), an output made from
parameters alone, a received tensor relayed as it is, and a stage that received nothing
needing a gradient."""

from __future__ import annotations

import torch
from support.training import saved_bytes
from torch import nn

from onnx_partition.runtime.memtrack import StorageTracker
from onnx_partition.runtime.train.passes import input_pass, kept_forward, rebuild, weight_pass


class Stage(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin1 = nn.Linear(4, 4)
        self.norm = nn.LayerNorm(4)
        self.lin2 = nn.Linear(4, 4)
        self.w = nn.Parameter(torch.randn(4, 4))  # read twice: on the input path and off it
        self.pos = nn.Parameter(torch.randn(4))  # an output made from parameters alone
        self.bn = nn.BatchNorm1d(4)
        self.drop = nn.Dropout(0.5)

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, ...]:
        h = torch.relu(self.lin1(a)) @ self.w
        h = self.drop(self.bn(self.norm(h + b)))  # b skips lin1
        # lin2 twice: its weight hangs from two nodes of the input path, one below the other
        return self.lin2(self.lin2(h)) + a, torch.tanh(self.pos @ self.w.T).expand(a.shape[0], 4)


def _inputs(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    a, b, ga, gb = (torch.randn(5, 4, generator=gen) for _ in range(4))
    return a, b, ga, gb


def _whole(stage: Stage, a: torch.Tensor, b: torch.Tensor, seeds: list[torch.Tensor],
           relay: bool) -> tuple[list[torch.Tensor | None], dict[str, torch.Tensor]]:
    """torch's whole backward: the leaves' and the parameters' gradients."""
    torch.manual_seed(7)
    stage.zero_grad(set_to_none=True)
    leaves = [a.clone().requires_grad_(), b.clone().requires_grad_()]
    outs = list(stage(*leaves)) + ([leaves[1]] if relay else [])
    torch.autograd.backward(outs, seeds)
    return [t.grad for t in leaves], {n: p.grad.clone() for n, p in stage.named_parameters()}


def test_input_then_weight_pass_equals_the_whole_backward() -> None:
    torch.manual_seed(0)
    stage = Stage().train()
    for relay in (False, True):  # with a received tensor sent on as it is (its own root)
        a, b, ga, gb = _inputs(1)
        seeds = [ga, gb] + ([torch.ones(5, 4)] if relay else [])
        want_leaves, want = _whole(stage, a, b, seeds, relay)
        torch.manual_seed(7)
        stage.zero_grad(set_to_none=True)
        leaves = [a.clone().requires_grad_(), b.clone().requires_grad_()]
        outs = list(stage(*leaves)) + ([leaves[1]] if relay else [])
        got_leaves, later = input_pass(outs, seeds, leaves, list(stage.parameters()))
        assert all(p.grad is None for p in stage.parameters())  # no weight gradient yet
        assert len(later.roots) == 1  # the output made from parameters alone
        for got, w in zip(got_leaves, want_leaves, strict=True):
            torch.testing.assert_close(got, w, rtol=1e-6, atol=1e-7)
        del outs
        weight_pass(later)
        for n, p in stage.named_parameters():
            torch.testing.assert_close(p.grad, want[n], rtol=1e-6, atol=1e-7, msg=n)


def test_weight_pass_accumulates_over_micro_batches() -> None:
    """Two micro-batches' I then W (W's in the other order): the sum of both whole backwards."""
    torch.manual_seed(0)
    stage = Stage().eval()  # no dropout: each micro-batch's whole backward run apart
    parts = [_whole(stage, *_inputs(s)[:2], list(_inputs(s)[2:]), False)[1] for s in (1, 2)]
    stage.zero_grad(set_to_none=True)
    held = []
    for s in (1, 2):
        a, b, ga, gb = _inputs(s)
        leaves = [a.requires_grad_(), b.requires_grad_()]
        held.append(input_pass(list(stage(*leaves)), [ga, gb], leaves,
                               list(stage.parameters()))[1])
    weight_pass(held[1])
    first = {n: p.grad for n, p in stage.named_parameters()}
    weight_pass(held[0])
    for n, p in stage.named_parameters():
        torch.testing.assert_close(p.grad, parts[0][n] + parts[1][n], rtol=1e-6, atol=1e-7)
        assert p.grad is first[n], n  # added in place, as the whole backward adds


def test_a_stage_without_gradient_leaves_does_all_in_the_weight_pass() -> None:
    """The first stage: its inputs are the model's (no gradient); its I computes nothing."""
    torch.manual_seed(0)
    stage = Stage().eval()
    a, b, ga, gb = _inputs(3)
    torch.autograd.backward(list(stage(a, b)), [ga, gb])
    want = {n: p.grad.clone() for n, p in stage.named_parameters()}
    stage.zero_grad(set_to_none=True)
    got, later = input_pass(list(stage(a, b)), [ga, gb], [], list(stage.parameters()))
    assert got == [] and not later.hung and len(later.roots) == 2
    assert all(p.grad is None for p in stage.parameters())
    weight_pass(later)
    for n, p in stage.named_parameters():
        torch.testing.assert_close(p.grad, want[n], rtol=0, atol=0)



def test_recompute_keeps_no_activation_and_rebuilds_the_same_gradients() -> None:
    """A recomputing stage's forward saves nothing for backward (its kept inputs only); the
    rebuild at backward time draws the same dropout masks, gives the same gradients, leaves
    the RNG stream and batch norm's running statistics as one forward does, and serves a
    split backward."""
    torch.manual_seed(0)
    stage = Stage().train()
    a, b, ga, gb = _inputs(4)
    leaves = [a.requires_grad_(), b.requires_grad_()]

    def run() -> tuple[torch.Tensor, ...]:
        return stage(*leaves)

    torch.manual_seed(7)
    kept, outs = saved_bytes(run)
    after_one = torch.rand(1)
    assert kept >= 4 * 5 * 4 * 4  # several activations of 5 x 4 floats
    torch.autograd.backward(list(outs), [ga, gb])
    want = [t.grad.clone() for t in leaves], {n: p.grad.clone() for n, p in
                                              stage.named_parameters()}
    stage.zero_grad(set_to_none=True)
    for t in leaves:
        t.grad = None
    before = stage.bn.running_mean.clone()

    torch.manual_seed(7)
    saved, (cheap, rng) = saved_bytes(lambda: kept_forward(run, torch.device("cpu")))
    assert saved == 0 and not cheap[0].requires_grad
    assert torch.equal(torch.rand(1), after_one)  # the forward drew what a normal one draws
    moved = stage.bn.running_mean.clone()
    assert not torch.equal(moved, before)
    state = torch.get_rng_state()
    outs = rebuild(run, stage, rng)
    assert torch.equal(torch.get_rng_state(), state)  # the rebuild's draws are not the stream's
    assert torch.equal(stage.bn.running_mean, moved)  # moved once, by the forward
    for o, c in zip(outs, cheap, strict=True):
        assert torch.equal(o, c)  # the same masks
    got_leaves, later = input_pass(list(outs), [ga, gb], leaves, list(stage.parameters()))
    weight_pass(later)
    for got, w in zip(got_leaves, want[0], strict=True):
        torch.testing.assert_close(got, w, rtol=1e-6, atol=1e-7)
    for n, p in stage.named_parameters():
        torch.testing.assert_close(p.grad, want[1][n], rtol=1e-6, atol=1e-7, msg=n)


def test_a_weight_pass_with_no_input_pass_holds_what_the_whole_backward_holds() -> None:
    """A first stage (no received tensor) runs its whole backward in W: its peak of live
    storages is the whole backward's, saved tensors freed as their nodes run (issue 33)."""
    torch.manual_seed(0)
    # the widest gradients at the first block: the later blocks' saved tensors are freed by then
    stage = nn.Sequential(nn.Linear(64, 1024), nn.GELU(), nn.Linear(1024, 64),
                          *(m for _ in range(3) for m in (nn.Linear(64, 256), nn.GELU(),
                                                           nn.Linear(256, 64))), nn.Linear(64, 1))
    x = torch.randn(32, 64)

    def peak(split: bool) -> int:
        with StorageTracker() as tracker:  # the forward's saved tensors counted too
            out = stage(x)
            seed = torch.ones_like(out)
            if split:
                _, later = input_pass([out], [seed], [], list(stage.parameters()))
                weight_pass(later)
            else:
                torch.autograd.backward([out], [seed])
        stage.zero_grad(set_to_none=True)
        return tracker.peak

    assert peak(split=True) == peak(split=False)
