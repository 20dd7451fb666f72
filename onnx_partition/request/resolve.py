"""The one resolver of ``partition``'s options: the command line (``cli/args.py``) and the
Python API (:func:`onnx_partition.partition.partition`) both build a
:class:`~onnx_partition.request.partition.PartitionOptions` and resolve it here, so the two plan
the same thing from the same inputs. Every check of an option is here; every default comes from
:mod:`onnx_partition.settings.partition`; a named GPU brings its datasheet memory and link
whether it is named by ``--gpu``, by cluster.json or by a :class:`Cluster` in Python."""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TypeVar

from onnx_partition import values
from onnx_partition.cost.analytic import DeviceSpec
from onnx_partition.cost.cluster import Cluster, Fleet, Link, load_cluster, parse_bytes
from onnx_partition.errors import PartitionError
from onnx_partition.request.partition import (
    DeviceOptions,
    Devices,
    PartitionOptions,
    PartitionRequest,
)
from onnx_partition.settings.partition import AUTO, MODES, SearchSpec, TrainSpec

__all__ = ["api_devices", "costs_of", "device_kind_of", "resolve", "resolve_devices"]

log = logging.getLogger("onnx_partition")
_TRAIN, _SEARCH = TrainSpec(), SearchSpec()  # the defaults
T = TypeVar("T")


def resolve(options: PartitionOptions) -> PartitionRequest:
    """The request ``options`` describe, every option checked (a :class:`PartitionError`
    naming it otherwise) and every default filled."""
    train, search = _specs(options)
    program = Path(options.model).with_suffix(".pt2")
    if options.program_required and search.mode == MODES[1] and not program.is_file():
        raise PartitionError(
            f"--mode train: {options.model} has no exported program {program.name} beside it, "
            "which `train` needs: export the model with `onnx-partition export` or "
            "onnx_partition.export (they write MODEL.pt2), or give --no-program to plan only")
    costs = options.costs
    if _measures_here(options, search.mode, program):
        costs = dataclasses.replace(costs, measure=True)
    devices = resolve_devices(options.devices, costs_given=costs.file is not None
                              or bool(costs.kinds) or costs.measure)
    if options.sources is not None:
        devices = dataclasses.replace(devices, sources=dict(options.sources))
    if costs.kinds and not isinstance(devices.cluster, Fleet):
        raise PartitionError("--costs KIND=FILE prices the GPU kinds of a fleet (cluster.json "
                             "with groups); give a plain --costs FILE")
    return PartitionRequest(
        model=Path(options.model), out=Path(options.out), stages=options.stages,
        input_shapes=options.input_shapes, batch_size=options.batch_size, costs=costs,
        devices=devices, train=train, search=search, check=options.check, force=options.force)


def _measures_here(options: PartitionOptions, mode: str, program: Path) -> bool:
    """Whether a train plan is priced by measuring it on this CPU (its cached profile,
    :mod:`~onnx_partition.cost.profile.train_cache`): no costs file, the CPUs of this one
    machine (no GPU, cluster.json, fleet, pinned analytic CPU or API device), its program
    beside the model, and neither ``--analytic`` nor ``$ONNX_PARTITION_TRAIN_PRICING=analytic``
    asks for the roofline."""
    from onnx_partition.cost.profile.train_cache import PRICING_ENV, PRICINGS

    given = options.costs.file is not None or bool(options.costs.kinds)
    if options.analytic and given:
        raise PartitionError("--analytic prices by the roofline: it cannot go with --costs")
    analytic = options.analytic
    if analytic is None:
        told = os.environ.get(PRICING_ENV) or PRICINGS[0]
        if told not in PRICINGS:
            raise PartitionError(f"${PRICING_ENV} must be {' or '.join(PRICINGS)}, got "
                                 f"{told!r}")
        analytic = told == PRICINGS[1]
    dev = options.devices
    here = (device_kind_of(dev) == "cpu" and dev.cluster is None and dev.fleet is None
            and dev.cpu_tflops is None and not dev.cpu_gbps and dev.device is None
            and (dev.machines or 1) == 1 and dev.speed in (None, 1.0))
    return mode == MODES[1] and not analytic and not given and here and program.is_file()


def _specs(options: PartitionOptions) -> tuple[TrainSpec, SearchSpec]:
    """The iteration and the search ``options`` ask for, checked, defaults filled."""
    from onnx_partition.cost.saved import check_precision
    from onnx_partition.pipeline.memory import RECOMPUTE_MODES
    from onnx_partition.pipeline.schedules import PLANNED_NAMES

    if options.stages is not None and options.stages < 1:
        raise PartitionError(f"--stages must be at least 1, got {options.stages}")
    if options.microbatches is not None and options.microbatches < 1:
        raise PartitionError(f"--microbatches must be at least 1, got {options.microbatches}")
    mode = _SEARCH.mode if options.mode is None else options.mode
    if mode not in MODES:
        raise PartitionError(f"mode must be infer or train, got {mode!r}")
    if options.schedule is not None and mode != MODES[1]:
        raise PartitionError("--schedule plans a training schedule: it needs --mode train")
    if options.recompute is not None and mode != MODES[1]:
        raise PartitionError("--recompute trades a training stage's memory for time: it needs "
                             "--mode train")
    if options.shard_optimizer and mode != MODES[1]:
        raise PartitionError("--shard-optimizer shards a training stage's optimizer state: it "
                             "needs --mode train")
    train = TrainSpec(microbatches=_or(options.microbatches, _TRAIN.microbatches),
                      schedule=_or(options.schedule, _TRAIN.schedule),
                      recompute=_or(options.recompute, _TRAIN.recompute),
                      precision=_or(options.precision, _TRAIN.precision),
                      optimizer=_TRAIN.optimizer,
                      shard="optimizer" if options.shard_optimizer else _TRAIN.shard)
    if train.schedule != AUTO and train.schedule not in PLANNED_NAMES:
        raise PartitionError(f"cannot plan for schedule {train.schedule!r}; choose "
                             f"{', '.join((AUTO, *PLANNED_NAMES))}")
    if train.recompute not in RECOMPUTE_MODES:
        raise PartitionError(f"recompute must be one of {', '.join(RECOMPUTE_MODES)}, "
                             f"got {train.recompute!r}")
    check_precision(train.precision)
    if train.precision != _TRAIN.precision and mode != MODES[1]:
        raise PartitionError(f"--precision {train.precision} prices mixed-precision training: "
                             "it needs --mode train (inference runs the graph's own dtypes)")
    search = SearchSpec(mode=mode, ordering=_or(options.ordering, _SEARCH.ordering),
                        solver=_or(options.solver, _SEARCH.solver),
                        time_limit_s=_or(options.time_limit_s, _SEARCH.time_limit_s),
                        exact_budget_s=_or(options.exact_budget_s, _SEARCH.exact_budget_s))
    if not 0 <= search.exact_budget_s < math.inf:
        raise PartitionError(f"--exact-budget must be 0 (off) or a number of seconds, got "
                             f"{search.exact_budget_s:g}")
    return train, search


def _or(value: T | None, default: T) -> T:
    """``value`` where given, else ``default``."""
    return default if value is None else value


def costs_of(items: Sequence[str | os.PathLike[str]] | None
             ) -> tuple[Path | None, dict[str, Path]]:
    """``--costs FILE`` (at most one) and ``--costs KIND=FILE`` (a fleet's, per GPU kind)."""
    plain: list[Path] = []
    keyed: dict[str, Path] = {}
    for item in items or []:
        kind, sep, path = str(item).partition("=")
        if sep and kind and "/" not in kind and not Path(item).exists():
            if kind.lower() in keyed:
                raise PartitionError(f"--costs {kind}=...: given twice")
            keyed[kind.lower()] = Path(path)
        else:
            plain.append(Path(item))
    if len(plain) > 1:
        raise PartitionError("--costs FILE: one file (a fleet's kinds: --costs KIND=FILE each)")
    return (plain[0] if plain else None), keyed


def api_devices(cluster: Cluster | Fleet | str | os.PathLike[str] | None, *,
                link: Link | None = None, device: DeviceSpec | None = None,
                gpu: str | None = None, device_kind: str | None = None) -> DeviceOptions:
    """The Python API's devices as the options that say the same: a cluster.json path as
    ``--cluster``; a :class:`Cluster` as ``--devices``, ``--machines`` and the memory, link
    and GPU options, each of its fields that differs from the default given (so a named GPU
    without ``memory_gb`` or ``intra`` gets its datasheet's, as on the command line); a
    ``link`` without a cluster as ``--bandwidth``/``--latency``, each where it differs from
    the default link. Where a field equals its default, Python cannot tell it was given: a
    cluster.json that spells out a default (``"memory_gb": null`` beside a named GPU, an
    ``intra`` equal to the default link) resolves as the file only when its path is given."""
    default = Cluster()

    def given(value: Any, unset: Any) -> Any:
        return None if value == unset else value

    if cluster is None:
        link = link or default.intra
        return DeviceOptions(gpu=gpu, device_kind=device_kind, device=device,
                             bandwidth=given(link.bandwidth_gbps, default.intra.bandwidth_gbps),
                             latency=given(link.latency_ms, default.intra.latency_ms))
    if isinstance(cluster, str | os.PathLike):
        return DeviceOptions(cluster=Path(cluster), gpu=gpu, device=device)
    if isinstance(cluster, Fleet):
        return DeviceOptions(fleet=cluster, gpu=gpu, device=device)
    return DeviceOptions(
        gpu=gpu or cluster.gpu, device_kind=device_kind or given(cluster.kind, default.kind),
        devices=cluster.devices_per_machine, machines=cluster.machines,
        device_memory=given(cluster.memory_gb, default.memory_gb),
        bandwidth=given(cluster.intra.bandwidth_gbps, default.intra.bandwidth_gbps),
        latency=given(cluster.intra.latency_ms, default.intra.latency_ms),
        inter_bandwidth=given(cluster.inter.bandwidth_gbps, default.inter.bandwidth_gbps),
        inter_latency=given(cluster.inter.latency_ms, default.inter.latency_ms),
        speed=given(cluster.speed, default.speed), device=device)


def device_kind_of(options: DeviceOptions) -> str:
    """``--device-kind``, where ``--gpu NAME`` alone implies cuda (default cpu)."""
    return str(options.device_kind or ("cuda" if options.gpu else Cluster().kind))


def resolve_devices(options: DeviceOptions, *, costs_given: bool = False) -> Devices:
    """The devices ``options`` describe (:class:`Devices`). A named GPU (``--gpu``, or
    cluster.json's ``gpu``) brings its datasheet memory and intra-machine link
    (:data:`~onnx_partition.cost.devices.GPU_LINKS`) where neither an option nor cluster.json
    gives them; ``--cpu-tflops`` pins the analytic CPU, else it is measured once per machine
    and cached (:func:`~onnx_partition.cost.devices.measured_cpu`); with a costs file
    (``costs_given``) no analytic device is resolved unless one is given."""
    from onnx_partition.cost.devices import device_for, pinned_cpu

    cluster, sources = _cluster_and_sources(options)
    if cluster is None:
        link, sources["link"] = _link_and_source(options, options.gpu)
    else:
        link = cluster.intra
    kind = cluster.kind if cluster is not None else device_kind_of(options)
    gpu_name = cluster.gpu if cluster is not None else options.gpu
    if kind == "cuda":
        sources["gpu"] = (f"--gpu {options.gpu}" if options.gpu else
                          _here(options) if gpu_name else "default")
    device = options.device
    if options.cpu_tflops is not None or options.cpu_gbps:
        if kind != "cpu" or costs_given:
            raise PartitionError("--cpu-tflops/--cpu-gbps price CPUs with the analytic model: "
                                 "they cannot go with a GPU or --costs")
        if options.cpu_tflops is None:
            raise PartitionError("--cpu-gbps needs --cpu-tflops (the pinned CPU's peak)")
        device = pinned_cpu(options.cpu_tflops, options.cpu_gbps)
    elif device is None and not costs_given and not isinstance(cluster, Fleet):
        device = device_for(kind, gpu_name)  # a fleet: each kind its own
    return Devices(cluster, link, device, sources)


def _here(options: DeviceOptions) -> str:
    """Where a cluster came from, for the sources: its file, or the API's object."""
    return f"cluster.json {options.cluster}" if options.cluster is not None \
        else "the Fleet given"


def _gpu_link(gpu_name: str) -> tuple[Link, str]:
    """A named GPU's intra-machine link and where it comes from."""
    from onnx_partition.cost.devices import GPU_LINKS, gpu_spec

    key, spec = gpu_spec(gpu_name)
    sheet = GPU_LINKS[key]
    return (Link(sheet.bandwidth_gbps, sheet.latency_ms),
            f"datasheet: {sheet.name} of the {spec.name}, per direction")


def _link_and_source(options: DeviceOptions, gpu_name: str | None) -> tuple[Link, str]:
    """--bandwidth/--latency, else a named GPU's datasheet link, else the default link."""
    base, where = _gpu_link(gpu_name) if gpu_name else (Link(), "default")
    pairs = (("--bandwidth", options.bandwidth), ("--latency", options.latency))
    for name, value in pairs:
        if value is not None and not value >= 0:
            raise PartitionError(f"{name} must be >= 0, got {value}")
    link = Link(base.bandwidth_gbps if options.bandwidth is None else options.bandwidth,
                base.latency_ms if options.latency is None else options.latency)
    given = [n for n, v in pairs if v is not None]
    if len(given) == 2:
        where = "options"
    elif given:
        where = f"{given[0]}; the rest {where}"
    return link, f"{_link_text(link)} ({where})"


def _link_text(link: Link) -> str:
    return f"{link.bandwidth_gbps:g} GB/s, {link.latency_ms:g} ms"


def _less_context() -> str:
    """How a named GPU's memory was reduced, for the summary's memory source."""
    from onnx_partition.cost.devices import CUDA_CONTEXT_GB

    return f"less {values.fmt_bytes(CUDA_CONTEXT_GB * 1e9)} for the CUDA context"


def _cluster_and_sources(options: DeviceOptions
                         ) -> tuple[Cluster | Fleet | None, dict[str, str]]:
    """The cluster of a file (or the API's fleet), else of the options (None: a plain
    pipeline), and the sources of its memory and links."""
    if options.cluster is None and options.fleet is None:
        return _options_cluster(options)
    here = _here(options)
    if options.fleet is not None:
        cluster: Cluster | Fleet = options.fleet
    else:
        assert options.cluster is not None
        cluster = load_cluster(options.cluster)
    sources: dict[str, str] = {}
    if isinstance(cluster, Fleet):  # each group names its GPU, memory and link
        if options.gpu:
            raise PartitionError("--gpu prices one kind of GPU; a fleet's groups name "
                                 "theirs (cluster.json groups[].gpu)")
        sources["memory"] = f"per group ({here}; a group without memory_gb: its datasheet)"
        sources["link"] = f"per group ({here})"
        sources["inter_link"] = f"{_link_text(cluster.inter)} ({here})"
        return cluster, sources
    from onnx_partition.cost.devices import CUDA_CONTEXT_GB, gpu_spec

    assert options.cluster is not None  # a Cluster object is resolved as options
    if options.gpu:
        cluster = dataclasses.replace(cluster, gpu=options.gpu)
    given = set(json.loads(Path(options.cluster).read_text(encoding="utf-8")))
    changes: dict[str, Any] = {}
    if cluster.gpu:
        _, spec = gpu_spec(cluster.gpu)
        if "memory_gb" not in given:
            changes["memory_gb"] = spec.memory_gb - CUDA_CONTEXT_GB
        if "intra" not in given:
            changes["intra"] = _gpu_link(cluster.gpu)[0]
    cluster = dataclasses.replace(cluster, **changes)
    size = (f"{values.fmt_bytes(cluster.memory_bytes)} per device"
            if math.isfinite(cluster.memory_gb) else "unlimited")
    named = cluster.gpu or ""
    sources["memory"] = (f"{size} (datasheet of the {gpu_spec(named)[1].name}, "
                         f"{_less_context()})" if "memory_gb" in changes
                         else f"{size} ({here})")
    sources["link"] = (f"{_link_text(cluster.intra)} "
                       f"({_gpu_link(named)[1] if 'intra' in changes else here})")
    sources["inter_link"] = f"{_link_text(cluster.inter)} ({here})"
    return cluster, sources


def _options_cluster(options: DeviceOptions) -> tuple[Cluster | None, dict[str, str]]:
    """The cluster of ``--devices``, ``--machines`` and the memory and link options (None
    without ``--devices``: a plain pipeline), and the sources of its memory and links."""
    from onnx_partition.cost.devices import CUDA_CONTEXT_GB, gpu_spec

    sources: dict[str, str] = {}
    if options.gpu and options.device_kind == "cpu":
        raise PartitionError("--gpu prices a GPU; it cannot go with --device-kind cpu")
    inter = options.inter_bandwidth is not None or options.inter_latency is not None
    if options.devices is None:
        if options.machines not in (None, 1):  # it would be silently one device per stage
            raise PartitionError(f"--machines {options.machines} needs --devices N (devices "
                                 f"per machine: the plan may use N x {options.machines}) or "
                                 "--cluster FILE")
        if options.device_memory or inter:  # (--mode train alone: a plain train-mode pipeline)
            raise PartitionError("--device-memory and --inter-bandwidth/latency "
                                 "need --devices N or --cluster")
        return None, sources
    default = Cluster()
    machines = default.machines if options.machines is None else options.machines
    if options.devices < 1 or machines < 1:
        raise PartitionError("--devices and --machines must be at least 1")
    for name, value in (("--inter-bandwidth", options.inter_bandwidth),
                        ("--inter-latency", options.inter_latency)):
        if value is not None and not value >= 0:
            raise PartitionError(f"{name} must be >= 0, got {value}")
    memory: float
    if options.device_memory:
        given = options.device_memory
        memory = parse_bytes(given) / 1e9 if isinstance(given, str) else given
        if isinstance(given, str):
            log.info(f"device memory {given!r} read as "
                     f"{values.fmt_bytes(memory * 1e9)} ({memory * 1e9:,.0f} bytes) per device")
        sources["memory"] = f"{values.fmt_bytes(memory * 1e9)} per device (--device-memory)"
    elif options.gpu:
        spec = gpu_spec(options.gpu)[1]
        memory = spec.memory_gb - CUDA_CONTEXT_GB
        sources["memory"] = (f"{values.fmt_bytes(memory * 1e9)} per device (datasheet of the "
                             f"{spec.name}, {_less_context()}; --device-memory to change)")
    else:
        memory = default.memory_gb
        sources["memory"] = "unlimited (default; --device-memory or --gpu NAME to set)"
    intra, sources["link"] = _link_and_source(options, options.gpu)
    inter_link = Link(
        default.inter.bandwidth_gbps if options.inter_bandwidth is None
        else options.inter_bandwidth,
        default.inter.latency_ms if options.inter_latency is None else options.inter_latency)
    sources["inter_link"] = f"{_link_text(inter_link)} ({'options' if inter else 'default'})"
    speed = default.speed if options.speed is None else options.speed
    return Cluster(machines=machines, devices_per_machine=options.devices, memory_gb=memory,
                   kind=device_kind_of(options), gpu=options.gpu, intra=intra,
                   inter=inter_link, speed=speed), sources
