"""The engine's fixed costs read from a rank's spans (runtime/train/overheads.py): exact answers
on hand-made steps, and the identity that puts a real run's step back together."""

from __future__ import annotations

import pytest
from support.spans import Result

from onnx_partition.runtime.train.overheads import RankOverheads, barrier_ms, rank_overheads


def _tail(norm: float) -> dict[str, float]:
    return {"sends_ms": 0.5, "grad_sum_ms": 0.0, "norm_ms": norm, "optimizer_ms": 2.0}


def test_hand_made_steps_give_exact_means() -> None:
    # steps 0 and 1 are left out (the memory tracker's: overheads.timed_from); steps 2 and 3:
    # two actions each
    warm = [("0F0", 0.0, 50.0, 0.0), ("0B0", 50.0, 90.0, 0.0)]
    spans = [warm, warm,
             [("0F0", 1.0, 5.0, 1.0), ("0B0", 6.0, 12.0, 0.5)],
             [("0F0", 1.0, 6.0, 0.0), ("0B0", 7.0, 14.0, 1.5)]]
    result = Result(0, [100.0, 100.0, 20.0, 22.0], [40.0, 40.0, 2.0, 3.0],
                    [40.0, 40.0, 4.0, 5.0], spans, [_tail(1.0), _tail(1.0), _tail(2.0),
                                                    _tail(3.0)])
    got = rank_overheads(result)
    # step 2: end 12, compute 6, blocked 1.5 -> work 4.5; step 3: end 14, compute 8, blocked 1.5
    # -> work 4.5; per action 2.25. tails 4.5 and 5.5, so closing 20 - 12 - 4.5 = 3.5 and
    # 22 - 14 - 5.5 = 2.5
    assert got == RankOverheads(stage=0, step_ms=21.0, compute_ms=7.0, blocked_ms=1.5,
                                actions=2, action_ms=2.25, sends_ms=0.5, grad_sum_ms=0.0,
                                norm_ms=2.5, optimizer_ms=2.0, closing_ms=3.0)


def test_barrier_is_what_the_last_rank_pays() -> None:
    one = rank_overheads(Result(0, [10.0], [1.0], [1.0], [[("0F0", 0.0, 3.0, 0.0)]],
                                [_tail(4.0)]))
    two = rank_overheads(Result(1, [10.0], [1.0], [1.0], [[("1F0", 0.0, 3.0, 0.0)]],
                                [_tail(1.0)]))
    # closing: 10 - 3 - 6.5 = 0.5 and 10 - 3 - 3.5 = 3.5: least norm 1, least closing 0.5
    assert barrier_ms([one, two]) == pytest.approx(0.75)
    assert barrier_ms([]) == 0.0


def test_a_result_without_spans_is_refused() -> None:
    with pytest.raises(ValueError, match="one span list"):
        rank_overheads(Result(0, [1.0], [0.5], [0.5], []))
