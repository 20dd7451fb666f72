"""Run a plan folder as a multi-process pipeline over ``torch.distributed``: one rank per replica.

**Layout.** Ranks follow the plan: stage 0's replicas first, then stage 1's, and so on (replicas
consecutive). Micro-batch ``m`` goes to replica ``m % d_k`` of stage ``k`` (as in the threaded
runtime), so every send and receive is known in advance: stage ``k`` replica ``m % d_k`` sends
micro-batch ``m`` to stage ``k+1`` replica ``m % d_{k+1}``. Rank 0 (stage 0, replica 0) is also
the driver: it splits the feeds, sends stage 0's other replicas their micro-batches, and receives
the graph outputs from the last stage's ranks, merging them in order.

**Relay.** Like the threaded runtime's ``_keep``, each stage forwards every tensor that a later
stage or the graph outputs still need: a skip connection, or a graph input read only by the last
stage, travels hop by hop (the cost model's relay model). The names each hop carries are fixed by
the plan (:class:`Layout`), so they never go over the wire.

**Wire protocol**: :mod:`onnx_partition.runtime.wire` (a fixed int64 header, small tensors
packed, large ones sent zero-copy).

**Backend.** gloo on CPU; nccl when every replica is on a distinct ``cuda:N`` (payloads are then
copied host -> device -> host around each hop, since onnxruntime hands back host arrays).

**One machine.** :func:`run_distributed` starts the workers from a fork server that has imported
torch and onnxruntime once (or with ``spawn``); the parent hosts the rendezvous store on
``master_addr`` (loopback by default, and gloo then binds loopback too).

**Faults.** Process-group set-up and every operation time out after ``timeout_s``. Under
:func:`run_distributed` the parent polls its children: a worker that raises reports its message
and exits, one that dies is seen by its exit code; the parent then kills the others and raises
:class:`StageFailed` naming the stage, replica and rank (0.2-0.4 s in the tests, no timeout
involved). A cause (a stage that raised, a rank that died) is named before the communication
errors it provokes in its peers.

**Several machines** (the plan folder copied to each; devices name local devices)::

    torchrun --nnodes 2 --node-rank R --nproc-per-node N --master-addr HOST --master-port 29500 \\
        -m onnx_partition.runtime.distributed PLAN --iterations 10

``--nproc-per-node`` times ``--nnodes`` must equal the plan's replicas in total (set
``GLOO_SOCKET_IFNAME`` if gloo picks the wrong network interface). A single machine:
``torchrun --nproc-per-node N -m onnx_partition.runtime.distributed PLAN``. Rank 0 prints the
figures; ``--output-dir`` saves the outputs as ``.npy``. A failing rank exits non-zero and
torchrun stops the others.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import itertools
import os
import re
import signal
import socket
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from onnx_partition.errors import PartitionError
from onnx_partition.measured import plan_microbatches
from onnx_partition.plan import PLAN_FILE, Plan, read_plan
from onnx_partition.runtime import microbatch
from onnx_partition.runtime.lifeline import Heartbeats, die_with, guard_fork_server
from onnx_partition.runtime.pipeline import StageFailed
from onnx_partition.runtime.stages import (
    check_devices,
    local_device,
    providers_for,
    session_options,
    verify_plan_folder,
)
from onnx_partition.runtime.wire import Env, Wire, one_line

EXIT_RANK_ENV = "ONNX_PARTITION_DIST_EXIT_RANK"  # test hook: that rank os._exit(1)s mid-run
DEVICE_ENV = "ONNX_PARTITION_DEVICE"  # "cpu": every rank on CPU, whatever the plan says
STOP_RANK_ENV = "ONNX_PARTITION_DIST_STOP_RANK"  # test hook: that rank SIGSTOPs itself mid-run
#: A rank whose heartbeat is older than this (or than the timeout, if shorter) has stopped.
SILENT_S = 10.0
# imported once by the fork server, before it forks the workers
PRELOAD = ["numpy", "onnxruntime", "torch", "torch.distributed",
           "onnx_partition.runtime.distributed"]
GRACE_S = 0.5  # after the first failure, how long the parent gathers reports before choosing one
guard_fork_server()  # preloaded by the fork server: it dies with the process that started it


@dataclass(frozen=True)
class Layout:
    """Where each stage replica runs and which tensors every hop carries."""

    replicas: list[int]  # per stage
    first: list[int]  # first rank of each stage
    devices: list[list[str]]  # per stage, per replica
    recv_names: list[list[str]]  # tensors stage k's replicas receive (stage 0: from rank 0)
    send_names: list[list[str]]  # tensors stage k sends on (the last stage: outputs to rank 0)

    @property
    def world_size(self) -> int:
        return sum(self.replicas)

    @property
    def stages(self) -> int:
        return len(self.replicas)

    def place(self, rank: int) -> tuple[int, int]:
        """(stage, replica) of ``rank``."""
        for k in reversed(range(self.stages)):
            if rank >= self.first[k]:
                return k, rank - self.first[k]
        raise ValueError(f"rank {rank} is not in the layout")

    def rank_of(self, stage: int, m: int) -> int:
        """The rank serving micro-batch ``m`` at ``stage``."""
        return self.first[stage] + m % self.replicas[stage]

    def name(self, rank: int) -> str:
        k, r = self.place(rank)
        return f"stage {k} replica {r} (rank {rank}, {self.devices[k][r]})"


def layout(plan: Plan) -> Layout:
    """The rank layout and relay sets of ``plan``; a PartitionError if a stage reads a tensor
    that no earlier stage or graph input makes."""
    replicas = [max(1, s.replicas) for s in plan.stages]
    first = list(itertools.accumulate([0, *replicas]))[:-1]
    devices = [[(s.devices or ["cpu"])[r % len(s.devices or ["cpu"])] for r in range(d)]
               for s, d in zip(plan.stages, replicas)]
    outputs = {o.name for o in plan.outputs}
    avail = {i.name for i in plan.inputs}
    recv, send = [], []
    for k, stage in enumerate(plan.stages):
        keep = {n for s in plan.stages[k + 1:] for n in s.inputs} | outputs
        missing = [n for n in stage.inputs if n not in avail]
        if missing:
            raise PartitionError(f"plan.json: stage {k} reads {missing[0]!r}, which no earlier "
                                 f"stage or graph input makes")
        recv.append(sorted(avail & (set(stage.inputs) | keep)))
        avail |= set(stage.outputs)
        send.append(sorted(avail & keep))
    lost = sorted(outputs - avail)
    if lost:
        raise PartitionError(f"plan.json: no stage makes the graph output {lost[0]!r}")
    return Layout(replicas, first, devices, recv, send)


def choose_backend(lay: Layout, backend: str | None, *, one_machine: bool = False) -> str:
    """gloo, or nccl when every replica is on its own CUDA device (``backend`` overrides).
    ``one_machine``: every rank runs here, so devices of different machines (``m0/cuda:0``,
    ``m1/cuda:0``) share the local one and rule nccl out."""
    flat = [d for stage in lay.devices for d in stage]
    names = [local_device(d) for d in flat] if one_machine else flat
    cuda = (all(local_device(d).startswith("cuda") for d in flat)
            and len(set(names)) == len(names))
    if backend is None:
        usable = cuda and dist.is_nccl_available() and torch.cuda.is_available()
        return "nccl" if usable else "gloo"
    if backend not in ("gloo", "nccl"):
        raise PartitionError(f"unknown backend {backend!r} (use gloo or nccl)")
    if backend == "nccl" and not cuda:
        raise PartitionError("backend nccl needs every replica on its own cuda:N device")
    return backend


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
    launch_ms: float = 0.0  # run_distributed: spawn to results back (imports, set-up, run)

    def throughput_per_s(self) -> list[float]:
        """Samples per second of each iteration."""
        return [self.rows / (ms / 1000.0) if ms > 0 else 0.0 for ms in self.iteration_ms]

    def idle_ms(self) -> dict[int, float]:
        return {r: max(0.0, self.wall_ms[r] - b) for r, b in self.busy_ms.items()}


# ---------------------------------------------------------------- one rank


class _Failure(Exception):
    """A worker error with its kind: ``setup`` or ``compute`` (causes) or ``comm`` (effects)."""

    def __init__(self, kind: str, text: str) -> None:
        super().__init__(text)
        self.kind = kind


def _plan_digest(plan_dir: Path) -> int:
    return int.from_bytes(hashlib.sha256((plan_dir / PLAN_FILE).read_bytes()).digest()[:7], "big")


def _loopback_interface() -> str | None:
    names = {name for _, name in socket.if_nameindex()}
    return next((n for n in ("lo", "lo0") if n in names), None)


def _bind_gloo_to_loopback(master_addr: str) -> None:
    """Keep gloo's connections on loopback when the rendezvous is (unless GLOO_SOCKET_IFNAME)."""
    if master_addr in ("127.0.0.1", "localhost", "::1") and "GLOO_SOCKET_IFNAME" not in os.environ:
        name = _loopback_interface()
        if name:
            os.environ["GLOO_SOCKET_IFNAME"] = name


def _serve_rank(
    plan_dir: Path,
    plan: Plan,
    lay: Layout,
    rank: int,
    backend: str,
    feeds: Mapping[str, np.ndarray] | None,
    microbatches: int,
    iterations: int,
    threads: int,
    timeout_s: float,
    store: dist.Store | None,
) -> tuple[Env, DistStats] | None:
    """Run one rank; rank 0 returns the merged outputs and the stats."""
    started = time.perf_counter()
    k, r = lay.place(rank)
    stage, device = plan.stages[k], os.environ.get(DEVICE_ENV) or lay.devices[k][r]
    last = k + 1 == lay.stages
    try:
        session = ort.InferenceSession(str(plan_dir / stage.file),
                                       sess_options=session_options(threads),
                                       providers=providers_for(device))
        comm = torch.device("cpu")
        if backend == "nccl":
            comm = torch.device("cuda", int(local_device(device).partition(":")[2] or 0))
            torch.cuda.set_device(comm)
        fixed = microbatch.batch_axes(plan)
        batches = microbatch.split(dict(feeds), microbatches, fixed) if feeds is not None else []
    except Exception as exc:  # onnxruntime raises its own types
        raise _Failure("setup", f"cannot start: {one_line(exc)}") from exc
    timeout = datetime.timedelta(seconds=timeout_s)
    if store is not None:
        dist.init_process_group(backend, store=store, rank=rank, world_size=lay.world_size,
                                timeout=timeout)
    else:
        dist.init_process_group(backend, init_method="env://", rank=rank,
                                world_size=lay.world_size, timeout=timeout)
    # Rank 0 tells everyone the micro-batch count; all check they read the same plan.json.
    control = torch.tensor([len(batches), iterations, _plan_digest(plan_dir)], dtype=torch.int64)
    wired = control.to(comm)
    dist.broadcast(wired, src=0)
    count, iterations, digest = (int(v) for v in wired.cpu())
    if digest != _plan_digest(plan_dir):
        raise _Failure("setup", "its plan.json differs from rank 0's")
    ready = time.perf_counter()

    wire, busy, exit_hook = Wire(comm, lay.name), 0.0, os.environ.get(EXIT_RANK_ENV) == str(rank)
    stop_hook = os.environ.get(STOP_RANK_ENV) == str(rank)
    iteration_ms: list[float] = []
    busy_each: list[float] = []
    cpu, cpu_each = 0.0, []
    results: dict[int, Env] = {}
    for _ in range(iterations):
        began, busy_before, cpu_before = time.perf_counter(), busy, cpu
        pending: list[Any] = []
        results.clear()
        if rank == 0:
            for m in range(count):
                if lay.rank_of(0, m) != 0:
                    wire.send(lay.rank_of(0, m), m, lay.recv_names[0], batches[m], pending)
        for m in range(r, count, lay.replicas[k]):
            if rank == 0:
                env = {n: batches[m][n] for n in lay.recv_names[0]}
            else:
                src = 0 if k == 0 else lay.rank_of(k - 1, m)
                env = wire.recv(src, m, lay.recv_names[k])
            if exit_hook:
                os._exit(1)
            if stop_hook:
                os.kill(os.getpid(), signal.SIGSTOP)
            t0, c0 = time.perf_counter(), time.thread_time()
            try:
                values = session.run(stage.outputs, {n: env[n] for n in stage.inputs})
            except Exception as exc:  # onnxruntime raises its own types
                raise _Failure("compute", one_line(exc)) from exc
            busy += time.perf_counter() - t0
            cpu += time.thread_time() - c0
            env.update(zip(stage.outputs, values))
            dst = 0 if last else lay.rank_of(k + 1, m)
            if dst == rank:
                results[m] = {n: env[n] for n in lay.send_names[k]}
            else:
                wire.send(dst, m, lay.send_names[k], env, pending)
        if rank == 0:
            for m in range(count):
                if m not in results:
                    results[m] = wire.recv(lay.rank_of(lay.stages - 1, m), m, lay.send_names[-1])
        wire.wait(pending)
        iteration_ms.append((time.perf_counter() - began) * 1000.0)
        busy_each.append((busy - busy_before) * 1000.0)
        cpu_each.append((cpu - cpu_before) * 1000.0)
    done = time.perf_counter()

    mine = {"rank": rank, "busy": busy, "comm": wire.comm_s, "wall": done - ready,
            "setup": ready - started, "busy_each": busy_each, "cpu_each": cpu_each}
    gathered: list[Any] = [None] * lay.world_size if rank == 0 else []
    dist.gather_object(mine, gathered if rank == 0 else None, dst=0)
    dist.destroy_process_group()
    if rank != 0:
        return None
    outputs = microbatch.merge([results[m] for m in range(count)], fixed)
    rows = microbatch.batch_size(feeds, fixed) if feeds is not None else 0
    stats = DistStats(
        backend=backend, world_size=lay.world_size, microbatches=count, rows=rows,
        iteration_ms=iteration_ms, setup_ms=max(g["setup"] for g in gathered) * 1000.0,
        placement=[(*lay.place(q), os.environ.get(DEVICE_ENV)
                    or lay.devices[lay.place(q)[0]][lay.place(q)[1]])
                   for q in range(lay.world_size)],
        busy_ms={g["rank"]: g["busy"] * 1000.0 for g in gathered},
        busy_each_ms={g["rank"]: g["busy_each"] for g in gathered},
        cpu_each_ms={g["rank"]: g["cpu_each"] for g in gathered},
        comm_ms={g["rank"]: g["comm"] * 1000.0 for g in gathered},
        wall_ms={g["rank"]: g["wall"] * 1000.0 for g in gathered},
    )
    return outputs, stats


def _spawned(
    rank: int,
    store: dist.Store,
    plan_dir: str,
    backend: str,
    feeds: dict[str, np.ndarray] | None,
    microbatches: int,
    iterations: int,
    threads: int,
    timeout_s: float,
) -> tuple[Env, DistStats] | None:
    """One rank of :func:`run_distributed` (a :func:`launch_ranks` target)."""
    folder = Path(plan_dir)
    plan = read_plan(folder)
    return _serve_rank(folder, plan, layout(plan), rank, backend, feeds, microbatches,
                       iterations, threads, timeout_s, store)


def _child(
    rank: int,
    target: Callable[..., Any],
    args: tuple[Any, ...],
    master_addr: str,
    master_port: int,
    timeout_s: float,
    reports: Any,
    environ: Mapping[str, str],
    launcher: int,
    beats: Heartbeats,
) -> None:
    """A child of :func:`launch_ranks`: run ``target(rank, store, *args)``, report
    ``("done", rank, result)`` (unless None) or ``("error", rank, kind, text)`` on ``reports``
    (a SimpleQueue). It dies with the launcher (pid ``launcher``) and beats on ``beats``
    while it lives."""
    die_with(launcher)
    beats.start(rank)
    os.environ.clear()  # the parent's environment now, not the fork server's at its start
    os.environ.update(environ)
    try:
        _bind_gloo_to_loopback(master_addr)
        store = dist.TCPStore(master_addr, master_port, None, is_master=False,
                              timeout=datetime.timedelta(seconds=timeout_s))
        result = target(rank, store, *args)
        if result is not None:
            reports.put(("done", rank, result))
    except BaseException as exc:
        kind = exc.kind if isinstance(exc, _Failure) else "comm"
        try:
            reports.put(("error", rank, kind, one_line(exc)))
        finally:
            os._exit(1)


# ---------------------------------------------------------------- the launcher


def _check_run(plan_dir: Path, nproc: int | None, backend: str | None,
               device: str | None = None) -> tuple[Plan, Layout, str]:
    plan = read_plan(plan_dir)
    verify_plan_folder(plan_dir, plan)
    if device not in (None, "cpu"):
        raise PartitionError(f"device {device!r}: only cpu replaces the plan's devices")
    check_devices(plan, ["CPUExecutionProvider"] if device else None)  # before any process
    lay = layout(plan)
    if device == "cpu":
        lay = replace(lay, devices=[["cpu"] * len(d) for d in lay.devices])
    if nproc is not None and nproc != lay.world_size:
        raise PartitionError(f"the plan has {lay.world_size} stage replicas "
                             f"({' + '.join(map(str, lay.replicas))}); got {nproc} processes")
    return plan, lay, choose_backend(lay, backend, one_machine=True)


def _check_feeds(plan: Plan, feeds: Mapping[str, np.ndarray], microbatches: int) -> None:
    missing = [s.name for s in plan.inputs if s.name not in feeds]
    if missing:
        raise PartitionError(f"missing input {missing[0]!r}; inputs: "
                             f"{[s.name for s in plan.inputs]}")
    try:
        microbatch.split(dict(feeds), microbatches, microbatch.batch_axes(plan))
    except ValueError as exc:
        raise PartitionError(str(exc)) from None


def run_distributed(
    plan_dir: str | os.PathLike[str],
    feeds: Mapping[str, np.ndarray],
    *,
    nproc: int | None = None,
    microbatches: int | None = None,
    iterations: int = 1,
    backend: str | None = None,
    master_addr: str = "127.0.0.1",
    master_port: int = 0,
    timeout_s: float = 60.0,
    threads_per_stage: int = 1,
    start_method: str | None = None,
    output_names: Sequence[str] | None = None,
    device: str | None = None,
) -> tuple[list[np.ndarray], DistStats]:
    """Run the plan with one local process per stage replica; the outputs (last iteration's,
    a list in the order of ``output_names``, default the plan's outputs, as onnxruntime's
    ``run``) and the figures. ``device="cpu"`` runs every rank on CPU whatever the plan's
    devices (a CUDA plan's numerics on a machine without a GPU).

    ``nproc`` must equal the plan's replicas in total (None: take it from the plan).
    ``master_port`` 0 picks a free port. A worker that raises or dies ends the run with
    :class:`StageFailed` naming its stage, replica and rank. ``start_method``: ``forkserver``
    (the default where available: torch and onnxruntime are imported once, in the fork server,
    which is reused by later runs) or ``spawn`` (every worker imports them itself). Neither
    forks a process that holds threads or a CUDA context.
    """
    folder = Path(plan_dir).resolve()
    plan, lay, chosen = _check_run(folder, nproc, backend, device)
    known = [o.name for o in plan.outputs]
    names = list(output_names) if output_names else known
    if any(n not in known for n in names):
        raise PartitionError(f"unknown output {next(n for n in names if n not in known)!r}; "
                             f"outputs: {known}")
    if microbatches is None:  # the plan's (predicted.microbatches, else 8)
        microbatches = plan_microbatches(plan)
    _check_feeds(plan, feeds, microbatches)
    if iterations < 1:
        raise PartitionError(f"need at least one iteration, got {iterations}")
    inputs = {n: np.asarray(feeds[n]) for n in lay.recv_names[0]}
    args = [(str(folder), chosen, inputs if rank == 0 else None, microbatches, iterations,
             threads_per_stage, timeout_s) for rank in range(lay.world_size)]
    began = time.perf_counter()
    results = launch_ranks(_spawned, args, lay.name, master_addr=master_addr,
                           master_port=master_port, timeout_s=timeout_s,
                           start_method=start_method,
                           environ={DEVICE_ENV: device} if device else None)
    if 0 not in results:
        raise StageFailed("the workers finished without sending the outputs")
    outputs, stats = results[0]
    stats.launch_ms = (time.perf_counter() - began) * 1000.0
    return [outputs[n] for n in names], stats


def launch_ranks(
    target: Callable[..., Any],
    args: Sequence[tuple[Any, ...]],
    name: Callable[[int], str],
    *,
    master_addr: str = "127.0.0.1",
    master_port: int = 0,
    timeout_s: float = 60.0,
    start_method: str | None = None,
    preload: Sequence[str] = PRELOAD,
    environ: Mapping[str, str] | None = None,
) -> dict[int, Any]:
    """Start one local process per rank running ``target(rank, store, *args[rank])`` (a
    module-level function; ``store`` is the rendezvous store this process hosts) and
    supervise them: the results that ranks returned (not None), by rank, once all exited
    cleanly; :class:`StageFailed` naming the rank (``name(rank)``) that raised, died or went
    silent first, the others killed. The ranks die with this process (``lifeline``), and the
    fork server too. ``environ`` adds variables to the ranks' environment. ``start_method``:
    ``forkserver`` (the default where available, with ``preload`` imported once) or
    ``spawn``."""
    timeout = datetime.timedelta(seconds=timeout_s)
    try:
        store = dist.TCPStore(master_addr, master_port, None, is_master=True, timeout=timeout,
                              wait_for_workers=False)
    except (RuntimeError, ValueError) as exc:
        raise PartitionError(f"cannot listen on {master_addr}:{master_port}: "
                             f"{one_line(exc)}") from None
    method = start_method or ("forkserver" if "forkserver" in mp.get_all_start_methods()
                              else "spawn")
    if method not in ("spawn", "forkserver"):
        raise PartitionError(f"start method {method!r}: use spawn or forkserver")
    context: Any = mp.get_context(method)
    if method == "forkserver":
        context.set_forkserver_preload(list(dict.fromkeys([*PRELOAD, *preload])))
    reports = context.SimpleQueue()
    beats = Heartbeats(context, len(args))
    env = dict(os.environ) | dict(environ or {})
    procs = [
        context.Process(
            target=_child, name=f"onnx-partition-rank{rank}", daemon=True,
            args=(rank, target, tuple(rank_args), master_addr, store.port, timeout_s, reports,
                  env, os.getpid(), beats),
        )
        for rank, rank_args in enumerate(args)
    ]
    started: list[Any] = []
    try:
        for proc in procs:
            proc.start()
            started.append(proc)
        return _supervise(procs, reports, name, beats, min(timeout_s, SILENT_S))
    finally:
        for proc in started:
            if proc.is_alive():
                proc.kill()
        for proc in started:
            proc.join(timeout=5)
        reports.close()
        del store


def _supervise(
    procs: Sequence[Any], reports: Any, name: Callable[[int], str], beats: Heartbeats,
    silent_s: float,
) -> dict[int, Any]:
    """Wait for clean exits, keeping the ranks' results; on the first failure (a report, a bad
    exit, a rank silent for ``silent_s``), gather reports for ``GRACE_S``, then raise the most
    telling one (a cause before a silent rank before a dead rank before a communication error
    that followed it)."""
    errors: dict[int, tuple[str, str]] = {}
    results: dict[int, Any] = {}
    failed_at: float | None = None
    while True:
        exits = [p.exitcode for p in procs]
        while not reports.empty():
            message = reports.get()
            if message[0] == "done":
                results[message[1]] = message[2]
            else:
                errors.setdefault(message[1], (message[2], message[3]))
        bad = [q for q, code in enumerate(exits) if code not in (None, 0)]
        running = [code is None for code in exits]
        if (errors or bad or beats.silent(silent_s, running)) and failed_at is None:
            failed_at = time.perf_counter()
        if failed_at is not None and (time.perf_counter() - failed_at > GRACE_S
                                      or all(code is not None for code in exits)):
            # a rank silent for a few beats when the run fails is a cause, not a victim
            silent = beats.silent(min(silent_s, 2.0), running)
            raise StageFailed(_cause(errors, exits, name, silent))
        if failed_at is None and all(code == 0 for code in exits):
            while not reports.empty():  # a result put just before its rank exited
                message = reports.get()
                if message[0] == "done":
                    results[message[1]] = message[2]
            return results
        time.sleep(0.02)


def _cause(
    errors: Mapping[int, tuple[str, str]],
    exits: Sequence[int | None],
    name: Callable[[int], str],
    silent: Mapping[int, float] | None = None,
) -> str:
    for rank, (kind, text) in sorted(errors.items()):
        if kind in ("setup", "compute"):
            return f"{name(rank)} failed: {text}"
    for rank, age in sorted((silent or {}).items(), key=lambda item: -item[1]):
        return (f"{name(rank)} stopped answering: no heartbeat for {age:.1f} s "
                f"(stopped or hung)")
    for rank, code in enumerate(exits):
        if code not in (None, 0) and rank not in errors:
            how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
            return f"{name(rank)} {how} without reporting an error"
    rank, (_, text) = min(errors.items())
    return f"{name(rank)} failed: {text}"


# ---------------------------------------------------------------- torchrun entry point


def main_worker(
    plan_dir: str | os.PathLike[str],
    feeds: Mapping[str, np.ndarray] | None = None,
    *,
    microbatches: int | None = None,
    iterations: int = 1,
    backend: str | None = None,
    timeout_s: float = 60.0,
    threads_per_stage: int = 1,
) -> tuple[dict[str, np.ndarray], DistStats] | None:
    """One rank under ``torchrun`` (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT from the
    environment). Only rank 0 needs ``feeds``; it returns the outputs and figures, the others
    None. Raises :class:`StageFailed` naming this rank when it fails.
    """
    try:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    except (KeyError, ValueError):
        raise PartitionError("RANK and WORLD_SIZE must be set (run under torchrun)") from None
    folder = Path(plan_dir)
    plan = read_plan(folder)
    lay = layout(plan)
    if microbatches is None:  # the plan's (predicted.microbatches, else 8)
        microbatches = plan_microbatches(plan)
    if world != lay.world_size:
        raise PartitionError(f"the plan has {lay.world_size} stage replicas "
                             f"({' + '.join(map(str, lay.replicas))}); got {world} processes")
    k, _ = lay.place(rank)
    verify_plan_folder(folder, plan, stages=[k])  # this machine's copy
    chosen = choose_backend(lay, backend)
    if rank == 0:
        if feeds is None:
            raise PartitionError("rank 0 needs the feeds")
        _check_feeds(plan, feeds, microbatches)
        feeds = {n: np.asarray(feeds[n]) for n in lay.recv_names[0]}
    _bind_gloo_to_loopback(os.environ.get("MASTER_ADDR", "127.0.0.1"))
    try:
        return _serve_rank(folder, plan, lay, rank, chosen, feeds if rank == 0 else None,
                           microbatches, iterations, threads_per_stage, timeout_s, None)
    except Exception as exc:
        raise StageFailed(f"{lay.name(rank)} failed: {one_line(exc)}") from exc


def _main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m onnx_partition.runtime.distributed",
        description="One rank of a distributed pipeline run (start it with torchrun).")
    parser.add_argument("plan", type=Path)
    parser.add_argument("--batch-size", type=int, default=None,
                        help="rows per micro-batch (default: the plan's)")
    parser.add_argument("--microbatches", type=int, default=None,
                        help="micro-batches per iteration (default: the plan's)")
    parser.add_argument("--iterations", type=int, default=10)
    parser.add_argument("--input", action="append", default=[], metavar="NAME=FILE.npy")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--backend", choices=["gloo", "nccl"], default=None)
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds per operation")
    parser.add_argument("--output-dir", type=Path, help="rank 0 saves the outputs here as .npy")
    args = parser.parse_args(argv)
    try:
        from onnx_partition.measured import run_shape

        feeds = None
        shape = run_shape(read_plan(args.plan), batch_size=args.batch_size,
                          microbatches=args.microbatches)
        if os.environ.get("RANK") == "0":
            from onnx_partition.runtime.check import random_feeds

            feeds = random_feeds(read_plan(args.plan), batch_size=shape.rows, seed=args.seed)
            for item in args.input:
                name, sep, file = item.partition("=")
                if not sep or name not in feeds:
                    raise PartitionError(f"--input {item!r}: expected NAME=FILE.npy with NAME "
                                         f"one of {', '.join(feeds)}")
                feeds[name] = np.load(file)
        result = main_worker(args.plan, feeds, microbatches=shape.microbatches,
                             iterations=args.iterations, backend=args.backend,
                             timeout_s=args.timeout)
    except (PartitionError, StageFailed) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2 if isinstance(exc, PartitionError) else 1
    if result is not None:
        outputs, stats = result
        print(format_stats(stats))
        if args.output_dir is not None:
            args.output_dir.mkdir(parents=True, exist_ok=True)
            for name, value in outputs.items():
                np.save(args.output_dir / f"{re.sub(r'[^A-Za-z0-9_.-]', '_', name)}.npy", value)
    return 0


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


if __name__ == "__main__":
    sys.exit(_main())
