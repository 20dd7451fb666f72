"""A train costs file written by hand, with the ``engine`` ``profile --mode train`` measures
(optimizer steps, accumulation, the two-process link and the engine probe)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from onnx_partition.plan.contracts import COSTS_FORMAT

__all__ = ["probed_engine", "write_train_costs"]


def probed_engine(probe_barrier_ms: float = 0.25) -> dict[str, Any]:
    """1000 parameter bytes stepped in 2 ms (AdamW) or 1 ms (SGD), accumulated in 0.5 ms; a
    0.25 ms barrier; hops of 0.5 ms at 1 B to 1.5 ms at 1,000,001 B; the probe's 0.3 ms per
    action, ``probe_barrier_ms`` per barrier and 2 ms per hop."""
    return {"parameter_bytes": 1000, "optimizer_ms": {"adamw": 2.0, "sgd": 1.0},
            "accumulate_ms": 0.5, "barrier_ms": 0.25,
            "link": {"latency_ms": 0.5, "bandwidth_gbps": 1.0, "sizes": [1, 1_000_001],
                     "one_way_ms": [0.5, 1.5]},
            "probe": {"action_ms": 0.3, "barrier_ms": probe_barrier_ms, "hop_ms": 2.0}}


def write_train_costs(path: Path, engine: Mapping[str, Any],
                      nodes: Mapping[str, Any]) -> Path:
    """A CPU train costs file at ``path`` with ``engine`` and per-node ``nodes``."""
    path.write_text(json.dumps({"format": COSTS_FORMAT, "unit": "ms", "mode": "train",
                                "device": "cpu", "engine": dict(engine),
                                "nodes": dict(nodes)}))
    return path
