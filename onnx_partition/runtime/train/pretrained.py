"""Pretrained weights into a train plan and trained weights out, as Hugging Face's
``save_pretrained`` writes them: safetensors files keyed by the model's own parameter and buffer
names (the exported program's, which the stage modules keep; ``transformer.h.0.attn.c_attn.
weight``).

**In** (``train --from-pretrained DIR``). Before any rank starts the parent reads only the
safetensors headers of ``DIR/model.safetensors`` or of the shards ``DIR/model.safetensors.
index.json`` names, and matches them with what the program holds (:func:`resolve_pretrained`):
every parameter and persistent buffer once, a tied group (GPT-2's ``lm_head.weight`` is
``transformer.wte.weight``) under any one of its names, since ``save_pretrained`` drops the tied
duplicates; a base model's checkpoint (``h.0.attn.c_attn.weight``) loads into a model with a
head (``transformer.h.0...``) as ``from_pretrained`` loads it. A name missing or extra, a shape
that differs, a non-float tensor for a float parameter (or another dtype for an integer
buffer), or a file that is not safetensors is one :class:`PartitionError`. Each rank then reads
only its stage's tensors, lazily (``safe_open``, :func:`load_into`), cast to its parameters'
dtype (bf16 and fp16 up to fp32).

**Out** (``train --save-pretrained DIR``, :func:`save_pretrained`). Replica 0 of every stage
returns its final ``state_dict``; each tensor is written once under its first name (the tied
duplicates dropped), float tensors in fp32 (or bf16: ``--save-dtype bf16``), sharded above
:data:`SHARD_BYTES` with an index as ``save_pretrained`` does, with ``config.json`` from
``--hf-config`` or the ``--from-pretrained`` folder, into a hidden folder that then replaces
``DIR``.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from onnx_partition.errors import PartitionError
from onnx_partition.fileio import sync_folder
from onnx_partition.safe_tensors import check_safetensors
from onnx_partition.settings.train import DEFAULTS, PretrainedSettings

__all__ = ["INDEX", "SAFETENSORS", "SAVE_DTYPES", "SHARD_BYTES", "Header", "PretrainedWeights",
           "Wanted", "check_save_pretrained", "hf_config_of", "load_into", "match",
           "model_names", "pretrained_tensors", "read_header", "read_headers", "resolve_pretrained",
           "save_pretrained", "shard", "wanted_tensors", "write_pretrained"]

SAFETENSORS = "model.safetensors"
INDEX = "model.safetensors.index.json"
#: ``save_pretrained``'s ``max_shard_size`` ("5GB"): a shard is started before this is passed.
SHARD_BYTES = 5 * 10**9
#: ``--save-dtype`` -> the dtype float tensors are written in.
SAVE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
#: The files of a folder that :func:`save_pretrained` may replace.
_OURS = (SAFETENSORS, INDEX, "config.json", "generation_config.json")
_FLOATS = {"F8_E4M3", "F8_E5M2", "F16", "BF16", "F32", "F64"}
_NAMES = {torch.bool: "BOOL", torch.uint8: "U8", torch.int8: "I8", torch.int16: "I16",
          torch.int32: "I32", torch.int64: "I64", torch.float16: "F16", torch.bfloat16: "BF16",
          torch.float32: "F32", torch.float64: "F64"}


@dataclass(frozen=True)
class Header:
    """One tensor of a checkpoint: the file holding it, its shape and safetensors dtype."""

    file: str
    shape: tuple[int, ...]
    dtype: str


@dataclass(frozen=True)
class Wanted:
    """A parameter or persistent buffer of the program: its name in the stage modules, every
    name it has (several when tied), its shape and safetensors dtype."""

    name: str
    names: tuple[str, ...]
    shape: tuple[int, ...]
    dtype: str


@dataclass(frozen=True)
class PretrainedWeights:
    """Where each rank reads each tensor: (name in the stage modules, file, key in the file)."""

    folder: str
    sources: tuple[tuple[str, str, str], ...]


def read_header(path: Path) -> dict[str, tuple[tuple[int, ...], str]]:
    """The tensors a safetensors file holds (name -> shape, dtype), from its header alone,
    checked as every safetensors file this tool reads is
    (:func:`~onnx_partition.safe_tensors.check_safetensors`): one line otherwise."""
    entries = check_safetensors(path, f"--from-pretrained: {path}")
    return {name: (e.shape, e.dtype) for name, e in entries.items()}


def read_headers(folder: Path) -> dict[str, Header]:
    """Every tensor of the checkpoint in ``folder`` (``model.safetensors``, or the shards its
    ``model.safetensors.index.json`` names), from the headers alone."""
    if not folder.is_dir():
        raise PartitionError(f"--from-pretrained {folder}: no such folder")
    if (folder / INDEX).is_file():
        try:
            weight_map = json.loads((folder / INDEX).read_text(encoding="utf-8"))["weight_map"]
            files = sorted({str(f) for f in weight_map.values()})
        except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError,
                AttributeError) as exc:
            raise PartitionError(f"--from-pretrained: {folder / INDEX} is no index of "
                                 "safetensors shards (no weight_map)") from exc
    elif (folder / SAFETENSORS).is_file():
        weight_map, files = None, [SAFETENSORS]
    else:
        raise PartitionError(f"--from-pretrained {folder}: neither {SAFETENSORS} nor {INDEX} "
                             "in it (save_pretrained's safetensors)")
    found: dict[str, Header] = {}
    for file in files:
        path = folder / file
        if Path(file).name != file or not path.is_file():
            raise PartitionError(f"--from-pretrained: the index names {file!r}, which is not "
                                 f"a file in {folder}")
        for name, (shape, dtype) in read_header(path).items():
            if name in found:
                raise PartitionError(f"--from-pretrained {folder}: {name!r} is in both "
                                     f"{found[name].file} and {file}")
            found[name] = Header(file, shape, dtype)
    if weight_map is not None:
        for name, file in weight_map.items():
            if found.get(name) is None or found[name].file != file:
                raise PartitionError(f"--from-pretrained: {INDEX} puts {name!r} in {file}, "
                                     "whose header lacks it")
    return found


def wanted_tensors(plan_dir: Path) -> list[Wanted]:
    """The program's parameters and persistent buffers, in its signature's order, each with
    every name it has (:func:`~onnx_partition.runtime.train.modules.program_names`)."""
    from torch.export.graph_signature import InputKind

    from onnx_partition.runtime.train.modules import (
        load_program,
        program_names,
        require_trainable,
    )

    program = load_program(plan_dir, require_trainable(plan_dir))
    held = [str(s.target) for s in program.graph_signature.input_specs
            if s.kind == InputKind.PARAMETER
            or (s.kind == InputKind.BUFFER and s.persistent is not False)]
    wanted = []
    for name, names in program_names(plan_dir).items():
        if name in held:
            value = program.state_dict[name]
            wanted.append(Wanted(name, tuple(names), tuple(value.shape),
                                 _NAMES.get(value.dtype, str(value.dtype))))
    return wanted


def match(wanted: Sequence[Wanted], headers: Mapping[str, Header],
          folder: str = "DIR") -> PretrainedWeights:
    """Each wanted tensor's source in the checkpoint (its first name present, a base model's
    name under the model's prefix: :func:`model_names`), or a one-line PartitionError naming
    the first name missing or extra, a shape or a dtype that differs."""
    where = f"--from-pretrained {folder}"
    known = {n for w in wanted for n in w.names}
    named = model_names(headers, known)
    extra = sorted(set(headers) - set(named.values()))
    if extra:
        more = f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""
        raise PartitionError(f"{where}: {extra[0]!r}{more} is no parameter or buffer of the "
                             "plan's model")
    sources = []
    for w in wanted:
        key = next((named[n] for n in w.names if n in named), None)
        if key is None:
            also = f" (nor its tied {', '.join(w.names[1:])})" if len(w.names) > 1 else ""
            raise PartitionError(f"{where}: the model's {w.name!r}{also} is not in the "
                                 "checkpoint")
        got = headers[key]
        if got.shape != w.shape:
            raise PartitionError(f"{where}: {key!r} has shape {list(got.shape)} in the "
                                 f"checkpoint, the model's {list(w.shape)}")
        if (w.dtype in _FLOATS) != (got.dtype in _FLOATS) or (
                w.dtype not in _FLOATS and got.dtype != w.dtype):
            kind = "a float" if w.dtype in _FLOATS else f"an {w.dtype}"
            raise PartitionError(f"{where}: {key!r} is {got.dtype} in the checkpoint, the "
                                 f"model's is {kind} tensor ({w.dtype})")
        sources.append((w.name, got.file, key))
    return PretrainedWeights(folder, tuple(sources))


def model_names(keys: Collection[str], known: Collection[str]) -> dict[str, str]:
    """The model's name -> the checkpoint's key holding it: the same name, or, as
    ``from_pretrained`` loads a base model's checkpoint into a model with a head, the key
    without the one prefix (``h.0.attn.c_attn.weight`` for ``transformer.h.0...``) when the
    exact name is not there. Keys that are neither are left out (extra)."""
    prefixes = sorted({n.split(".", 1)[0] for n in known if "." in n})
    named = {key: key for key in keys if key in known}
    for key in keys:
        if key in known:
            continue
        hits = [f"{p}.{key}" for p in prefixes if f"{p}.{key}" in known]
        if len(hits) == 1 and hits[0] not in named:
            named[hits[0]] = key
    return named


def resolve_pretrained(plan_dir: Path, folder: Path) -> PretrainedWeights:
    """Where every rank reads its weights from ``folder`` (checked before any rank starts)."""
    folder = folder.resolve()
    return match(wanted_tensors(plan_dir), read_headers(folder), str(folder))


def load_into(module: torch.nn.Module, weights: PretrainedWeights) -> int:
    """Copy into ``module`` (a rank's stage, on its device) the checkpoint's tensors of its
    parameters and persistent buffers, read lazily file by file and cast to each one's dtype;
    returns how many. A stage's tensor the checkpoint lacks is a PartitionError."""
    from safetensors import safe_open

    persistent = module.state_dict(keep_vars=True)
    sources = {name: (file, key) for name, file, key in weights.sources}
    by_file: dict[str, list[tuple[torch.Tensor, str]]] = {}
    for name, target in persistent.items():
        if name not in sources:
            raise PartitionError(f"--from-pretrained {weights.folder}: no source for {name!r}")
        file, key = sources[name]
        by_file.setdefault(file, []).append((target, key))
    with torch.no_grad():
        for file, targets in by_file.items():
            with safe_open(os.path.join(weights.folder, file), "pt", device="cpu") as handle:
                for target, key in targets:
                    target.copy_(handle.get_tensor(key).to(target.dtype))
    return len(persistent)


def check_save_pretrained(asked: PretrainedSettings) -> None:
    """Refuse before training what :func:`save_pretrained` could not write: a folder that is
    not one it wrote, the ``--from-pretrained`` folder itself, an ``--hf-config`` folder without
    ``config.json``, an unknown ``--save-dtype``; and ``--save-dtype`` or ``--hf-config``
    without ``--save-pretrained``."""
    if asked.save is None:
        given = [flag for flag, on in (("--save-dtype", asked.dtype != DEFAULTS.pretrained.dtype),
                                       ("--hf-config", asked.config is not None)) if on]
        if given:
            raise PartitionError(f"{' and '.join(given)} go with --save-pretrained DIR")
        return
    out, save_dtype = Path(asked.save), asked.dtype
    pretrained = None if asked.load is None else Path(asked.load)
    hf_config = None if asked.config is None else Path(asked.config)
    if save_dtype not in SAVE_DTYPES:
        raise PartitionError(f"--save-dtype {save_dtype!r}: choose {', '.join(SAVE_DTYPES)}")
    if pretrained is not None and out.resolve() == pretrained.resolve():
        raise PartitionError(f"--save-pretrained {out}: that is the --from-pretrained folder; "
                             "write the trained weights to another")
    if hf_config is not None and not (hf_config / "config.json").is_file():
        raise PartitionError(f"--hf-config {hf_config}: no config.json in it")
    if out.exists() and not out.is_dir():
        raise PartitionError(f"--save-pretrained {out}: exists and is not a folder")
    if out.is_dir() and not all(_ours(p) for p in out.iterdir()):
        raise PartitionError(f"--save-pretrained {out}: the folder holds files other than "
                             "safetensors weights and config.json; give a new folder")


def _ours(path: Path) -> bool:
    return path.is_file() and (path.name in _OURS or (path.name.startswith("model-")
                                                      and path.name.endswith(".safetensors")))


def pretrained_tensors(plan_dir: Path, states: Sequence[Mapping[str, torch.Tensor]],
                       save_dtype: str = DEFAULTS.pretrained.dtype,
                       weights: PretrainedWeights | None = None) -> dict[str, torch.Tensor]:
    """Each parameter and persistent buffer once (tied duplicates dropped, as
    ``save_pretrained`` does), in the program's order, from the first stage holding it (one no
    stage reads, never trained: from ``weights``, else the program); float tensors in
    ``save_dtype``."""
    held: dict[str, torch.Tensor] = {}
    for state in states:
        for name, tensor in state.items():
            held.setdefault(name, tensor)
    dtype = SAVE_DTYPES[save_dtype]
    out = {}
    for w in wanted_tensors(plan_dir):
        value = held[w.name] if w.name in held else _untrained(plan_dir, w.name, weights)
        value = value.detach().cpu()
        out[w.name] = (value.to(dtype) if value.is_floating_point() else value).contiguous()
    return out


def _untrained(plan_dir: Path, name: str, weights: PretrainedWeights | None) -> torch.Tensor:
    """A tensor no stage holds: the checkpoint's it was loaded from, else the program's."""
    from safetensors import safe_open

    from onnx_partition.runtime.train.modules import load_program, require_trainable

    source = next(((f, k) for n, f, k in weights.sources if n == name), None) if weights else None
    if weights is not None and source is not None:
        with safe_open(os.path.join(weights.folder, source[0]), "pt", device="cpu") as handle:
            return handle.get_tensor(source[1])
    return load_program(plan_dir, require_trainable(plan_dir)).state_dict[name]


def shard(tensors: Mapping[str, torch.Tensor], max_bytes: int) -> list[list[str]]:
    """The names in order, cut into shards of at most ``max_bytes`` each (a tensor larger
    than that alone), as ``save_pretrained`` cuts them."""
    shards: list[list[str]] = [[]]
    size = 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def write_pretrained(out: Path, tensors: Mapping[str, torch.Tensor], *,
                     shard_bytes: int = SHARD_BYTES, config: Path | None = None,
                     save_dtype: str = DEFAULTS.pretrained.dtype) -> Path:
    """``tensors`` as safetensors in ``out`` (one file, or shards with an index above
    ``shard_bytes``), with ``config`` folder's ``config.json`` (and ``generation_config.json``);
    written into a hidden folder beside ``out`` that then replaces it."""
    from safetensors.torch import save_file

    out = Path(out).absolute()
    stage = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.tmp-"))
    try:
        groups = shard(tensors, shard_bytes)
        if len(groups) == 1:
            save_file(dict(tensors), str(stage / SAFETENSORS), metadata={"format": "pt"})
        else:
            weight_map = {}
            for i, names in enumerate(groups):
                file = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
                save_file({n: tensors[n] for n in names}, str(stage / file),
                          metadata={"format": "pt"})
                weight_map.update(dict.fromkeys(names, file))
            total = sum(t.numel() * t.element_size() for t in tensors.values())
            (stage / INDEX).write_text(json.dumps(
                {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n",
                encoding="utf-8")
        if config is not None:
            _copy_config(config, stage, save_dtype)
        for item in stage.iterdir():
            with open(item, "rb") as handle:
                os.fsync(handle.fileno())
        _swap_in(stage, out)
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    return out


def _copy_config(source: Path, stage: Path, save_dtype: str) -> None:
    """config.json (its dtype set to the one written) and generation_config.json, if there."""
    config = json.loads((source / "config.json").read_text(encoding="utf-8"))
    named = {"fp32": "float32", "bf16": "bfloat16"}[save_dtype]
    for key in [k for k in ("torch_dtype", "dtype") if k in config] or ["torch_dtype"]:
        config[key] = named
    (stage / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n",
                                       encoding="utf-8")
    if (source / "generation_config.json").is_file():
        shutil.copyfile(source / "generation_config.json", stage / "generation_config.json")


def _swap_in(stage: Path, out: Path) -> None:
    """``stage`` becomes ``out``; an ``out`` there before is moved aside, then removed."""
    old = None
    if out.exists():
        old = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.old-"))
        os.replace(out, old / out.name)
    os.replace(stage, out)
    sync_folder(out.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def hf_config_of(asked: PretrainedSettings) -> Path | None:
    """The folder whose config.json goes with the saved weights: ``--hf-config``, else the
    ``--from-pretrained`` folder when it has one, else none."""
    if asked.config is not None:
        return Path(asked.config)
    if asked.load is not None and (Path(asked.load) / "config.json").is_file():
        return Path(asked.load)
    return None


def save_pretrained(plan_dir: Path, states: Sequence[Mapping[str, torch.Tensor]], out: Path,
                    *, save_dtype: str = DEFAULTS.pretrained.dtype, config: Path | None = None,
                    shard_bytes: int = SHARD_BYTES,
                    weights: PretrainedWeights | None = None) -> Path:
    """The trained weights (``states[k]``: stage k's final ``state_dict``) as a folder that
    ``from_pretrained`` loads (:func:`pretrained_tensors`, :func:`write_pretrained`)."""
    tensors = pretrained_tensors(plan_dir, states, save_dtype, weights)
    return write_pretrained(out, tensors, shard_bytes=shard_bytes, config=config,
                            save_dtype=save_dtype)
