"""Issue 21, items 3-5 on the gpt tiny recipe over real gloo groups: AdamW with warm-up, a cosine
schedule and gradient clipping (and bf16) equal to single-process training; a checkpointed run
killed after step K of 2K and resumed equals 2K steps straight; a kill while a checkpoint is
written leaves the previous one whole; a checkpoint of another plan is refused; the per-step log,
validation loss and ``train --json``."""

from __future__ import annotations

import contextlib
import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from support.checkpoints import rank_params, rank_tensors
from support.faults import ExitAt

from onnx_partition.cli import main
from onnx_partition.errors import PartitionError
from onnx_partition.plan import read_plan
from onnx_partition.request.train import PlannedChoiceWarning
from onnx_partition.runtime import StageFailed
from onnx_partition.runtime.train.checkpoint import latest_checkpoint
from onnx_partition.runtime.train.data_plan import synthetic_batch
from onnx_partition.runtime.train.lr_schedule import lr_factor
from onnx_partition.runtime.train.paths import check_log_path
from onnx_partition.runtime.train.reference import reference_train
from onnx_partition.runtime.train.task import task_for
from onnx_partition.runtime.train.trainer import train_plan

OPTIM = dict(optimizer="adamw", lr=0.01, warmup_steps=1, lr_schedule="cosine",
             clip_grad_norm=0.05, weight_decay=0.1, betas=(0.8, 0.99))


@pytest.fixture(scope="module")
def gpt_plan(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """gpt tiny exported with its program, partitioned in train mode into 2 stages."""
    root = tmp_path_factory.mktemp("train-optim")
    assert main(["export", "gpt", "--size", "tiny", "-o", str(root / "gpt.onnx")]) == 0
    assert main(["partition", str(root / "gpt.onnx"), "--stages", "2", "--mode", "train",
                 "--batch-size", "2", "-o", str(root / "plan")]) == 0
    return root / "plan"


@pytest.mark.parametrize("kind", ["constant", "linear", "cosine"])
def test_lr_factor_equals_transformers(kind: str) -> None:
    transformers = pytest.importorskip("transformers")
    make = {"constant": transformers.get_constant_schedule_with_warmup,
            "linear": transformers.get_linear_schedule_with_warmup,
            "cosine": transformers.get_cosine_schedule_with_warmup}[kind]
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    kwargs = {} if kind == "constant" else {"num_training_steps": 10}
    sched = make(opt, num_warmup_steps=3, **kwargs)
    for step in range(10):
        assert lr_factor(kind, step, 3, 10) == pytest.approx(opt.param_groups[0]["lr"], abs=1e-12)
        opt.step()
        sched.step()


def test_bf16_sgd_momentum_clipping_equal_single_process(gpt_plan: Path) -> None:
    """bf16 autocast in the stages equals bf16 autocast over the whole model (--check's
    tolerances), and is really on: the parameters differ from fp32 training's."""
    options = dict(optimizer="sgd", lr=0.1, momentum=0.9, clip_grad_norm=0.5,
                   lr_schedule="linear")
    stats = train_plan(gpt_plan, steps=2, microbatches=2, batch_size=2, check=True,
                       precision="bf16", **options)  # type: ignore[arg-type]
    assert stats.mismatches == [] and stats.checked_steps == (1,), stats.mismatches
    assert stats.grad_norm[0] > 0.5  # clipped
    task = task_for(gpt_plan)
    batches = [synthetic_batch(task.make_batch, 4, 0, 0)]
    got = {n: v for r in stats.ranks for n, v in r.states[1].items()}
    gap = {}
    for precision in ("fp32", "bf16"):
        want = reference_train(gpt_plan, batches, microbatches=2, total_steps=2,
                               precision=precision, **options)  # type: ignore[arg-type]
        gap[precision] = max(float((got[n] - want[n]).abs().max()) for n in got)
    assert gap["bf16"] < gap["fp32"], gap


def _params(folder: Path, ranks: int) -> list[dict[str, torch.Tensor]]:
    return [rank_params(folder, r) for r in range(ranks)]


def test_resume_after_a_kill_equals_straight(gpt_plan: Path, tmp_path: Path) -> None:
    """4 steps straight (AdamW, warm-up, cosine, clipping: each step's loss equals
    single-process training under the same options, clip_grad_norm_ there, within 1e-5
    relative; the clip is far below the gradient norm, so every step is clipped) vs 4 steps
    killed during step 3 (after the checkpoint of step 2) and resumed with --steps 4: the same
    parameters, bit for bit."""
    common = dict(steps=4, microbatches=2, batch_size=2, checkpoint_every=2, **OPTIM)
    straight = tmp_path / "straight"
    stats = train_plan(gpt_plan, checkpoint_dir=straight, check=True,
                       **common)  # type: ignore[arg-type]
    assert stats.mismatches == [] and stats.checked_steps == (1, 3), stats.mismatches
    assert all(n > 0.05 for n in stats.grad_norm)
    assert stats.lr == pytest.approx([0.01 * lr_factor("cosine", s, 1, 4) for s in range(4)])
    task = task_for(gpt_plan)
    want: list[float] = []
    reference_train(gpt_plan, [synthetic_batch(task.make_batch, 4, 0, s) for s in range(4)],
                    microbatches=2, total_steps=4, losses=want, **OPTIM)  # type: ignore[arg-type]
    assert stats.loss == pytest.approx(want, rel=1e-5)
    broken = tmp_path / "broken"
    with pytest.raises(StageFailed, match="exited with code 1"):
        train_plan(gpt_plan, checkpoint_dir=broken, hook=ExitAt(0, "forward", nth=5),
                   **common)  # type: ignore[arg-type]
    plan = read_plan(gpt_plan)
    assert latest_checkpoint(broken, plan)[1]["step"] == 2
    resumed = train_plan(gpt_plan, resume=broken, **common)  # type: ignore[arg-type]
    assert resumed.start_step == 2 and len(resumed.loss) == 2
    assert resumed.loss == pytest.approx(stats.loss[2:], rel=1e-6)
    assert resumed.lr == pytest.approx(stats.lr[2:])
    want, got = _params(straight / "step-00000004", 2), _params(broken / "step-00000004", 2)
    for w, g in zip(want, got):
        assert w.keys() == g.keys()
        for name in w:
            torch.testing.assert_close(g[name], w[name], rtol=0, atol=0, msg=name)


def test_a_resumed_run_keeps_the_validation_losses_before_it(gpt_plan: Path,
                                                           tmp_path: Path) -> None:
    """The checkpoint carries the validation losses so far: 2 steps, then resumed to 4, give
    the 4 evaluations of 4 steps straight (final and best over the whole run, not only the
    resumed part's)."""
    common = dict(microbatches=2, batch_size=2, eval_every=1,
                  checkpoint_every=2)
    straight = train_plan(gpt_plan, steps=4, checkpoint_dir=tmp_path / "straight",
                          **common)  # type: ignore[arg-type]
    assert [s for s, _ in straight.eval_loss] == [1, 2, 3, 4]
    out = tmp_path / "ckpt"
    first = train_plan(gpt_plan, steps=2, checkpoint_dir=out, **common)  # type: ignore[arg-type]
    manifest = latest_checkpoint(out, read_plan(gpt_plan))[1]
    assert manifest["eval_loss"] == [[s, pytest.approx(v)] for s, v in first.eval_loss]
    resumed = train_plan(gpt_plan, steps=4, resume=out, **common)  # type: ignore[arg-type]
    assert [s for s, _ in resumed.eval_loss] == [1, 2, 3, 4]
    assert [v for _, v in resumed.eval_loss] == pytest.approx(
        [v for _, v in straight.eval_loss], rel=1e-6)
    again = latest_checkpoint(out, read_plan(gpt_plan))[1]
    assert [s for s, _ in again["eval_loss"]] == [1, 2, 3, 4]


def test_a_kill_while_writing_leaves_the_previous_checkpoint(gpt_plan: Path,
                                                             tmp_path: Path) -> None:
    out = tmp_path / "ckpt"
    with pytest.raises(StageFailed):
        train_plan(gpt_plan, steps=3, microbatches=2, batch_size=2, checkpoint_dir=out,
                   checkpoint_every=1, hook=ExitAt(0, "checkpoint", nth=2))
    folder, manifest = latest_checkpoint(out, read_plan(gpt_plan))
    assert folder.name == "step-00000001" and manifest["step"] == 1
    assert manifest["data_position"] == {"step": 1, "rows": 4}
    assert not (out / "step-00000002").exists()
    for entry in manifest["ranks"]:
        kinds = {k.split("/")[0] for k in rank_tensors(folder, entry["rank"])}
        assert kinds == {"module", "optim", "rng"}, kinds


def test_a_checkpoint_of_another_plan_is_refused(gpt_plan: Path, tmp_path: Path,
                                                 capfd: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "ckpt"
    train_plan(gpt_plan, steps=1, microbatches=2, batch_size=2, checkpoint_dir=out,
               checkpoint_every=1)
    other = tmp_path / "plan"
    shutil.copytree(gpt_plan, other)
    body = json.loads((other / "plan.json").read_text())
    body["program"] = str((gpt_plan / body["program"]).resolve())
    body["model"] = str((gpt_plan / body["model"]).resolve())
    body["stages"][0].update(replicas=2, devices=["cpu", "cpu"])
    (other / "plan.json").write_text(json.dumps(body))
    # another plan of the same model (stage 0 replicated) resumes it: checkpoints are by name
    moved, alien = tmp_path / "moved", tmp_path / "alien"
    shutil.copytree(out, moved)
    shutil.copytree(out, alien)
    again = train_plan(other, steps=2, microbatches=2, batch_size=2, resume=moved)
    assert again.start_step == 1 and len(again.loss) == 1
    # another model (its program's sha256) is refused in one line
    folder = alien / "step-00000001"
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["model"]["program_sha256"] = "0" * 64
    (folder / "manifest.json").write_text(json.dumps(manifest))
    code = main(["train", str(other), "--steps", "3", "--microbatches", "2", "--batch-size",
                 "2", "--resume", str(alien)])
    assert code == 2
    err = capfd.readouterr().err
    assert err.count("\n") == 1 and "written for another model" in err, err
    with pytest.raises(PartitionError, match="inside the plan folder"):
        train_plan(gpt_plan, steps=1, checkpoint_dir=gpt_plan / "ck", checkpoint_every=1)
    with pytest.raises(PartitionError, match="already at step 1"):
        train_plan(gpt_plan, steps=1, microbatches=2, batch_size=2, resume=out)
    # the optimizer state is AdamW's (the plan's, weight decay 0.01): SGD, or other options
    # that loading the state would silently put back, are refused before any process
    for options, asks in (({"optimizer": "sgd"}, "--optimizer sgd --weight-decay 0.0 "
                                                 "--momentum 0.0"),
                          ({"weight_decay": 0.1}, "--optimizer adamw --weight-decay 0.1 "
                                                  "--betas 0.9 0.999")):
        expected = re.escape("written with --optimizer adamw --weight-decay 0.01 --betas 0.9 "
                             f"0.999; this run asks {asks}")
        warns = (pytest.warns(PlannedChoiceWarning) if "optimizer" in options
                 else contextlib.nullcontext())
        with warns, pytest.raises(PartitionError, match=expected):
            train_plan(gpt_plan, steps=2, microbatches=2, batch_size=2, resume=out,
                       **options)  # type: ignore[arg-type]


def test_log_eval_and_json(gpt_plan: Path, tmp_path: Path,
                           capfd: pytest.CaptureFixture[str]) -> None:
    log = tmp_path / "train.jsonl"
    code = main(["train", str(gpt_plan), "--steps", "3", "--microbatches", "2", "--batch-size",
                 "2", "--optimizer", "sgd", "--momentum", "0.9", "--eval-every", "2", "--log",
                 str(log), "--json"])
    out = capfd.readouterr().out
    assert code == 0, out
    body = json.loads(out)
    assert {"iteration_ms", "samples_per_s", "stages"} <= set(body["measured"])
    assert {"iteration_ms", "samples_per_s", "stages"} <= set(body["predicted"])
    assert body["ratio"]["iteration_ms"] == pytest.approx(
        body["measured"]["iteration_ms"] / body["predicted"]["iteration_ms"], rel=1e-3)
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    assert [line["step"] for line in lines] == [1, 2, 3]
    assert [line["loss"] for line in lines] == pytest.approx(body["loss"])
    for line in lines:
        assert line["lr"] == 0.01 and line["grad_norm"] > 0 and line["samples_per_s"] > 0
        assert line["tokens_per_s"] > line["samples_per_s"]  # gpt: rows x positions
    evals = [line["eval_loss"] for line in lines if "eval_loss" in line]
    assert len(evals) == 2  # after step 2 and after the last
    assert body["final_eval_loss"] == pytest.approx(evals[-1])
    assert body["best_eval_loss"] == pytest.approx(min(evals))


@pytest.mark.parametrize("options, message", [
    (["--optimizer", "adamw", "--momentum", "0.9"], "--momentum is SGD's"),
    (["--optimizer", "sgd", "--betas", "0.5", "0.9"], "--betas are AdamW's"),
    (["--clip-grad-norm", "0"], "--clip-grad-norm must be positive"),
    (["--warmup-steps", "-1"], "--warmup-steps must be >= 0"),
    (["--checkpoint-every", "2"], "--checkpoint-every needs --checkpoint-dir"),
    (["--resume", "nowhere"], "no such folder"),
    (["--eval-data", "val.npz"], "--eval-data val.npz: no such file or folder"),
])
def test_bad_options_are_one_line_before_any_process(
        gpt_plan: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capfd: pytest.CaptureFixture[str], options: list[str], message: str) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["train", str(gpt_plan), "--steps", "2", *options]) == 2
    err = capfd.readouterr().err
    assert err.count("\n") == 1 and message in err, err
    assert list(tmp_path.iterdir()) == []


def test_log_appends_only_to_a_training_log(gpt_plan: Path, tmp_path: Path,
                                            capfd: pytest.CaptureFixture[str]) -> None:
    """--log appends: over the model, inside the plan folder or onto a file that is not a
    training log it exits 2 before any process and leaves every file as it was; an earlier
    log (a resumed run's) or an empty file is taken."""
    plan = read_plan(gpt_plan)
    model = (gpt_plan / plan.model).resolve()
    notes = tmp_path / "notes.txt"
    notes.write_text("my notes\n")
    before = {p: p.read_bytes() for p in (model, notes)}
    listing = sorted(p.name for p in gpt_plan.iterdir())
    for log, message in ((model, "that is the plan's model file"),
                         (gpt_plan / "train.jsonl", "inside the plan folder"),
                         (notes, "exists and is not a training log")):
        assert main(["train", str(gpt_plan), "--steps", "1", "--log", str(log)]) == 2
        err = capfd.readouterr().err
        assert err.count("\n") == 1 and message in err, err
    assert {p: p.read_bytes() for p in before} == before
    assert sorted(p.name for p in gpt_plan.iterdir()) == listing
    earlier = tmp_path / "train.jsonl"
    earlier.write_text(json.dumps({"step": 1, "loss": 4.0}) + "\n")
    check_log_path(gpt_plan, plan, earlier)
    (tmp_path / "empty.jsonl").touch()
    check_log_path(gpt_plan, plan, tmp_path / "empty.jsonl")
