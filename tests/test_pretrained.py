"""Pretrained weights in (``train --from-pretrained``) and out (``--save-pretrained``): a
Hugging Face GPT-2 from a tiny config (dropout off) saved with ``save_pretrained``, a plan
exported from *other* random weights. Every rank starts from the checkpoint's tensors, step 1's
loss is the Hugging Face model's own, and ``GPT2LMHeadModel.from_pretrained`` of the saved
folder is single-process training from the same checkpoint; bad checkpoints exit 2 in one line
before any rank starts."""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file
from support.cli import one_error
from support.training import own_loss_job, own_loss_task, rank_run

from onnx_partition import export
from onnx_partition.cli import main
from onnx_partition.partition import partition
from onnx_partition.plan import read_plan
from onnx_partition.runtime.train.data_plan import synthetic_batch
from onnx_partition.runtime.train.modules import stage_modules
from onnx_partition.runtime.train.pretrained import (
    INDEX,
    load_into,
    pretrained_tensors,
    resolve_pretrained,
    save_pretrained,
)
from onnx_partition.runtime.train.reference import mismatch, reference_train
from onnx_partition.runtime.train.spawn import launch_training

ROWS = 2  # rows per micro-batch, as partitioned


@dataclass(frozen=True)
class Setup:
    checkpoint: Path  # save_pretrained of the model with seed 1
    plan: Path  # a 2-stage train plan exported from the model with seed 2
    model: transformers.GPT2LMHeadModel  # the checkpoint's model


def _config() -> transformers.GPT2Config:
    return transformers.GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=128,
                                   n_positions=32, resid_pdrop=0.0, embd_pdrop=0.0,
                                   attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)


def _model(seed: int) -> transformers.GPT2LMHeadModel:
    transformers.logging.set_verbosity_error()
    torch.manual_seed(seed)
    return transformers.GPT2LMHeadModel(_config()).eval()


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Setup:
    root = tmp_path_factory.mktemp("pretrained")
    model = _model(1)
    model.save_pretrained(root / "checkpoint")
    ids = torch.zeros(ROWS, 8, dtype=torch.long)
    export(_model(2), (ids,), root / "gpt2.onnx", kwargs={"labels": ids})
    partition(root / "gpt2.onnx", 2, root / "plan", mode="train", batch_size=ROWS,
              ordering="topo")
    return Setup(root / "checkpoint", root / "plan", model)


def _batches(plan: Path, rows: int, steps: int) -> list:  # type: ignore[type-arg]
    task = own_loss_task(plan)
    return [synthetic_batch(task.make_batch, rows, 0, s) for s in range(steps)]


def test_every_rank_starts_from_the_checkpoint(setup: Setup, tmp_path: Path) -> None:
    """Before step 1 every rank's parameters are the checkpoint's (GPT-2's ``lm_head`` the
    file's ``transformer.wte.weight``, which save_pretrained kept), not the export's; step 1's
    loss is the Hugging Face model's own on the first batch; after 8 AdamW steps (lr 1e-3) the
    saved folder holds the engine's final parameters bit for bit, and from_pretrained of it is
    within 1e-4 of single-process training from the checkpoint."""
    weights = resolve_pretrained(setup.plan, setup.checkpoint)
    plan = read_plan(setup.plan)
    job = functools.partial(own_loss_job, str(setup.plan), 2 * ROWS, 0, True)
    run = replace(rank_run(steps=8, microbatches=2, optimizer="adamw", lr=1e-3,
                           check_steps=(0,)), weights=weights, keep_state=True)
    results = launch_training(plan, job, run, timeout_s=60)
    saved = load_file(setup.checkpoint / "model.safetensors")
    seen: set[str] = set()
    for result in results:
        for name, got in result.states[0].items():
            assert torch.equal(got, saved[name]), name
            seen.add(name)
    assert seen == set(saved)  # every tensor of the file reached a rank
    batches = _batches(setup.plan, 2 * ROWS, 8)
    ids, labels = batches[0][0]["input_ids"], batches[0][0]["labels"]
    with torch.no_grad():  # the step's loss: the mean of its micro-batches' own losses
        want = sum(float(setup.model(input_ids=ids[lo:lo + ROWS],
                                     labels=labels[lo:lo + ROWS]).loss)
                   for lo in (0, ROWS)) / 2
    assert results[0].loss[0] == pytest.approx(want, rel=1e-6)
    states = [next(r.state for r in results if r.stage == k and r.state is not None)
              for k in range(len(plan.stages))]
    save_pretrained(setup.plan, states, tmp_path / "out", config=setup.checkpoint)
    written = load_file(tmp_path / "out" / "model.safetensors")
    for state in states:
        for name, value in state.items():
            assert torch.equal(written[name], value), name  # bit-identical
    reference = reference_train(setup.plan, batches, microbatches=2, optimizer="adamw",
                                lr=1e-3, task=own_loss_task(setup.plan), weights=weights)
    got = _from_pretrained(tmp_path / "out")
    for name, value in reference.items():
        torch.testing.assert_close(got[name], value, rtol=0, atol=1e-4)


def _from_pretrained(folder: Path) -> dict[str, torch.Tensor]:
    model, info = transformers.GPT2LMHeadModel.from_pretrained(folder, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    state = model.state_dict()
    assert torch.equal(state["lm_head.weight"], state["transformer.wte.weight"])  # tied
    return state


def test_saved_sgd_momentum_equals_one_process(setup: Setup, tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    """``train --from-pretrained --save-pretrained --check`` (SGD, momentum): the check passes
    against single-process training from the checkpoint, and from_pretrained of the saved
    folder (config.json copied from the checkpoint) equals it as --check compares."""
    out = tmp_path / "trained"
    assert main(["train", str(setup.plan), "--from-pretrained", str(setup.checkpoint),
                 "--save-pretrained", str(out), "--steps", "8", "--microbatches", "2",
                 "--optimizer", "sgd", "--momentum", "0.9", "--lr", "0.05", "--check"]) == 0
    text = capsys.readouterr().out
    assert f"saved the trained weights (safetensors) to {out}" in text
    assert json.loads((out / "config.json").read_text())["n_embd"] == 64
    want = reference_train(setup.plan, _batches(setup.plan, 2 * ROWS, 8), microbatches=2,
                           lr=0.05, momentum=0.9, task=own_loss_task(setup.plan),
                           weights=resolve_pretrained(setup.plan, setup.checkpoint))
    got = _from_pretrained(out)
    floor = max(float(w.abs().max()) for w in want.values())
    for name, value in want.items():
        assert mismatch(got[name], value, floor) is None, name
    assert not torch.equal(got["transformer.wpe.weight"],
                           setup.model.transformer.wpe.weight)  # trained


def test_sharded_and_bf16_in_and_out(setup: Setup, tmp_path: Path) -> None:
    """A sharded bf16 checkpoint loads (cast up to fp32); the stages' weights saved in shards
    with an index (a tiny shard size) and in bf16 load back with from_pretrained."""
    half = _model(1).to(torch.bfloat16)
    half.save_pretrained(tmp_path / "half", max_shard_size="100KB")
    assert (tmp_path / "half" / INDEX).is_file()
    weights = resolve_pretrained(setup.plan, tmp_path / "half")
    stages = stage_modules(setup.plan)
    for stage in stages:
        load_into(stage.module, weights)
        for name, value in stage.module.state_dict().items():
            assert value.dtype == torch.float32
            ref = dict(half.named_parameters())[name]
            assert torch.equal(value, ref.float()), name
    states = [s.module.state_dict() for s in stages]
    save_pretrained(setup.plan, states, tmp_path / "shards", shard_bytes=60_000,
                    config=setup.checkpoint)
    index = json.loads((tmp_path / "shards" / INDEX).read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert "lm_head.weight" not in index["weight_map"]  # the tied duplicate dropped
    save_pretrained(setup.plan, states, tmp_path / "shards", shard_bytes=60_000,
                    config=setup.checkpoint)  # again: the earlier one replaced whole
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []
    got = _from_pretrained(tmp_path / "shards")
    assert all(torch.equal(got[n], v.float()) for n, v in half.state_dict().items())
    # a tensor no stage returned (never trained): the checkpoint's it was loaded from
    partial = [{n: v for n, v in s.items() if n != "transformer.wpe.weight"} for s in states]
    kept = pretrained_tensors(setup.plan, partial, weights=resolve_pretrained(
        setup.plan, setup.checkpoint))
    assert torch.equal(kept["transformer.wpe.weight"], setup.model.transformer.wpe.weight)
    save_pretrained(setup.plan, states, tmp_path / "bf16", save_dtype="bf16",
                    config=setup.checkpoint)
    assert {t.dtype for t in load_file(tmp_path / "bf16" / "model.safetensors").values()} == {
        torch.bfloat16}


def _broken(setup: Setup, folder: Path, change: str) -> Path:
    tensors = load_file(setup.checkpoint / "model.safetensors")
    folder.mkdir()
    if change == "missing":
        del tensors["transformer.h.1.mlp.c_fc.bias"]
    elif change == "extra":
        tensors["transformer.h.9.attn.c_attn.weight"] = torch.zeros(2)
    elif change == "shape":
        tensors["transformer.ln_f.weight"] = torch.zeros(63)
    elif change == "int":
        tensors["transformer.wpe.weight"] = torch.zeros(32, 64, dtype=torch.int64)
    if change == "garbage":
        (folder / "model.safetensors").write_bytes(b"PK\x03\x04 not a safetensors file")
    else:
        save_file(tensors, str(folder / "model.safetensors"))
    return folder


@pytest.mark.parametrize("change, says", [
    ("missing", "'transformer.h.1.mlp.c_fc.bias' is not in the checkpoint"),
    ("extra", "'transformer.h.9.attn.c_attn.weight' is no parameter or buffer"),
    ("shape", "'transformer.ln_f.weight' has shape [63] in the checkpoint, the model's [64]"),
    ("int", "'transformer.wpe.weight' is I64 in the checkpoint, the model's is a float"),
    ("garbage", "not a valid safetensors file"),
])
def test_bad_checkpoint_exits_2_in_one_line(setup: Setup, tmp_path: Path, change: str,
                                            says: str,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    folder = _broken(setup, tmp_path / "bad", change)
    one_error(capsys, ["train", setup.plan, "--from-pretrained", folder, "--steps", "1"], says)


def test_bad_save_requests_exit_2(setup: Setup, tmp_path: Path,
                                  capsys: pytest.CaptureFixture[str]) -> None:
    one_error(capsys, ["train", setup.plan, "--from-pretrained", tmp_path / "none"],
              "no such folder")
    one_error(capsys, ["train", setup.plan, "--from-pretrained", tmp_path],
              "neither model.safetensors nor model.safetensors.index.json")
    one_error(capsys, ["train", setup.plan, "--from-pretrained", setup.checkpoint,
                       "--save-pretrained", setup.checkpoint], "the --from-pretrained folder")
    (tmp_path / "notes.txt").write_text("mine")
    one_error(capsys, ["train", setup.plan, "--save-pretrained", tmp_path],
              "holds files other than")
    one_error(capsys, ["train", setup.plan, "--save-pretrained", tmp_path / "o",
                       "--hf-config", tmp_path], "no config.json")
    one_error(capsys, ["train", setup.plan, "--save-dtype", "bf16"],
              "--save-dtype go with --save-pretrained DIR")


def test_base_model_checkpoint_loads_under_the_head_models_prefix(setup: Setup,
                                                                  tmp_path: Path) -> None:
    """GPT2Model's checkpoint (``h.0.attn.c_attn.weight``, no ``lm_head``) into the exported
    GPT2LMHeadModel (``transformer.h.0...``, ``lm_head`` tied to ``transformer.wte``), as
    from_pretrained loads it."""
    setup.model.transformer.save_pretrained(tmp_path / "base")
    weights = resolve_pretrained(setup.plan, tmp_path / "base")
    assert ("transformer.wte.weight", "model.safetensors", "wte.weight") in weights.sources
    for stage in stage_modules(setup.plan):
        load_into(stage.module, weights)
        for name, value in stage.module.state_dict().items():
            assert torch.equal(value, setup.model.state_dict()[name]), name


def test_torch_engine_refuses_pretrained_weights(setup: Setup,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    one_error(capsys, ["train", setup.plan, "--from-pretrained", setup.checkpoint, "--engine",
                       "torch", "--steps", "1"], "--engine torch does not take --from-pretrained")
