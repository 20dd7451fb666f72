"""Training checkpoints: every stage's parameters, buffers and optimizer state by the model's own
parameter names, each rank's RNG state, the step and the data position, published whole or not
at all, as data only (safetensors and JSON: nothing in a checkpoint runs).

Layout of ``--checkpoint-dir DIR``::

    DIR/step-00000010/manifest.json        format, step, data position, rows per step, the
                                           optimizer and its options, the LR schedule, the model
                                           (program sha256, every parameter's shape), the plan
                                           that wrote it, one entry (rank, stage, replica, file,
                                           sha256) per rank, and the index: tensor key -> file
    DIR/step-00000010/rank-00000.safetensors  that rank's tensors
                                           (:mod:`~onnx_partition.runtime.train.checkpoint_state`)
    DIR/.partial-step-00000020/            a checkpoint being written (ignored on resume)

Writing (:func:`write_checkpoint`, every rank together): rank 0 clears a stale partial folder,
every rank writes its own file into it (each file atomically), then, after a barrier, rank 0
writes the manifest and renames the folder to ``step-N`` (one ``os.replace``: atomic on one
file system). A run killed at any point before the rename leaves only a partial folder, so the
previous checkpoint stays the latest complete one. With several machines DIR must be one shared
folder.

**Any plan of the same model resumes it.** A checkpoint is bound to the model (the program's
sha256), the rows per step and the optimizer with its options, not to the plan: a rank reads
its own stage's tensors by name from whichever files hold them, so another cut, other replica
counts or another number of stages resume it (the RNG states only on the same plan).

**Checked before any rank starts** (:func:`latest_checkpoint`): the manifest is JSON; every
rank file matches its sha256 and its safetensors header is sound
(:func:`~onnx_partition.safe_tensors.check_safetensors`: a crafted header is a one-line error);
a format-1 checkpoint (one ``torch.save`` pickle per rank, before this format) is read with
``torch.load(weights_only=True)`` only, and only on the plan that wrote it.

Why not ``torch.distributed.checkpoint``: its metadata file is a pickle (code, not data), its
unit is one state dict sharded over ranks holding pieces of the same tensors (FSDP/DTensor),
while here a stage replica holds whole, distinct tensors, so name-keyed safetensors files plus
an index are the whole resharding; and it gives no publish-by-rename atomicity (a killed DCP
save leaves a folder that looks complete but for ``.metadata``).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from onnx_partition.errors import PartitionError
from onnx_partition.fileio import atomic_path, atomic_write, sha256_file
from onnx_partition.plan import Plan
from onnx_partition.safe_tensors import check_safetensors
from onnx_partition.settings.train import WEIGHT_DECAY, CheckpointSettings

__all__ = ["CHECKPOINT_FORMAT", "LEGACY_FORMAT", "CheckpointRequest", "check_checkpoint_dir",
           "check_optimizer", "latest_checkpoint", "legacy_rank_file", "model_identity",
           "optimizer_record", "plan_fingerprint", "rank_file", "resume_request",
           "write_checkpoint"]

CHECKPOINT_FORMAT = "onnx-partition-checkpoint/2"
LEGACY_FORMAT = "onnx-partition-checkpoint/1"  # torch.save pickles, one per rank
_STEP = re.compile(r"^step-(\d{8})$")


def plan_fingerprint(plan: Plan) -> dict[str, Any]:
    """What a checkpoint must match to be resumed: the stage cut (each stage's inputs, outputs
    and file sha256), the program's sha256 and the replica counts."""
    return {"stages": [{"inputs": list(s.inputs), "outputs": list(s.outputs),
                        "sha256": s.sha256} for s in plan.stages],
            "program_sha256": plan.program_sha256,
            "replicas": [s.replicas for s in plan.stages]}


def model_identity(plan: Plan) -> dict[str, Any]:
    """The model a checkpoint belongs to: its program's sha256 (the parameters' names and
    shapes follow from it; the manifest lists them too)."""
    return {"program_sha256": plan.program_sha256}


def optimizer_record(optimizer: str, weight_decay: float | None, momentum: float,
                     betas: tuple[float, float]) -> dict[str, Any]:
    """The optimizer a checkpoint's state belongs to, with the options its state dict carries
    (the weight decay resolved as ``make_optimizer`` resolves it,
    :data:`~onnx_partition.settings.train.WEIGHT_DECAY`)."""
    decay = WEIGHT_DECAY.get(optimizer, 0.0) if weight_decay is None else weight_decay
    if optimizer == "sgd":
        return {"name": "sgd", "weight_decay": decay, "momentum": momentum}
    return {"name": optimizer, "weight_decay": decay, "betas": [float(b) for b in betas]}


def _spelled(record: Mapping[str, Any]) -> str:
    extra = (f"--momentum {record.get('momentum')}" if record.get("name") == "sgd"
             else f"--betas {' '.join(map(str, record.get('betas', [])))}")
    return (f"--optimizer {record.get('name')} --weight-decay {record.get('weight_decay')} "
            f"{extra}")


def check_optimizer(folder: Path, manifest: Mapping[str, Any], want: Mapping[str, Any]) -> None:
    """Refuse to resume a checkpoint whose optimizer state is another optimizer's, or was
    written with other options (loading it would fail in the ranks, or silently put the
    checkpoint's options back); a manifest without the record (an earlier format) passes."""
    saved = manifest.get("optimizer")
    if saved is not None and dict(saved) != dict(want):
        raise PartitionError(f"--resume {folder}: written with {_spelled(saved)}; this run "
                             f"asks {_spelled(want)} (resume with the checkpoint's optimizer)")


def step_folder(root: Path, step: int) -> Path:
    return root / f"step-{step:08d}"


def rank_file(folder: Path, rank: int) -> Path:
    """Rank ``rank``'s file in a checkpoint folder."""
    return folder / f"rank-{rank:05d}.safetensors"


def legacy_rank_file(folder: Path, rank: int) -> Path:
    """Rank ``rank``'s file in a format-1 checkpoint folder."""
    return folder / f"rank-{rank:05d}.pt"


def check_checkpoint_dir(out: Path, plan_dir: Path, model: Path | None = None) -> None:
    """``--checkpoint-dir`` must not be inside the plan folder nor a file (the model)."""
    resolved, plan_root = out.resolve(), plan_dir.resolve()
    if resolved == plan_root or plan_root in resolved.parents:
        raise PartitionError(f"--checkpoint-dir {out}: inside the plan folder {plan_dir}; "
                             "choose a folder of its own")
    if out.exists() and not out.is_dir():
        raise PartitionError(f"--checkpoint-dir {out}: exists and is not a folder")
    if model is not None and resolved == model.resolve():
        raise PartitionError(f"--checkpoint-dir {out}: that is the model")
    if out.is_dir():
        foreign = [p.name for p in out.iterdir()
                   if not (_STEP.match(p.name) or p.name.startswith(".partial-step-"))]
        if foreign:
            raise PartitionError(f"--checkpoint-dir {out}: holds files that are not checkpoints "
                                 f"({', '.join(sorted(foreign)[:3])}); choose another folder")


def latest_checkpoint(root: Path, plan: Plan) -> tuple[Path, dict[str, Any]]:
    """The latest complete checkpoint under ``root`` (folder, manifest), its files checked as
    data (the module docstring); a PartitionError when there is none, it was written for
    another model (or, format 1, another plan) or a file of it is not what its manifest says."""
    if not root.is_dir():
        raise PartitionError(f"--resume {root}: no such folder")
    steps = sorted((int(m.group(1)), p) for p in root.iterdir()
                   if (m := _STEP.match(p.name)) and (p / "manifest.json").is_file())
    if not steps:
        raise PartitionError(f"--resume {root}: no complete checkpoint in it")
    folder = steps[-1][1]
    try:
        manifest = json.loads((folder / "manifest.json").read_text())
    except (OSError, ValueError) as exc:
        raise PartitionError(f"--resume {folder}: unreadable manifest ({exc})") from exc
    if not isinstance(manifest, dict) or manifest.get("format") not in (CHECKPOINT_FORMAT,
                                                                        LEGACY_FORMAT):
        raise PartitionError(f"--resume {folder}: not a checkpoint ({CHECKPOINT_FORMAT})")
    try:
        int(manifest["step"])
        if manifest["format"] == LEGACY_FORMAT:
            _check_legacy(folder, manifest, plan)
        else:
            _check_files(folder, manifest, plan)
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise PartitionError(f"--resume {folder}: malformed manifest.json ({type(exc).__name__}: "
                             f"{exc})") from None
    return folder, manifest


def _check_files(folder: Path, manifest: Mapping[str, Any], plan: Plan) -> None:
    """A format-2 checkpoint: of this model, every rank file as its manifest says and a sound
    safetensors file, the tensor index naming only what the files hold."""
    saved, want = manifest.get("model", {}), model_identity(plan)
    if saved.get("program_sha256") != want["program_sha256"]:
        raise PartitionError(f"--resume {folder}: written for another model (its program sha256 "
                             f"{str(saved.get('program_sha256'))[:12]}..., this plan's "
                             f"{want['program_sha256'][:12]}...)")
    held: dict[str, set[str]] = {}
    for entry in manifest.get("ranks", []):
        path = rank_file(folder, int(entry["rank"]))
        _check_file(folder, path, entry)
        held[path.name] = set(check_safetensors(path, f"--resume {path}"))
    listed = manifest.get("tensors")
    if not isinstance(listed, dict) or not all(
            isinstance(v, dict) and k in held.get(str(v.get("file")), ())
            for k, v in listed.items()):
        raise PartitionError(f"--resume {folder}: its manifest's tensor index names tensors "
                             "its files do not hold")


def _check_file(folder: Path, path: Path, entry: Mapping[str, Any]) -> None:
    if not path.is_file():
        raise PartitionError(f"--resume {folder}: rank {entry['rank']}'s file is missing")
    if sha256_file(path) != entry.get("sha256"):
        raise PartitionError(f"--resume {path}: does not match its sha256 in the manifest "
                             "(changed or corrupted)")


def _check_legacy(folder: Path, manifest: Mapping[str, Any], plan: Plan) -> None:
    """A format-1 checkpoint: written for this plan, every rank file plain data."""
    from onnx_partition.runtime.train.checkpoint_state import check_legacy_file

    want, got = plan_fingerprint(plan), manifest.get("plan", {})
    for key, what in (("replicas", "replica counts"), ("program_sha256", "program"),
                      ("stages", "stage cut")):
        if got.get(key) != want[key]:
            raise PartitionError(f"--resume {folder}: written for another plan (its {what} "
                                 "differ from this plan's; a format-1 checkpoint resumes "
                                 "only on its own plan)")
    for entry in manifest.get("ranks", []):
        path = legacy_rank_file(folder, int(entry["rank"]))
        _check_file(folder, path, entry)
        check_legacy_file(path)


def write_checkpoint(
    root: Path,
    step: int,
    rank: int,
    save: Callable[[Path], None],
    barrier: Callable[[], None],
    manifest: Mapping[str, Any] | None,
    hook: Callable[[], None] | None = None,
) -> None:
    """Every rank calls this after step ``step``: ``save(path)`` writes this rank's file;
    ``barrier`` is a collective over all ranks; rank 0 passes the manifest body (the other
    ranks None) and publishes. ``hook`` runs after this rank's file is written (the fault
    seam's ``"checkpoint"`` point)."""
    partial = root / f".partial-step-{step:08d}"
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir()
    barrier()
    with atomic_path(rank_file(partial, rank)) as staged:
        save(staged)
    if hook is not None:
        hook()
    barrier()
    if rank == 0:
        assert manifest is not None
        body = dict(manifest)
        body["ranks"] = [dict(e, sha256=sha256_file(rank_file(partial, e["rank"])))
                         for e in body["ranks"]]
        body["tensors"] = _index(partial, [int(e["rank"]) for e in body["ranks"]])
        body["model"] = dict(body.get("model", {}), parameters={
            k[len("module/"):]: v["shape"] for k, v in body["tensors"].items()
            if k.startswith("module/")})
        atomic_write(partial / "manifest.json", json.dumps(body, indent=1) + "\n")
        final = step_folder(root, step)
        if final.exists():  # a rerun over the same step: move the old one out of the way first
            old = root / f".old-step-{step:08d}-{os.getpid()}"
            os.replace(final, old)
            os.replace(partial, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(partial, final)
    barrier()


def _index(folder: Path, ranks: list[int]) -> dict[str, dict[str, Any]]:
    """Tensor key -> its file, shape and dtype, over the rank files (the first file holding a
    key: a tied parameter's copies are equal)."""
    index: dict[str, dict[str, Any]] = {}
    for rank in ranks:
        path = rank_file(folder, rank)
        for key, e in check_safetensors(path).items():
            if not key.startswith("rng/"):
                index.setdefault(key, {"file": path.name, "shape": list(e.shape),
                                       "dtype": e.dtype})
    return index


@dataclass(frozen=True)
class CheckpointRequest:
    """Where checkpoints go and what a resumed run starts from."""

    directory: str | None = None
    every: int = 0
    start: int = 0  # steps already done
    resume_from: str | None = None  # the checkpoint folder to load
    manifest: str = ""  # JSON: the manifest's fixed part
    evals: tuple[tuple[int, float], ...] = ()  # the checkpoint's validation losses (step, loss)
    same_plan: bool = True  # written by this plan (the RNG states come back)
    legacy: bool = False  # format 1 (torch.save files, read as data only)


def resume_request(folder: Path, plan: Plan, asked: CheckpointSettings, *, rows: int,
                   steps: int, optimizer: Mapping[str, Any] | None = None) -> CheckpointRequest:
    """Check ``--checkpoint-dir/--checkpoint-every/--resume`` (``asked``) against the plan (a
    checkpoint of another plan, of another batch, or of another ``optimizer``, as
    :func:`optimizer_record` describes it, is refused) before any process starts; a resumed
    run checkpoints on into the folder it resumed from, every as many steps as it did."""
    start, resume_from, every = 0, None, asked.every
    same_plan, legacy = True, False
    evals: tuple[tuple[int, float], ...] = ()
    target = None if asked.dir is None else Path(asked.dir)
    if asked.resume is not None:
        resume = asked.resume
        found, manifest = latest_checkpoint(Path(resume), plan)
        start, resume_from = int(manifest["step"]), str(found.resolve())
        legacy = manifest["format"] == LEGACY_FORMAT
        same_plan = legacy or manifest.get("plan") == plan_fingerprint(plan)
        evals = tuple((int(s), float(v)) for s, v in manifest.get("eval_loss", ()))
        if manifest.get("rows_per_step") != rows:
            raise PartitionError(f"--resume {found}: written with {manifest.get('rows_per_step')}"
                                 f" rows per step, this run takes {rows}")
        if optimizer is not None:
            check_optimizer(found, manifest, optimizer)
        if start >= steps:
            raise PartitionError(f"--resume {found}: already at step {start}; --steps {steps} "
                                 "(steps in all) leaves nothing to train")
        target = target or Path(resume)
        every = every or int(manifest.get("checkpoint_every", 0))
    if target is not None:
        check_checkpoint_dir(target, folder, (folder / plan.model) if plan.model else None)
        if not every:
            raise PartitionError("--checkpoint-dir needs --checkpoint-every K")
    elif asked.every:
        raise PartitionError("--checkpoint-every needs --checkpoint-dir DIR")
    fixed = {"plan": plan_fingerprint(plan), "plan_dir": str(folder), "rows_per_step": rows,
             "checkpoint_every": every, "model": model_identity(plan),
             **({} if optimizer is None else {"optimizer": optimizer})}
    return CheckpointRequest(None if target is None else str(target.resolve()), every, start,
                             resume_from, json.dumps(fixed), evals, same_plan, legacy)
