"""Per-node costs on each GPU kind of a mixed fleet (cluster@2 ``groups``).

Every group is priced by its own GPU: a costs file measured on that kind when one is given
(``partition --costs KIND=FILE``, keyed by the group's ``gpu``; a plain ``--costs FILE`` when the
fleet has one kind only), else the datasheet roofline of :mod:`onnx_partition.cost.devices`.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from onnx_partition.cost.analytic import DeviceSpec
from onnx_partition.cost.annotate import CostsFile, CostsLike, NodeCosts, annotate, load_costs
from onnx_partition.cost.aten import with_aten_backward
from onnx_partition.cost.cluster import Fleet
from onnx_partition.cost.costs_file import check_costs, rescale
from onnx_partition.cost.devices import for_precision, gpu
from onnx_partition.errors import PartitionError
from onnx_partition.graph import OpGraph
from onnx_partition.settings.partition import TrainSpec

__all__ = ["costs_by_kind", "kind_devices", "price_kinds"]


def costs_by_kind(fleet: Fleet, costs: CostsLike | None,
                  keyed: Mapping[str, CostsLike] | None) -> dict[str, CostsFile | None]:
    """Each kind of ``fleet`` -> its costs file (read once), or None for the roofline. A plain
    ``costs`` file serves a one-kind fleet only; a key that is no group's ``gpu`` is an
    error naming the kinds."""
    kinds = fleet.kinds
    keyed = dict(keyed or {})
    unknown = [k for k in keyed if k not in kinds]
    if unknown:
        raise PartitionError(f"--costs {unknown[0]}=FILE: no group of the fleet has gpu "
                             f"{unknown[0]!r} (its kinds: {', '.join(kinds)})")
    if costs is not None:
        if len(kinds) > 1 or keyed:
            raise PartitionError(f"the fleet has {len(kinds)} GPU kinds "
                                 f"({', '.join(kinds)}): give a costs file per kind, "
                                 f"--costs {kinds[0]}=FILE ..., or none (datasheet roofline)")
        keyed[kinds[0]] = costs
    return {k: load_costs(keyed[k]) if k in keyed else None for k in kinds}


def kind_devices(files: Mapping[str, CostsFile | None], precision: str = TrainSpec().precision
                 ) -> dict[str, DeviceSpec | None]:
    """Each kind's roofline as a run in ``precision`` uses it
    (:func:`~onnx_partition.cost.devices.for_precision`), None where a costs file prices it."""
    return {kind: None if file is not None else for_precision(gpu(kind), precision)
            for kind, file in files.items()}


def price_kinds(graph: OpGraph, files: Mapping[str, CostsFile | None], *,
                strict: bool = False, precision: str = TrainSpec().precision,
                model: Path | None = None, loaded: Any = None
                ) -> tuple[dict[str, NodeCosts], dict[str, Any]]:
    """Per kind, the per-node costs (its file checked against ``graph`` and rescaled to its
    shapes, or its GPU's roofline in ``precision``, the backward per aten op of ``model``'s
    program where given, :func:`~onnx_partition.cost.aten.with_aten_backward`, as a train
    plan of one kind is priced) and plan.json's ``device_model`` (a ``warning`` where a file
    was measured on no GPU; :class:`PartitionError` then if ``strict``)."""
    priced: dict[str, NodeCosts] = {}
    models: dict[str, Any] = {}
    warnings = []
    devices = kind_devices(files, precision)
    for kind, file in files.items():
        spec = devices[kind]
        if spec is not None:
            priced[kind] = annotate(graph, device=spec)
            aten = False
            if model is not None:
                priced[kind], aten = with_aten_backward(graph, priced[kind], model, spec,
                                                        loaded)
            models[kind] = {"source": "analytic", "name": spec.name, "kind": "cuda",
                            "peak_tflops": spec.peak_gflops / 1e3, "mem_gbps": spec.mem_gbps,
                            "launch_overhead_ms": spec.launch_overhead_ms,
                            **({"backward": "per aten op"} if aten else {})}
            continue
        assert file is not None  # kind_devices: no spec where a file prices the kind
        checked = check_costs(file, graph)
        priced[kind] = rescale(annotate(graph, device=gpu(kind), costs=file), graph,
                               list(file.nodes), checked.scale)
        models[kind] = {"source": "costs", "file": file.path, "measured_on": file.device}
        if file.device is not None and file.device.split(":")[0] != "cuda":
            warnings.append(f"costs file {file.path} for {kind} was measured on {file.device}, "
                            "not a GPU: its times may not fit it")
    if warnings and strict:
        raise PartitionError(warnings[0] + " (--strict-costs)")
    body = {"source": "kinds", "kinds": models}
    return priced, body | ({"warning": "; ".join(warnings)} if warnings else {})
