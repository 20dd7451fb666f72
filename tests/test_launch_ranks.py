"""Which failure the launcher names when every rank fails with an undeclared (communication)
error: the one where the run broke, not a peer's loss that followed it."""

from __future__ import annotations

import pytest
from support.ranks import fail_after

from onnx_partition.errors import StageFailed
from onnx_partition.runtime.launch.ranks import launch_ranks


@pytest.mark.parametrize("first", [0, 1])
def test_the_error_that_is_not_a_lost_peer_is_named(first: int) -> None:
    """Rank ``first`` loses its peer at once; the other fails later with the error that broke
    the run (gloo's "input tensor has to be contiguous", the cause once seen in CI)."""
    lost = ("Connection closed by peer [127.0.0.1]:1234. This is typically caused by a remote "
            "worker crashing.")
    args = [(2, 0.0, lost), (2, 0.0, lost)]
    args[1 - first] = (2, 0.1, "input tensor has to be contiguous")
    with pytest.raises(StageFailed) as failed:
        launch_ranks(fail_after, args, lambda rank: f"rank {rank}", timeout_s=30)
    assert str(failed.value) == f"rank {1 - first} failed: input tensor has to be contiguous"


def test_among_lost_peers_the_first_to_arrive_is_named() -> None:
    """Only lost peers: the first report names the rank."""
    args = [(2, 0.3, "Connection reset by peer"), (2, 0.0, "Connection closed by peer")]
    with pytest.raises(StageFailed) as failed:
        launch_ranks(fail_after, args, lambda rank: f"rank {rank}", timeout_s=30)
    assert str(failed.value) == "rank 1 failed: Connection closed by peer"
