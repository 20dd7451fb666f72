"""Hugging Face models from their config alone (``onnx-partition export --hf-config DIR``).

``DIR/config.json`` is a config as ``save_pretrained`` writes it; the class is the first of its
``architectures`` (or ``class_name``). With weights the model is built as ``from_config`` does
(random weights); without, on ``torch.device("meta")``: the export is weightless (name, dtype
and shape of every parameter, no data; :mod:`onnx_partition.graph.weightless`), whatever the
model's size. The inputs are ``input_ids`` and ``labels`` (``batch`` x ``seq_len``, the batch
symbolic), the model's own loss the first output. The origin (class and config) is recorded
in the model, and from there in plan.json, so training can make the weights on each rank
(:func:`build_on_meta`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from onnx_partition.errors import PartitionError, one_line
from onnx_partition.progress import SILENT, Reporter
from onnx_partition.settings.export import DEFAULT_SEQ_LEN

__all__ = ["DEFAULT_SEQ_LEN", "build_on_meta", "export_hf_config", "hf_origin"]


def _config(folder: Path) -> Any:
    """The config in ``folder/config.json`` (read locally, nothing downloaded)."""
    path = folder / "config.json"
    if not path.is_file():
        raise PartitionError(f"--hf-config {folder}: no config.json in it (a folder as "
                             "save_pretrained writes it)")
    try:
        import transformers

        body = json.loads(path.read_text())
        if not isinstance(body, dict) or "model_type" not in body:
            raise PartitionError(f"{path}: no model_type: not a Hugging Face config")
        return transformers.AutoConfig.for_model(body.pop("model_type"), **body)
    except PartitionError:
        raise
    except Exception as exc:  # JSON, an unknown model type, a config that refuses a value
        raise PartitionError(f"{path}: {one_line(exc)}") from None


def _class(config: Any, class_name: str | None, where: str) -> type:
    import transformers

    names = list(getattr(config, "architectures", None) or [])
    name = class_name or (names[0] if names else None)
    if name is None:
        raise PartitionError(f"{where} names no architectures: give the class with --hf-class "
                             "(e.g. LlamaForCausalLM)")
    cls = getattr(transformers, name, None)
    if not isinstance(cls, type) or not hasattr(cls, "config_class"):
        raise PartitionError(f"{name!r} is not a transformers model class")
    return cls


def hf_origin(cls: type, config: Any) -> dict[str, Any]:
    """plan.json's ``origin`` of a model of class ``cls`` built from ``config``."""
    body = json.loads(config.to_json_string(use_diff=False))
    return {"hf": {"class": cls.__name__, "config": body}}


def build_on_meta(origin: Mapping[str, Any]) -> Any:
    """The model of ``origin`` (``{"hf": {"class", "config"}}``) built on the meta device."""
    import torch
    import transformers

    hf = origin["hf"]
    config_body = dict(hf["config"])
    config = transformers.AutoConfig.for_model(config_body.pop("model_type"), **config_body)
    cls = _class(config, hf["class"], "the plan's origin")
    return _build(cls, config, torch.device("meta"))


def _build(cls: type, config: Any, device: Any) -> Any:
    import torch

    try:
        with torch.device(device):
            return cls(config)
    except Exception as exc:
        where = "on meta" if str(device) == "meta" else "from its config"
        raise PartitionError(f"{cls.__name__} does not build {where}: {one_line(exc)}") from None


def export_hf_config(
    folder: str | os.PathLike[str],
    path: str | os.PathLike[str],
    *,
    weights: bool = True,
    seq_len: int = DEFAULT_SEQ_LEN,
    batch_size: int = 2,
    class_name: str | None = None,
    reporter: Reporter = SILENT,
) -> Path:
    """Export the model of the config in ``folder`` to ``path`` (+ its program ``.pt2``):
    random weights, or none (``weights=False``: built on meta). Raises PartitionError."""
    import torch

    from onnx_partition.graph.export import export

    if seq_len < 1 or batch_size < 1:
        raise PartitionError("--seq-len and --batch-size must be at least 1")
    folder = Path(folder)
    config = _config(folder)
    cls = _class(config, class_name, f"{folder / 'config.json'}")
    label = f"export {cls.__name__}: build, trace and convert"
    reporter.step(label, 0, 2)
    model = _build(cls, config, "meta" if not weights else "cpu")
    reporter.step(label, 1, 2)
    ids = torch.zeros(max(batch_size, 2), seq_len, dtype=torch.long)
    written = export(model, (ids,), path, kwargs={"labels": ids},
                     weights="random" if weights else None, origin=hf_origin(cls, config))
    reporter.step(label, 2, 2)
    return written
