"""``--engine torch``: refused, with the reason.

The aim was the same stage modules on ``torch.distributed.pipelining`` (``PipelineStage``,
``Schedule1F1B``/``ScheduleGPipe``) with DDP over each stage's replicas, on uniform grids only
(pipelining maps stage ``i`` to rank ``i`` of one group). An attempt (commit 4d3f604,
``train_stages_torch``) wrapped each stage so that it takes and returns our layout's hop tensors
as positional tuples (relays included). On torch 2.13 with gloo it did not work: run-time
metadata inference hung in ``send_object_list`` during backward-metadata inference, and with
static metadata (example tuples made by chaining the stages locally) the forward ran but the
gradient exchange deadlocked in ``_wait_batch_p2p`` whenever a hop carried a tensor that needs
no gradient (a model input relayed to a later stage): the receiving stage sends a zero gradient
for every received input while the sender posts receives only for outputs requiring grad.
"""

from __future__ import annotations

from onnx_partition.plan import Plan

__all__ = ["REASON", "torch_engine_refusal"]

REASON = ("torch.distributed.pipelining (torch 2.13, gloo) deadlocks on our stages' tuples of "
          "named tensors; use --engine ours")


def torch_engine_refusal(plan: Plan) -> str:
    """Why the plan cannot run on torch's pipelining engine (always, for now)."""
    counts = sorted({max(1, s.replicas) for s in plan.stages})
    if len(counts) > 1:
        return (f"torch.distributed.pipelining maps stage i to rank i of one group, so every "
                f"stage needs the same replica count; this plan has {counts} (use --engine ours)")
    return REASON
