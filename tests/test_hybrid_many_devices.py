"""The hybrid DP past 16,000 devices (issue 34 item 4: Llama-3-405B on 16,384 H100): its device
counts were int16, with 15,999 the most it could plan."""

from __future__ import annotations

import pytest

from onnx_partition.solve import hybrid_tables
from onnx_partition.solve.hybrid import HybridConfig, SequenceCosts, solve_hybrid

#: 16 blocks of 1 ms forward and 2 ms backward, nothing to transfer or all-reduce
_N = 16
_COSTS = SequenceCosts([1.0] * _N, [2.0] * _N, [0.0] * _N, [1.0] * _N, [0.0] * (_N + 1))


@pytest.mark.parametrize("devices", [16_384, 16_500])
def test_sixteen_stages_of_1024_replicas_on_16384_devices(devices):
    """With M = 1,024 micro-batches the least period is one block's 3 ms over M, and only 16
    stages of one block on 1,024 replicas each reach it: 16,384 devices."""
    config = HybridConfig(devices=devices, microbatches=1024, train=True)
    solved = solve_hybrid(_COSTS, config)
    assert solved.exact
    assert solved.period_ms == 3.0 / 1024
    best = solved.plans[0]
    assert [(s.start, s.end, s.replicas) for s in best] == [(i, i + 1, 1024) for i in range(_N)]
    assert sum(s.replicas for s in best) == 16_384


def test_bounded_dp_on_16384_devices(monkeypatch):
    """The same under a memory limit, the DP bounded (its tables too large): a block stashes 1
    byte per micro-batch in flight within 64, so memory could bind (all 1,024 in flight) but
    does not at the optimum (each replica holds one): the plan and the relaxation's lower bound
    are the least period."""
    monkeypatch.setattr(hybrid_tables, "EXACT_CELLS", 0)
    config = HybridConfig(devices=16_384, microbatches=1024, train=True, memory_bytes=64.0)
    solved = solve_hybrid(_COSTS, config)
    assert not solved.exact
    assert solved.period_ms == solved.lower_ms == 3.0 / 1024
    best = solved.plans[0]
    assert [(s.start, s.end, s.replicas) for s in best] == [(i, i + 1, 1024) for i in range(_N)]
    assert max(s.memory_bytes for s in best) == 1.0
