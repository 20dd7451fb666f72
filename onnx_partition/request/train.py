"""A training run's request: the :class:`~onnx_partition.settings.train.TrainJob` built from
the flat keywords that ``train_plan`` takes and ``train``'s options give (:func:`train_job`),
and resolved against the plan (:func:`resolve_job`): the optimizer, precision and schedule
not given are what the plan was priced for (:func:`planned_choices`, the one rule of the
command line and the API), the micro-batches and rows per micro-batch the plan's own."""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Mapping
from typing import Any

from onnx_partition.pipeline.schedules import TRAIN_NAMES
from onnx_partition.plan import Plan
from onnx_partition.plan.planfile import DEFAULT_MICROBATCHES
from onnx_partition.settings.train import ROWS_FALLBACK, TRAIN_FALLBACKS, TrainJob

__all__ = ["API_SPELLING", "CLI_SPELLING", "KEYWORDS", "TORCH_RUNS", "PlannedChoiceWarning",
           "job_keywords", "keyword_defaults", "planned_choices", "resolve_job", "train_job",
           "warn_planned"]

#: The plan schedules that ``--engine torch`` runs as planned (torch pipelining's own classes).
TORCH_RUNS = ("1f1b", "gpipe")
#: How a choice is named in the warning: as the command line's option, or the API's keyword.
CLI_SPELLING = "--{key} {value}"
API_SPELLING = "{key}={value!r}"
#: plan.json's names of what a plan assumed -> train's choices (plan@2's first plans: "adam").
_TRAIN_NAMES = {"adam": "adamw"}


def _keywords() -> dict[str, tuple[str | None, str]]:
    """Every flat keyword -> (its group of :class:`TrainJob`, None for the job's own fields;
    the field's name), read from the dataclasses (the group's field metadata ``keyword``)."""
    table: dict[str, tuple[str | None, str]] = {}
    for top in dataclasses.fields(TrainJob):
        group = top.default_factory
        if group is dataclasses.MISSING:
            table[top.name] = (None, top.name)
            continue
        for leaf in dataclasses.fields(group):  # type: ignore[arg-type]
            key = leaf.metadata.get("keyword", leaf.name)
            assert key not in table, f"two settings named {key!r}"
            table[key] = (top.name, leaf.name)
    return table


#: ``train_plan``'s keywords (``train``'s option dests) -> where each lives in a TrainJob.
KEYWORDS: Mapping[str, tuple[str | None, str]] = _keywords()


def train_job(**keywords: Any) -> TrainJob:
    """The job of ``keywords`` (:data:`KEYWORDS`; every one not given: its default); a
    TypeError names a keyword that is none of them, as a function's call would."""
    unknown = sorted(set(keywords) - set(KEYWORDS))
    if unknown:
        raise TypeError(f"unexpected keyword argument {unknown[0]!r}; a training run takes "
                        f"{', '.join(KEYWORDS)}")
    top: dict[str, Any] = {}
    groups: dict[str, dict[str, Any]] = {}
    for key, value in keywords.items():
        group, name = KEYWORDS[key]
        if group is None:
            top[name] = value
        else:
            groups.setdefault(group, {})[name] = value
    made = {name: _group_type(name)(**values) for name, values in groups.items()}
    return TrainJob(**top, **made)


def _group_type(name: str) -> Any:
    return next(f.default_factory for f in dataclasses.fields(TrainJob) if f.name == name)


def job_keywords(job: TrainJob) -> dict[str, Any]:
    """The inverse of :func:`train_job`: every keyword's value in ``job``."""
    return {key: getattr(job if group is None else getattr(job, group), name)
            for key, (group, name) in KEYWORDS.items()}


def keyword_defaults() -> dict[str, Any]:
    """Every keyword's default (``train_plan``'s signature)."""
    return job_keywords(TrainJob())


class PlannedChoiceWarning(UserWarning):
    """``train_plan`` told an optimizer, precision or schedule other than the plan's."""


def planned_choices(recorded: Mapping[str, Any], given: Mapping[str, str | None], *,
                    engine: str | None = None, spelled: str = CLI_SPELLING
                    ) -> tuple[dict[str, str], str | None]:
    """The optimizer, precision and schedule a training run uses: each of ``given`` that is
    not None, else what the plan was priced for (``recorded``: the plan's extra keys), else
    :data:`TRAIN_FALLBACKS` (``engine`` torch: a planned schedule torch pipelining has not,
    1F1B). Also one warning line when a given choice differs from the plan's (its predicted
    time and memory do not hold), naming the choices as ``spelled`` (the command line's
    options, or the API's keywords). The one rule of ``train`` and ``train_plan``."""
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


def priced_for(plan: Plan) -> dict[str, str]:
    """What ``plan`` was priced for, as :func:`planned_choices` reads it: plan.json's
    ``optimizer``, ``precision`` and ``schedule`` where it records them."""
    recorded = {"optimizer": plan.optimizer, "precision": plan.precision,
                "schedule": plan.schedule}
    return {k: v for k, v in recorded.items() if v is not None}


def resolve_job(job: TrainJob, plan: Plan | None, *, spelled: str = CLI_SPELLING
                ) -> tuple[TrainJob, str | None]:
    """``job`` with the optimizer, precision and schedule (:func:`planned_choices`), the
    micro-batches per step and the rows per micro-batch (the plan's own, else
    :data:`ROWS_FALLBACK`) filled in from ``plan`` (None: a plan that records nothing), and
    :func:`planned_choices`' warning line."""
    given = {"optimizer": job.optimizer.name, "precision": job.engine.precision,
             "schedule": job.schedule.name}
    chosen, warning = planned_choices({} if plan is None else priced_for(plan), given,
                                      engine=job.engine.name, spelled=spelled)
    count = job.schedule.microbatches or (DEFAULT_MICROBATCHES if plan is None
                                          else plan.microbatches)
    rows = (job.schedule.batch_size or (None if plan is None else plan.rows_per_microbatch)
            or ROWS_FALLBACK)
    return dataclasses.replace(
        job, optimizer=dataclasses.replace(job.optimizer, name=chosen["optimizer"]),
        engine=dataclasses.replace(job.engine, precision=chosen["precision"]),
        schedule=dataclasses.replace(job.schedule, name=chosen["schedule"], microbatches=count,
                                     batch_size=rows)), warning


def warn_planned(warning: str | None, stacklevel: int = 3) -> None:
    """Say :func:`resolve_job`'s warning line as a :class:`PlannedChoiceWarning` (the API's)."""
    if warning:
        warnings.warn(warning, PlannedChoiceWarning, stacklevel=stacklevel)
