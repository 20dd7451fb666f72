"""One training job (issue 32, item 1): every ``train`` option and its ``train_plan`` keyword set
the same field of the same :class:`~onnx_partition.settings.train.TrainJob`, a torchrun rank's
options give the job the local verb gives, and no default of a training setting is written as a
literal outside :mod:`onnx_partition.settings` (each default written once)."""

from __future__ import annotations

import argparse
import dataclasses
import inspect
from pathlib import Path
from typing import Any

import pytest
from support.cli import parser_that_never_runs_a_verb, verb_parsers
from support.defaults import literal_defaults

from onnx_partition.cli.args import rank_parser, train_options
from onnx_partition.plan.planfile import DEFAULT_MICROBATCHES
from onnx_partition.request.train import (
    KEYWORDS,
    job_keywords,
    keyword_defaults,
    resolve_job,
    train_job,
)
from onnx_partition.runtime.train.trainer import train_plan
from onnx_partition.settings.train import DEFAULTS, TRAIN_FALLBACKS, TrainJob

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "onnx_partition"

#: ``train_plan``'s keywords before the job (issue 32): each keeps working.
EARLIER_KEYWORDS = (
    "nproc", "steps", "microbatches", "batch_size", "schedule", "optimizer", "lr", "check",
    "save", "record", "engine", "seed", "verbose", "backend", "timeout_s", "data", "shuffle",
    "loss", "loss_fn", "weight_decay", "momentum", "betas", "warmup_steps", "lr_schedule",
    "clip_grad_norm", "precision", "checkpoint_dir", "checkpoint_every", "resume", "eval_every",
    "eval_data", "log", "progress", "hook")

#: Where a training setting's name may keep a literal default, with the reason.
ALLOWED = {
    ("runtime/train/results.py", "predicted_stages", "microbatches"):
        "one micro-batch: the figure without the accumulation's share, not the run's count",
    ("cli/verbs.py", "_check", "microbatches"):
        "run --check's whole-model comparison (inference), not a training setting",
    ("request/partition.py", "PartitionOptions", "check"):
        "partition's check of the stage files it writes, not train's --check",
}


def _train_action_value(action: argparse.Action) -> tuple[list[str], Any]:
    """A value for ``action`` other than its default: the words to type, the value parsed."""
    flag = action.option_strings[-1]
    if isinstance(action, argparse._StoreTrueAction):
        return [flag], True
    if action.choices:
        value = [c for c in action.choices if c != action.default][-1]  # not sgd, fp32, 1f1b
        return [flag, value], value
    if action.nargs == 2:
        return [flag, "0.5", "0.6"], (0.5, 0.6)
    if action.type is Path or (action.type is None and action.metavar in ("FILE", "DIR")):
        return [flag, "some/where"], Path("some/where")
    number = 3 if "int" in repr(action.type) else 0.5
    return [flag, str(number)], number


def _actions(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions if a.option_strings and a.dest != "help"]


def _train_actions() -> list[argparse.Action]:
    """``train``'s own options (those every verb has, -v and -q, left out)."""
    verbs = verb_parsers(parser_that_never_runs_a_verb())
    common = set.intersection(*({a.dest for a in _actions(p)} for p in verbs.values()))
    return [a for a in _actions(verbs["train"]) if a.dest not in common]


def _cli_job(argv: list[str]) -> TrainJob:
    args = parser_that_never_runs_a_verb().parse_args(["train", "plan", *argv])
    return train_job(**train_options(args))


@pytest.mark.parametrize("dest", [a.dest for a in _train_actions()])
def test_every_option_and_its_keyword_give_the_same_job(dest: str) -> None:
    """The option changes the keyword of its ``dest`` and nothing else (``--json`` also turns
    the per-step line and the bar off), the field the API keyword sets."""
    action = next(a for a in _train_actions() if a.dest == dest)
    assert dest in KEYWORDS, f"--{dest} has no train_plan keyword"
    words, value = _train_action_value(action)
    bare, told = _cli_job([]), _cli_job(words)
    changed = {dest: value, **({"verbose": False, "progress": False} if dest == "json" else {})}
    assert told != bare, dest
    assert {k: v for k, v in job_keywords(told).items() if job_keywords(bare)[k] != v} == changed
    assert train_job(**{**job_keywords(bare), **changed}) == told


def test_train_plan_takes_every_keyword_with_the_jobs_defaults() -> None:
    params = inspect.signature(train_plan).parameters
    assert set(EARLIER_KEYWORDS) <= set(params)
    assert {k: params[k].default for k in KEYWORDS} == keyword_defaults()
    assert all(params[k].default is None for k in TRAIN_FALLBACKS)  # the plan's
    with pytest.raises(TypeError, match="'stepz'"):
        train_plan("plan", stepz=3)


def test_keywords_build_the_tree_and_back() -> None:
    job = train_job(optimizer="adamw", lr=0.5, checkpoint_dir="ck", eval_data="e.npz", log="l",
                    engine="torch", steps=4)
    assert (job.optimizer.name, job.optimizer.lr, job.checkpoint.dir, job.data.eval_file,
            job.logging.file, job.engine.name, job.steps) == (
        "adamw", 0.5, "ck", "e.npz", "l", "torch", 4)
    assert train_job(**job_keywords(job)) == job
    assert train_job() == DEFAULTS


def test_a_job_resolves_to_the_plans_count_not_four() -> None:
    """A plan that records nothing: the fallbacks and the plan's default count (the earlier
    ``TrainConfig`` said 4 micro-batches where every plan says 8)."""
    job, warning = resolve_job(train_job(), None)
    assert warning is None
    assert (job.optimizer.name, job.engine.precision, job.schedule.name) == (
        TRAIN_FALLBACKS["optimizer"], TRAIN_FALLBACKS["precision"], TRAIN_FALLBACKS["schedule"])
    assert job.schedule.microbatches == DEFAULT_MICROBATCHES == 8
    assert resolve_job(train_job(microbatches=3), None)[0].schedule.microbatches == 3


def test_a_torchrun_rank_parses_the_job_the_verb_does() -> None:
    """The same options give the same job; the rank's only difference is its output: rank 0's
    line per step, no progress bar (a torchrun rank's output goes through the launcher)."""
    argv = ["--steps", "3", "--microbatches", "2", "--batch-size", "4", "--schedule", "gpipe",
            "--optimizer", "adamw", "--lr", "0.5", "--seed", "7", "--data", "d.npz",
            "--shuffle", "2", "--loss", "mse", "--check", "--betas", "0.5", "0.6",
            "--warmup-steps", "1", "--lr-schedule", "cosine", "--clip-grad-norm", "1.5",
            "--precision", "bf16", "--checkpoint-dir", "ck", "--checkpoint-every", "2",
            "--resume", "ck", "--eval-every", "1", "--eval-data", "e.npz", "--log", "l.jsonl"]
    local = _cli_job(argv)
    rank = train_job(**train_options(rank_parser("train").parse_args(["plan", *argv]),
                                     rank=True))
    assert dataclasses.replace(local, logging=rank.logging) == rank
    assert rank.logging == dataclasses.replace(local.logging, progress=False)
    assert local.logging.verbose and local.logging.progress


# ---------------------------------------------------------------- no default written twice


def test_the_check_sees_a_literal_default() -> None:
    source = ("def f(x, lr: float = 0.01, *, betas=(0.9, 0.999), seed=-1, steps=None): pass\n"
              "class C:\n    momentum: float = 0.0\n    lr: float = DEFAULTS.optimizer.lr\n"
              "def _train_args(p):\n"
              "    p.add_argument('--warmup-steps', type=int, default=0)\n"
              "    p.add_argument('--log', '--log-file', dest='log', default='x')\n"
              "def _other_args(p):\n    p.add_argument('--seed', type=int, default=0)\n")
    assert sorted(literal_defaults(source, set(KEYWORDS))) == sorted(
        [("f", "lr"), ("f", "betas"), ("f", "seed"), ("C", "momentum"),
         ("--warmup_steps", "warmup_steps"), ("--log", "log")])


def test_no_training_default_is_written_outside_the_settings() -> None:
    """The training runtime, the request and the command line take every default of a
    training setting (a ``train_plan`` keyword) from :mod:`onnx_partition.settings.train`."""
    files = [*(PACKAGE / "runtime" / "train").rglob("*.py"), *(PACKAGE / "request").rglob("*.py"),
             *(PACKAGE / "cli").rglob("*.py")]
    assert len(files) > 20
    found = {(path.relative_to(PACKAGE).as_posix(), owner, name) for path in files
             for owner, name in literal_defaults(path.read_text(), set(KEYWORDS))}
    assert not found - set(ALLOWED), "\n".join(map(str, sorted(found - set(ALLOWED))))
    assert set(ALLOWED) <= found, f"stale allowances: {set(ALLOWED) - found}"
