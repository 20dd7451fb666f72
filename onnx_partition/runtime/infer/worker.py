"""One rank of a distributed inference run.

**Layout** (:mod:`onnx_partition.pipeline.layout`). Ranks follow the plan: stage 0's replicas
first, then stage 1's, and so on (replicas consecutive). Micro-batch ``m`` goes to replica
``m % d_k`` of stage ``k`` (as in the threaded runtime), so every send and receive is known in
advance: stage ``k`` replica ``m % d_k`` sends micro-batch ``m`` to stage ``k+1`` replica
``m % d_{k+1}``. Rank 0 (stage 0, replica 0) is also the driver: it splits the feeds, sends
stage 0's other replicas their micro-batches, and receives the graph outputs from the last
stage's ranks, merging them in order.

**Relay.** Like the threaded runtime, each stage forwards every tensor that a later stage or the
graph outputs still need (:func:`~onnx_partition.pipeline.layout.needed_after`): a skip
connection, or a graph input read only by the last stage, travels hop by hop (the cost model's
relay model). The names each hop carries are fixed by the plan
(:class:`~onnx_partition.pipeline.layout.Layout`), so they never go over the wire.

**Wire protocol**: :mod:`onnx_partition.runtime.wire` (a fixed int64 header, small tensors
packed, large ones sent zero-copy).

**Shapes once per hop.** Rank 0 broadcasts each micro-batch's rows at set-up; a plan with no
data-dependent tensor size (``unknown_size_tensors`` 0) sends each hop's header once per row
count, others once per micro-batch (later iterations send none): :func:`hop_key`.

**Backend.** gloo unless asked for nccl (``backend="nccl"``, every replica on a distinct
``cuda:N``): no GPU has run this path yet, and its payloads are copied host -> device -> host
around each hop since onnxruntime hands back host arrays (``DistStats.copies`` counts them).
gloo stays the default for inference until a GPU run confirms nccl. Process-group set-up and
every operation time out after ``timeout_s``.

**Hop** (``RankConfig.hop``). ``host`` (the default): numpy arrays from onnxruntime onto the wire
(:class:`~onnx_partition.runtime.wire.Wire`). ``device``: torch tensors on the rank's device
from the wire through onnxruntime (IOBinding, DLPack) and back
(:class:`~onnx_partition.runtime.infer.hop.DeviceHop`); on CUDA it needs nccl, and it is the
path meant for GPUs once a GPU run confirms it.

**Hook.** ``RankConfig.hook`` (:mod:`onnx_partition.runtime.launch.hooks`), when set, is called
before each micro-batch's compute: the tests' faults (a rank that exits or stops) use it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import torch
import torch.distributed as dist

from onnx_partition.errors import PartitionError, one_line
from onnx_partition.fileio import sha256_file
from onnx_partition.graph.ort import (
    local_device,
    open_session,
    provider_name,
    providers_for,
    session_options,
)
from onnx_partition.pipeline import microbatch
from onnx_partition.pipeline.layout import Layout
from onnx_partition.plan import PLAN_FILE, Plan
from onnx_partition.runtime.infer.hop import HOPS, DeviceHop
from onnx_partition.runtime.infer.resident import ResidentPeak
from onnx_partition.runtime.launch.hooks import RankHook
from onnx_partition.runtime.launch.ranks import RankFailure, join_group
from onnx_partition.runtime.wire import Env, Wire

__all__ = ["PROGRESS_KEY", "DistStats", "RankBar", "RankConfig", "check_feeds", "check_hop",
           "choose_backend", "format_stats", "hop_key", "on_device", "serve_rank"]


def on_device(lay: Layout, device: str | None) -> Layout:
    """``lay`` with every replica on ``device`` (``run --device cpu``), or as planned (None)."""
    if device is None:
        return lay
    return replace(lay, devices=[[device] * len(d) for d in lay.devices])


def choose_backend(lay: Layout, backend: str | None, *, one_machine: bool = False,
                   auto_nccl: bool = True) -> str:
    """gloo, or nccl when every replica is on its own CUDA device (``backend`` overrides).
    ``one_machine``: every rank runs here, so devices of different machines (``m0/cuda:0``,
    ``m1/cuda:0``) share the local one and rule nccl out. ``auto_nccl=False`` (inference):
    gloo unless nccl is asked for, until a GPU run confirms the nccl path."""
    flat = [d for stage in lay.devices for d in stage]
    names = [local_device(d) for d in flat] if one_machine else flat
    cuda = (all(local_device(d).startswith("cuda") for d in flat)
            and len(set(names)) == len(names))
    if backend is None:
        usable = (auto_nccl and cuda and dist.is_nccl_available()
                  and torch.cuda.is_available())
        return "nccl" if usable else "gloo"
    if backend not in ("gloo", "nccl"):
        raise PartitionError(f"unknown backend {backend!r} (use gloo or nccl)")
    if backend == "nccl" and not cuda:
        raise PartitionError("backend nccl needs every replica on its own cuda:N device")
    return backend


def check_hop(lay: Layout, backend: str, hop: str) -> None:
    """A PartitionError unless ``hop`` is one of :data:`~onnx_partition.runtime.infer.hop.HOPS`
    and the device hop's tensors can travel: CUDA tensors need nccl (gloo would copy them)."""
    if hop not in HOPS:
        raise PartitionError(f"unknown hop {hop!r} (use {' or '.join(HOPS)})")
    cuda = any(local_device(d).startswith("cuda") for stage in lay.devices for d in stage)
    if hop == "device" and cuda and backend != "nccl":
        raise PartitionError("the device hop of a CUDA plan needs backend nccl (or device cpu)")


@dataclass
class DistStats:
    """Measurements of a distributed run (per-rank figures cover all iterations)."""

    backend: str
    world_size: int
    microbatches: int
    rows: int  # samples per iteration
    iteration_ms: list[float]  # rank 0: sending the first micro-batch to receiving the last
    setup_ms: float  # slowest rank: worker start to process group ready
    placement: list[tuple[int, int, str]]  # per rank: (stage, replica, device)
    busy_ms: dict[int, float] = field(default_factory=dict)  # per rank: onnxruntime compute
    comm_ms: dict[int, float] = field(default_factory=dict)  # per rank: blocked in recv / sends
    # per rank: onnxruntime compute in each iteration (busy_ms split by iteration)
    busy_each_ms: dict[int, list[float]] = field(default_factory=dict)
    cpu_each_ms: dict[int, list[float]] = field(default_factory=dict)  # the same, thread CPU time
    wall_ms: dict[int, float] = field(default_factory=dict)  # per rank: its serving loop
    headers: dict[int, int] = field(default_factory=dict)  # per rank: wire headers it sent
    copies: dict[int, dict[str, int]] = field(default_factory=dict)  # per rank: Wire.copies
    launch_ms: float = 0.0  # run_distributed: spawn to results back (imports, set-up, run)
    # per rank: what its stage made resident, and its peak resident set (runtime.infer.resident)
    memory_bytes: dict[int, int | None] = field(default_factory=dict)
    resident_bytes: dict[int, int | None] = field(default_factory=dict)

    def throughput_per_s(self) -> list[float]:
        """Samples per second of each iteration."""
        return [self.rows / (ms / 1000.0) if ms > 0 else 0.0 for ms in self.iteration_ms]

    def idle_ms(self) -> dict[int, float]:
        return {r: max(0.0, self.wall_ms[r] - b) for r, b in self.busy_ms.items()}


def _plan_digest(plan_dir: Path) -> int:
    return int(sha256_file(plan_dir / PLAN_FILE)[:14], 16)


def check_feeds(plan: Plan, feeds: Mapping[str, np.ndarray], microbatches: int) -> None:
    """A PartitionError unless ``feeds`` hold every graph input and split into ``microbatches``."""
    missing = [s.name for s in plan.inputs if s.name not in feeds]
    if missing:
        raise PartitionError(f"missing input {missing[0]!r}; inputs: "
                             f"{[s.name for s in plan.inputs]}")
    try:
        microbatch.split(dict(feeds), microbatches, microbatch.batch_axes(plan))
    except ValueError as exc:
        raise PartitionError(str(exc)) from None


def format_stats(stats: DistStats) -> str:
    """A few lines of figures (steady state: the first iteration is left out when there are
    several)."""
    steady = stats.iteration_ms[1:] or stats.iteration_ms
    ms = sum(steady) / len(steady)
    lines = [f"{stats.world_size} ranks ({stats.backend}), batch {stats.rows} in "
             f"{stats.microbatches} micro-batches: {stats.rows / ms * 1000.0:.1f} samples/s "
             f"({ms:.2f} ms per batch; set-up {stats.setup_ms:.0f} ms)"]
    n = len(stats.iteration_ms)
    for rank, (k, r, device) in enumerate(stats.placement):
        lines.append(f"  rank {rank} stage {k} replica {r} ({device}): busy "
                     f"{stats.busy_ms[rank] / n:.2f} ms, comm {stats.comm_ms[rank] / n:.2f} ms, "
                     f"idle {stats.idle_ms()[rank] / n:.2f} ms per batch")
    return "\n".join(lines)


@dataclass(frozen=True)
class RankConfig:
    """What every rank of one run shares: the plan, its layout and the run's settings."""

    plan_dir: Path
    plan: Plan
    lay: Layout
    backend: str
    microbatches: int
    iterations: int
    threads: int  # onnxruntime intra-op threads
    timeout_s: float  # process-group set-up and every operation
    hook: RankHook | None = None  # called as hook(rank, "compute") before each micro-batch
    hop: str = "host"  # "host" (Wire, numpy) or "device" (DeviceHop, torch tensors)
    # rank 0 calls progress(done, total) with every rank's finished iterations (RankBar)
    progress: Callable[[int, int], None] | None = None


class RankBar:
    """The progress of a ``run --nproc``, drawn by rank 0 (:func:`onnx_partition.progress.
    progress_callback`: on a terminal, unless ``enabled`` is false): every rank adds its
    finished iterations to a counter in the run's store, rank 0 shows the sum over all ranks.
    Picklable, so it travels to the rank processes; the bar is made in rank 0."""

    def __init__(self, label: str = "run (all ranks)", *, enabled: bool = True) -> None:
        self.label, self.enabled = label, enabled
        self._bar: Callable[[int, int], None] | None = None

    def __call__(self, done: int, total: int) -> None:
        if self._bar is None:
            from onnx_partition.progress import progress_callback

            self._bar = progress_callback(self.label, enabled=self.enabled)
        self._bar(done, total)

    def __getstate__(self) -> dict[str, Any]:
        return {"label": self.label, "enabled": self.enabled, "_bar": None}


@dataclass
class _Tally:
    """One rank's running figures: onnxruntime time (wall and thread CPU), per iteration."""

    busy: float = 0.0
    cpu: float = 0.0
    iteration_ms: list[float] = field(default_factory=list)
    busy_each: list[float] = field(default_factory=list)
    cpu_each: list[float] = field(default_factory=list)


def serve_rank(
    config: RankConfig,
    rank: int,
    feeds: Mapping[str, np.ndarray] | None,
    store: dist.Store | None,
) -> tuple[Env, DistStats] | None:
    """Run one rank (``store``: the launcher's, else torchrun's ``env://``); rank 0 returns
    the merged outputs and the stats."""
    started = time.perf_counter()
    memory = ResidentPeak.start()  # before the session: what the stage makes resident
    lay = config.lay
    session, comm, batches = _open(config, rank, feeds)
    join_group(config.backend, rank, lay.world_size, config.timeout_s, store)
    # Rank 0 tells everyone the micro-batch count; all check they read the same plan.json.
    control = torch.tensor([len(batches), config.iterations, _plan_digest(config.plan_dir)],
                           dtype=torch.int64)
    wired = control.to(comm)
    dist.broadcast(wired, src=0)
    count, iterations, digest = (int(v) for v in wired.cpu())
    if digest != _plan_digest(config.plan_dir):
        raise RankFailure("setup", "its plan.json differs from rank 0's")
    fixed = microbatch.batch_axes(config.plan)
    sizes = torch.tensor([microbatch.batch_size(b, fixed) for b in batches] if rank == 0
                         else [0] * count, dtype=torch.int64).to(comm)
    dist.broadcast(sizes, src=0)
    keys = [hop_key(config.plan, m, int(n)) for m, n in enumerate(sizes.cpu())]
    ready = time.perf_counter()

    wire: Wire | DeviceHop
    if config.hop == "device":
        wire = DeviceHop(session, comm, lay.name)
        batches = [wire.to_device(b) for b in batches]  # type: ignore[misc]
    else:
        wire = Wire(comm, lay.name)
    tally = _Tally()
    results: dict[int, Env] = {}
    report = _reporter(config, rank, store, iterations * lay.world_size)
    for _ in range(iterations):
        began, busy_before, cpu_before = time.perf_counter(), tally.busy, tally.cpu
        results = _iterate(config, rank, session, wire, batches, keys, tally)
        tally.iteration_ms.append((time.perf_counter() - began) * 1000.0)
        tally.busy_each.append((tally.busy - busy_before) * 1000.0)
        tally.cpu_each.append((tally.cpu - cpu_before) * 1000.0)
        report(1)
    done = time.perf_counter()
    grown, resident = memory.reading()

    mine = {"rank": rank, "busy": tally.busy, "comm": wire.comm_s, "wall": done - ready,
            "setup": ready - started, "busy_each": tally.busy_each, "cpu_each": tally.cpu_each,
            "headers": wire.headers_sent, "copies": dict(wire.copies), "memory": grown,
            "resident": resident}
    gathered: list[Any] = [None] * lay.world_size if rank == 0 else []
    dist.gather_object(mine, gathered if rank == 0 else None, dst=0)
    dist.destroy_process_group()
    report(0)  # rank 0, after the gather: every rank has finished and counted
    if rank != 0:
        return None
    fixed = microbatch.batch_axes(config.plan)
    outputs = microbatch.merge([results[m] for m in range(count)], fixed)
    rows = microbatch.batch_size(feeds, fixed) if feeds is not None else 0
    return outputs, _stats(config, count, rows, tally.iteration_ms, gathered)


def hop_key(plan: Plan, m: int, rows: int) -> tuple[str, int]:
    """What fixes the shapes of micro-batch ``m``'s tensors on every hop (the wire sends a hop's
    header once per key): its ``rows`` when the plan has no data-dependent tensor size
    (plan.json ``unknown_size_tensors`` 0), else the micro-batch itself (the same feeds every
    iteration)."""
    static = plan.unknown_size_tensors == 0
    return ("rows", rows) if static else ("microbatch", m)


#: The store's counter of iterations finished, over all ranks of a run.
PROGRESS_KEY = "onnx-partition/iterations-done"


def _reporter(config: RankConfig, rank: int, store: dist.Store | None,
              total: int) -> Callable[[int], None]:
    """``report(n)``: add ``n`` finished iterations to the run's counter (every rank) and, in
    rank 0, show the counter on ``config.progress``. A no-op without a bar or a store
    (torchrun's ``env://`` store is not handed to the ranks)."""
    progress = config.progress
    if progress is None or store is None:
        return lambda n: None

    def report(n: int) -> None:
        done = int(store.add(PROGRESS_KEY, n))
        if rank == 0:
            progress(min(done, total), total)

    return report


def _open(
    config: RankConfig, rank: int, feeds: Mapping[str, np.ndarray] | None,
) -> tuple[ort.InferenceSession, torch.device, list[Env]]:
    """The rank's stage session, the device its payloads travel through, and (rank 0) the
    micro-batches; a ``setup`` failure if any of them cannot be made."""
    k, r = config.lay.place(rank)
    device = config.lay.devices[k][r]
    try:
        comm = torch.device("cpu")
        if config.backend == "nccl":
            comm = torch.device("cuda", int(local_device(device).partition(":")[2] or 0))
            torch.cuda.set_device(comm)
        providers = providers_for(device)
        if config.hop == "device" and comm.type == "cuda":  # onnxruntime on torch's stream
            first = providers[0]
            options = dict(first[1]) if isinstance(first, tuple) else {}
            options["user_compute_stream"] = str(torch.cuda.current_stream(comm).cuda_stream)
            providers[0] = (provider_name(first), options)
        session = open_session(str(config.plan_dir / config.plan.stages[k].file),
                               session_options(config.threads), providers,
                               f"{config.plan.stages[k].file} on {device}")
        fixed = microbatch.batch_axes(config.plan)
        batches = (microbatch.split(dict(feeds), config.microbatches, fixed)
                   if feeds is not None else [])
    except Exception as exc:  # onnxruntime raises its own types
        raise RankFailure("setup", f"cannot start: {one_line(exc)}") from exc
    return session, comm, batches


def _iterate(
    config: RankConfig, rank: int, session: ort.InferenceSession, wire: Wire | DeviceHop,
    batches: list[Any], keys: list[tuple[str, int]], tally: _Tally,
) -> dict[int, Env]:
    """One iteration of the rank: its micro-batches in, through the stage, on to the next
    stage; rank 0 also feeds stage 0's other replicas and returns the last stage's outputs by
    micro-batch (others: the outputs they kept, none unless they are rank 0)."""
    lay, count = config.lay, len(keys)
    k, r = lay.place(rank)
    stage, last = config.plan.stages[k], k + 1 == lay.stages
    pending: list[Any] = []
    results: dict[int, Any] = {}
    if rank == 0:
        for m in range(count):
            if lay.rank_of(0, m) != 0:
                wire.send(lay.rank_of(0, m), m, lay.recv_names[0], batches[m], pending,
                          keys[m])
    for m in range(r, count, lay.replicas[k]):
        if rank == 0:
            env = {n: batches[m][n] for n in lay.recv_names[0]}
        else:
            src = 0 if k == 0 else lay.rank_of(k - 1, m)
            env = wire.recv(src, m, lay.recv_names[k], keys[m])
        if config.hook is not None:
            config.hook(rank, "compute")
        t0, c0 = time.perf_counter(), time.thread_time()
        try:
            feeds = {n: env[n] for n in stage.inputs}
            values = (wire.run(stage.outputs, feeds) if isinstance(wire, DeviceHop)
                      else session.run(stage.outputs, feeds))
        except Exception as exc:  # onnxruntime raises its own types
            raise RankFailure("compute", one_line(exc)) from exc
        tally.busy += time.perf_counter() - t0
        tally.cpu += time.thread_time() - c0
        env.update(zip(stage.outputs, values))
        dst = 0 if last else lay.rank_of(k + 1, m)
        if dst == rank:
            results[m] = {n: env[n] for n in lay.send_names[k]}
        else:
            wire.send(dst, m, lay.send_names[k], env, pending, keys[m])
    if rank == 0:
        for m in range(count):
            if m not in results:
                results[m] = wire.recv(lay.rank_of(lay.stages - 1, m), m, lay.send_names[-1],
                                       keys[m])
    wire.wait(pending)
    if isinstance(wire, DeviceHop):
        return {m: wire.to_host(env) for m, env in results.items()}
    return results


def _stats(config: RankConfig, count: int, rows: int, iteration_ms: list[float],
           gathered: list[Any]) -> DistStats:
    """Rank 0's figures from every rank's gathered tally."""
    lay = config.lay
    return DistStats(
        backend=config.backend, world_size=lay.world_size, microbatches=count, rows=rows,
        iteration_ms=iteration_ms, setup_ms=max(g["setup"] for g in gathered) * 1000.0,
        placement=[(*lay.place(q), lay.devices[lay.place(q)[0]][lay.place(q)[1]])
                   for q in range(lay.world_size)],
        busy_ms={g["rank"]: g["busy"] * 1000.0 for g in gathered},
        busy_each_ms={g["rank"]: g["busy_each"] for g in gathered},
        cpu_each_ms={g["rank"]: g["cpu_each"] for g in gathered},
        comm_ms={g["rank"]: g["comm"] * 1000.0 for g in gathered},
        wall_ms={g["rank"]: g["wall"] * 1000.0 for g in gathered},
        headers={g["rank"]: g["headers"] for g in gathered},
        copies={g["rank"]: g["copies"] for g in gathered},
        memory_bytes={g["rank"]: g["memory"] for g in gathered},
        resident_bytes={g["rank"]: g["resident"] for g in gathered},
    )
