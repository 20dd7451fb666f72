"""Start one local process per rank and supervise them: :func:`launch_ranks`, used by the
inference runtime (:func:`onnx_partition.runtime.distributed.run_distributed`) and the training
runtime (:func:`onnx_partition.runtime.train.spawn.launch_training`).

**Processes.** Workers start from a fork server that has imported :data:`PRELOAD` once (torch,
onnxruntime and this module, whose import calls :func:`~onnx_partition.runtime.launch.lifeline.
guard_fork_server`: the fork server dies with the process that started it), or with ``spawn``.
The parent hosts the rendezvous store on ``master_addr`` (loopback by default, and gloo then
binds loopback too).

**Faults.** The parent polls its children: a worker that raises reports its message (and its
kind, :class:`RankFailure`) and exits, one that dies is seen by its exit code, one that stops
is seen by its heartbeat (:mod:`~onnx_partition.runtime.launch.lifeline`); the parent then kills the
others and raises :class:`~onnx_partition.errors.StageFailed` naming the stage, replica and rank.
A cause (a stage that raised, a rank that died) is named before the communication errors it
provokes in its peers.

**Rules both runtimes share**, here or under ``torchrun``: :func:`torchrun_env` reads what
torchrun tells a rank (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT;
one-line :class:`~onnx_partition.errors.PartitionError` when missing or bad);
:func:`check_world_size` wants one process per stage replica; :func:`rank_result` says what a
rank's result must be: rank 0 ending without one is a failed run
(:class:`~onnx_partition.errors.StageFailed`, exit code 1), the other ranks return None (exit
code 0).
"""

from __future__ import annotations

import datetime
import os
import re
import socket
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from onnx_partition.errors import PartitionError, StageFailed, one_line
from onnx_partition.runtime.launch.lifeline import Heartbeats, die_with, guard_fork_server

__all__ = ["GRACE_S", "PRELOAD", "SILENT_S", "RankFailure", "TorchrunEnv", "bind_gloo_to_loopback",
           "check_placement", "check_world_size", "join_group", "launch_ranks", "rank_result",
           "torchrun_env"]

#: A rank whose heartbeat is older than this (or than the timeout, if shorter) has stopped.
SILENT_S = 10.0
# imported once by the fork server, before it forks the workers (this module guards it)
PRELOAD = ["numpy", "onnxruntime", "torch", "torch.distributed",
           "onnx_partition.runtime.launch.ranks"]
GRACE_S = 0.5  # after the first failure, how long the parent gathers reports before choosing one
guard_fork_server()  # preloaded by the fork server: it dies with the process that started it


class RankFailure(Exception):
    """A worker error with its kind: ``setup`` or ``compute`` (causes) or ``comm`` (effects)."""

    def __init__(self, kind: str, text: str) -> None:
        super().__init__(text)
        self.kind = kind


def _loopback_interface() -> str | None:
    names = {name for _, name in socket.if_nameindex()}
    return next((n for n in ("lo", "lo0") if n in names), None)


def bind_gloo_to_loopback(master_addr: str) -> None:
    """Keep gloo's connections on loopback when the rendezvous is (unless GLOO_SOCKET_IFNAME)."""
    if master_addr in ("127.0.0.1", "localhost", "::1") and "GLOO_SOCKET_IFNAME" not in os.environ:
        name = _loopback_interface()
        if name:
            os.environ["GLOO_SOCKET_IFNAME"] = name


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


_PEER_LOST = re.compile(r"connection (closed|reset)|closed by peer|broken pipe|timed? ?out",
                        re.IGNORECASE)


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
    # communication errors only: the first that is not a peer's loss (gloo's "connection closed
    # by peer", a reset, a timeout) is where it began; ``errors`` is in order of arrival
    rank, (_, text) = min(errors.items(),
                          key=lambda item: _PEER_LOST.search(item[1][1]) is not None)
    return f"{name(rank)} failed: {text}"


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
        bind_gloo_to_loopback(master_addr)
        store = dist.TCPStore(master_addr, master_port, None, is_master=False,
                              timeout=datetime.timedelta(seconds=timeout_s))
        result = target(rank, store, *args)
        if result is not None:
            reports.put(("done", rank, result))
    except BaseException as exc:
        kind = exc.kind if isinstance(exc, RankFailure) else "comm"
        try:
            reports.put(("error", rank, kind, one_line(exc)))
        finally:
            os._exit(1)


def join_group(backend: str, rank: int, world: int, timeout_s: float,
               store: dist.Store | None) -> None:
    """Join the process group: through ``store`` (a :func:`launch_ranks` child), else through
    the environment (``env://``: torchrun's RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), in
    the keys of this start (:func:`start_store`)."""
    timeout = datetime.timedelta(seconds=timeout_s)
    if store is None:
        store = start_store(next(dist.rendezvous("env://", rank, world, timeout=timeout))[0],
                            rank)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)


def start_store(store: dist.Store, rank: int) -> dist.Store:
    """``store`` under a prefix of its own for this start of the job. torchrun's workers
    restarted by ``--max-restarts`` meet in the agent's store again, on the same port, where the
    keys of the start before are still set (gloo's peer addresses among them: the new ranks
    would connect to dead ones). Each rank counts its own starts in the store; every rank of a
    restarted job is a new process, so the ``n``-th start of every rank is the same start (the
    prefix ``onnx-partition/start-n/``) on one machine and on many."""
    starts = store.add(f"onnx-partition/starts/rank-{rank}", 1)
    return dist.PrefixStore(f"onnx-partition/start-{starts}", store)


# --------------------------------------------------------------------------- shared rules


@dataclass(frozen=True)
class TorchrunEnv:
    """What ``torchrun`` tells a rank through its environment (:func:`torchrun_env`)."""

    rank: int  # RANK: 0 .. world_size - 1
    world_size: int  # WORLD_SIZE: ranks in all
    local_rank: int  # LOCAL_RANK: rank on this machine (default: RANK)
    local_world_size: int  # LOCAL_WORLD_SIZE: ranks on this machine (default: WORLD_SIZE)
    master_addr: str  # MASTER_ADDR: host of the rendezvous
    master_port: int  # MASTER_PORT: its port
    group_rank: int = 0  # GROUP_RANK: this machine's place (torchrun --node-rank; default 0)


def _missing(name: str) -> PartitionError:
    return PartitionError(f"{name} is not set: start each rank with torchrun (it sets RANK, "
                          f"WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT)")


def _whole(environ: Mapping[str, str], name: str, default: int | None = None) -> int:
    raw = environ.get(name)
    if raw is None:
        if default is not None:
            return default
        raise _missing(name)
    try:
        return int(raw)
    except ValueError:
        raise PartitionError(f"{name}={raw!r} is not a whole number (torchrun sets it)") from None


def torchrun_env(environ: Mapping[str, str] | None = None) -> TorchrunEnv:
    """This rank's place in a ``torchrun`` job, from ``environ`` (default ``os.environ``).
    RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT must be set; LOCAL_WORLD_SIZE defaults to
    WORLD_SIZE and then LOCAL_RANK to RANK (one machine). A missing or bad one, or a rank
    outside its world, is a one-line PartitionError."""
    env = os.environ if environ is None else environ
    world = _whole(env, "WORLD_SIZE")
    if world < 1:
        raise PartitionError(f"WORLD_SIZE={world}: need at least one rank")
    rank = _whole(env, "RANK")
    if not 0 <= rank < world:
        raise PartitionError(f"RANK={rank} is outside 0..{world - 1} (WORLD_SIZE={world})")
    local_world = _whole(env, "LOCAL_WORLD_SIZE", world)
    if not 1 <= local_world <= world:
        raise PartitionError(f"LOCAL_WORLD_SIZE={local_world} is outside 1..{world} "
                             f"(WORLD_SIZE={world})")
    local_rank = _whole(env, "LOCAL_RANK", rank if local_world == world else None)
    if not 0 <= local_rank < local_world:
        raise PartitionError(f"LOCAL_RANK={local_rank} is outside 0..{local_world - 1} "
                             f"(LOCAL_WORLD_SIZE={local_world})")
    addr = env.get("MASTER_ADDR", "")
    if not addr:
        raise _missing("MASTER_ADDR")
    port = _whole(env, "MASTER_PORT")
    if not 0 < port < 65536:
        raise PartitionError(f"MASTER_PORT={port} is not a port (1..65535)")
    group = _whole(env, "GROUP_RANK", 0)
    if group < 0:
        raise PartitionError(f"GROUP_RANK={group} is not a machine number (0 or more)")
    return TorchrunEnv(rank, world, local_rank, local_world, addr, port, group)


_PLACED = re.compile(r"(?:m(\d+)/)?(cpu|cuda(?::(\d+))?)")


def check_placement(env: TorchrunEnv, devices: Sequence[str], name: Callable[[int], str],
                    device_count: int | None = None) -> None:
    """Before the first operation: this rank's plan device (``devices``: the plan's device per
    rank, in rank order) is on this machine and this machine has its GPU, or a one-line
    PartitionError naming the rank, the machine and the GPU it expected. A plan device
    ``mN/...`` belongs on machine N: torchrun numbers ranks machine-major (GROUP_RANK), so a
    plan whose rank order differs would run stages on the wrong machine's GPUs. ``cuda:K``
    needs K < ``device_count`` (default ``torch.cuda.device_count()``, asked only then);
    ``cpu`` devices skip the GPU part. A plan without machine prefixes runs on any machine
    (the plan folder copied to each: devices name local devices)."""
    if len(devices) != env.world_size:
        raise PartitionError(f"the plan places {len(devices)} ranks; torchrun started "
                             f"{env.world_size}")
    device = devices[env.rank]
    match = _PLACED.fullmatch(device)
    if match is None:
        raise PartitionError(f"{name(env.rank)}: unknown device {device!r}")
    machine, kind, index = match.group(1), match.group(2), match.group(3)
    where = (f"torchrun started it on machine {env.group_rank} (GROUP_RANK={env.group_rank}, "
             f"LOCAL_RANK={env.local_rank} of LOCAL_WORLD_SIZE={env.local_world_size})")
    if machine is not None and int(machine) != env.group_rank:
        raise PartitionError(
            f"{name(env.rank)} belongs on machine m{machine} ({device}) but {where}: start "
            f"machine m{machine} with --node-rank {machine} and list the plan's devices "
            f"machine by machine in rank order")
    if kind == "cpu":
        return
    gpu = int(index or 0)
    if device_count is None:
        device_count = torch.cuda.device_count()
    if gpu >= device_count:
        raise PartitionError(f"{name(env.rank)} expects GPU cuda:{gpu} on machine "
                             f"m{env.group_rank} ({device}) but this machine has "
                             f"{device_count} visible GPU(s) ({where})")


def check_world_size(replicas: Sequence[int], processes: int) -> None:
    """One process per stage replica (``replicas``: the plan's replicas per stage), or a
    one-line PartitionError."""
    if processes != sum(replicas):
        raise PartitionError(f"the plan has {sum(replicas)} stage replicas "
                             f"({' + '.join(map(str, replicas))}); got {processes} processes")


def rank_result(rank: int, result: Any, what: str) -> Any:
    """The one rule for what a rank ends with: rank 0 returns the run's result, a run whose
    rank 0 ended without one failed (:class:`StageFailed`: exit code 1, as any failed run;
    never 2, which means bad input); the other ranks' results are dropped (None: exit code 0).
    ``what`` names the ranks in the message (``"the training ranks"``)."""
    if rank != 0:
        return None
    if result is None:
        raise StageFailed(f"{what} finished without rank 0's result")
    return result
