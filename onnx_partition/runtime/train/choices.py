"""The training runtime's named choices, importable without torch: the command line's parser
lists them (``train --optimizer/--engine/--loss``; schedules are
:data:`onnx_partition.pipeline.schedules.TRAIN_NAMES`) before anything runs, and the runtime
checks a request against the same tuples."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from onnx_partition.pipeline.schedules import TRAIN_NAMES

__all__ = ["ENGINES", "LOSSES", "OPTIMIZERS", "PRECISIONS", "TORCH_RUNS", "TORCH_SCHEDULES",
           "TRAIN_FALLBACKS", "WEIGHT_DECAY", "PlannedChoiceWarning", "planned_choices"]

#: Optimizers by CLI name (:func:`onnx_partition.runtime.train.reference.make_optimizer`).
OPTIMIZERS = ("sgd", "adamw")
#: Each optimizer's weight decay where ``--weight-decay`` is not given (``torch.optim``'s).
WEIGHT_DECAY = {"sgd": 0.0, "adamw": 0.01}
#: ours (any plan); torch (``torch.distributed.pipelining``, uniform plans: ``torch_engine``).
ENGINES = ("ours", "torch")
#: Schedules only ``--engine torch`` runs (torch's ``ScheduleInterleavedZeroBubble``).
TORCH_SCHEDULES = ("interleaved-zb",)
#: Losses by CLI name (:mod:`onnx_partition.runtime.train.loss`).
LOSSES = ("auto", "cross_entropy", "mse", "output")
#: Training precisions (``train --precision``): fp32, or bfloat16 autocast over fp32 weights.
PRECISIONS = ("fp32", "bf16")

#: What ``train`` uses when neither the caller nor the plan (plan.json's ``optimizer``,
#: ``precision``, ``schedule``: what it was priced for) says.
TRAIN_FALLBACKS = {"optimizer": "sgd", "precision": "fp32", "schedule": "1f1b"}
#: The plan schedules that ``--engine torch`` runs as planned (torch pipelining's own classes).
TORCH_RUNS = ("1f1b", "gpipe")
#: plan.json's names of what a plan assumed -> train's choices (plan@2's first plans: "adam").
_TRAIN_NAMES = {"adam": "adamw"}


class PlannedChoiceWarning(UserWarning):
    """``train_plan`` told an optimizer, precision or schedule other than the plan's."""


def planned_choices(recorded: Mapping[str, Any], given: Mapping[str, str | None], *,
                    engine: str | None = None, spelled: str = "--{key} {value}"
                    ) -> tuple[dict[str, str], str | None]:
    """The optimizer, precision and schedule a training run uses: each of ``given`` that is
    not None, else what the plan was priced for (``recorded``: the plan's extra keys), else
    :data:`TRAIN_FALLBACKS` (``engine`` torch: a planned schedule torch pipelining has not,
    1F1B). Also one warning line when a given choice differs from the plan's (its predicted
    time and memory do not hold), naming the choices as ``spelled`` (the command line's
    options, or the API's keywords). The one rule of ``train`` and :func:`train_plan`."""
    chosen: dict[str, str] = {}
    differ = []
    for key, fallback in TRAIN_FALLBACKS.items():
        planned = recorded.get(key)
        planned = _TRAIN_NAMES.get(planned, planned) if isinstance(planned, str) else None
        if key == "schedule" and planned not in TRAIN_NAMES:
            planned = None  # an inference plan's "infer": train says what is wrong
        value = given.get(key)
        if value is None and key == "schedule" and planned not in (None, *TORCH_RUNS) \
                and engine == "torch":
            value = fallback  # torch pipelining has no such schedule: 1F1B, and warned
        if value is not None and planned and value != planned:
            differ.append((key, value, planned))
        chosen[key] = value if value is not None else planned or fallback
    if not differ:
        return chosen, None
    told = ", ".join(spelled.format(key=k, value=g) for k, g, _ in differ)
    assumed = ", ".join(f"{k} {p}" for k, _, p in differ)
    return chosen, (f"warning: training with {told}; the plan was priced for {assumed} "
                    "(plan.json): its predicted time and memory assume those")
