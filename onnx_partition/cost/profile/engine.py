"""The training engine's own work measured (``profile --mode train``, into the costs file's
``engine``; priced by :mod:`onnx_partition.cost.engine_price`): the optimizer step (``sgd`` and
``adamw``, as ``train`` makes them) on the program's parameters with gradients, median of
repeats; a gradient's accumulation; a tiny all-reduce between two processes (the barrier); and a
ping-pong of a header and a payload between two processes at a few sizes
(:data:`~onnx_partition.cost.engine_price.HOP_SIZES`)."""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import socket
import time
from collections.abc import Callable, Mapping, Sequence
from statistics import median
from typing import TYPE_CHECKING, Any

from onnx_partition.cost.engine_price import BYTES_PER_PARAMETER, HOP_SIZES, fit_link
from onnx_partition.errors import PartitionError

if TYPE_CHECKING:
    import torch

__all__ = ["measure_engine", "measure_hops", "time_accumulate", "time_optimizer"]


def time_accumulate(params: Sequence[torch.Tensor], *, repeats: int = 5,
                    warmup: int = 2) -> float:
    """Median ms of adding a gradient to each of ``params``' gradients in place (what autograd
    does for every micro-batch's backward but the first)."""
    import torch

    grads = [torch.randn_like(p.detach().float()) for p in params if p.is_floating_point()]
    more = [torch.randn_like(g) for g in grads]
    times = []
    for i in range(warmup + repeats):
        began = time.perf_counter()
        for g, h in zip(grads, more, strict=True):
            g.add_(h)
        if grads and grads[0].is_cuda:
            torch.cuda.synchronize(grads[0].device)
        if i >= warmup:
            times.append((time.perf_counter() - began) * 1000.0)
    return float(median(times)) if times else 0.0


def time_optimizer(params: Sequence[torch.Tensor], optimizer: str, *, repeats: int = 5,
                   warmup: int = 2) -> float:
    """Median ms of one ``optimizer`` step (``train``'s: ``torch.optim.SGD`` or ``AdamW`` with
    their defaults) and its ``zero_grad`` over copies of ``params`` with random gradients."""
    import torch

    copies = [torch.nn.Parameter(p.detach().clone().float()) for p in params
              if p.is_floating_point()]
    if not copies:
        return 0.0
    for p in copies:
        p.grad = torch.randn_like(p)
    opt: torch.optim.Optimizer
    if optimizer == "sgd":
        opt = torch.optim.SGD(copies, lr=1e-3)
    elif optimizer == "adamw":
        opt = torch.optim.AdamW(copies, lr=1e-3)
    else:
        raise PartitionError(f"unknown optimizer {optimizer!r}; choose one of "
                             f"{', '.join(BYTES_PER_PARAMETER)}")
    times = []
    for i in range(warmup + repeats):
        began = time.perf_counter()
        opt.step()
        if copies[0].is_cuda:
            torch.cuda.synchronize(copies[0].device)
        elapsed = (time.perf_counter() - began) * 1000.0
        if i >= warmup:
            times.append(elapsed)
    return float(median(times))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _hop_rank(rank: int, port: int, sizes: Sequence[int], repeats: int, threads: int,
              out: Any) -> None:
    """One side of :func:`measure_hops` (a spawned process): rank 0 sends a header and a
    payload of each size and waits for them back; rank 1 echoes. Rank 0 puts the one-way ms
    per size (half the median round trip) and the barrier ms on ``out``."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        peer = 1 - rank
        head = torch.zeros(16, dtype=torch.int64)
        result = []
        for size in sizes:
            payload = torch.zeros(max(1, size // 4), dtype=torch.float32)
            trips = []
            for i in range(repeats + 2):
                dist.barrier()
                began = time.perf_counter()
                for leg in range(2):  # there and back
                    if (rank == 0) == (leg == 0):
                        dist.send(head, peer)
                        dist.send(payload.clone(), peer)
                    else:
                        dist.recv(head, peer)
                        dist.recv(payload, peer)
                if i >= 2:
                    trips.append((time.perf_counter() - began) * 1000.0)
            result.append(median(trips) / 2.0)
        flag = torch.zeros(1, dtype=torch.float64)
        barriers = []
        for i in range(repeats + 2):
            began = time.perf_counter()
            dist.all_reduce(flag)
            if i >= 2:
                barriers.append((time.perf_counter() - began) * 1000.0)
        if rank == 0:
            out.put((result, float(median(barriers))))
    finally:
        dist.destroy_process_group()


def measure_hops(sizes: Sequence[int] = HOP_SIZES, *, repeats: int = 10,
                 threads: int = 1) -> tuple[list[float], float]:
    """(one-way ms per payload size, barrier ms) between two spawned processes over gloo on
    loopback, with ``threads`` torch threads each (a training rank's); what each hop and each
    step's barriers cost ``train`` on one machine."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_hop_rank, args=(r, port, list(sizes), repeats, threads, out),
                         daemon=True) for r in range(2)]
    for proc in procs:
        proc.start()
    try:
        deadline = time.monotonic() + 120.0
        while True:
            try:
                one_way, barrier = out.get(timeout=1.0)
                break
            except queue.Empty:
                if time.monotonic() > deadline or not all(p.is_alive() for p in procs):
                    raise PartitionError("measuring the hops between two processes failed: "
                                         "a process ended without its figures") from None
    finally:
        for proc in procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
    return [float(x) for x in one_way], float(barrier)


def measure_engine(params: Sequence[torch.Tensor], *, repeats: int = 5,
                   threads: int = 1, hops: bool = True,
                   split: Callable[[], float] | None = None,
                   probe: Callable[[Mapping[str, Any]], Mapping[str, Any]] | None = None
                   ) -> dict[str, Any]:
    """The costs file's ``engine``: ``parameter_bytes``, ``optimizer_ms`` (each optimizer's
    step on ``params``), ``accumulate_ms`` (their gradients' accumulation), with ``hops``
    the two-process ``link`` (the ``sizes`` and their ``one_way_ms``, summarised as
    ``latency_ms`` and ``bandwidth_gbps`` by :func:`fit_link`) and ``barrier_ms``, with
    ``split`` (the engine's timer, ms per weight group: ``runtime.train.passes.
    split_call_ms``, given by the caller above this layer) ``split_call_ms``, and with ``hops``
    and ``probe`` (the engine run on a small pipeline: ``runtime.train.probe.probe_engine``,
    given likewise, called with the ``link`` just measured) ``probe``: its ``action_ms``,
    ``barrier_ms`` and ``hop_ms`` (what the engine costs per action, per barrier and per hop
    beyond that link's, measured while both cores compute) and how they were measured."""
    body: dict[str, Any] = {
        "parameter_bytes": int(sum(p.numel() * 4 for p in params if p.is_floating_point())),
        "optimizer_ms": {name: round(time_optimizer(params, name, repeats=repeats), 6)
                         for name in BYTES_PER_PARAMETER},
        "accumulate_ms": round(time_accumulate(params, repeats=repeats), 6),
        "optimizer": "torch.optim SGD/AdamW defaults, median step over the program's "
                     "parameters with random gradients",
    }
    if hops:
        one_way, barrier = measure_hops(repeats=max(repeats, 15), threads=threads)
        latency, bandwidth = fit_link(HOP_SIZES, one_way)
        body.update(link={"latency_ms": round(latency, 6), "bandwidth_gbps": round(bandwidth, 4),
                          "sizes": list(HOP_SIZES), "one_way_ms": [round(x, 6) for x in one_way],
                          "source": "gloo ping-pong between two processes, header + payload"},
                    barrier_ms=round(barrier, 6))
    if split is not None:
        body["split_call_ms"] = round(max(float(split()), 0.0), 6)
    if hops and probe is not None:
        body["probe"] = dict(probe(body["link"]))
    return body
