"""Tests for the model recipes: export, full ONNX check, and ORT == torch at two batch sizes."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from onnx_partition import models


def _torch_outputs(module: torch.nn.Module, inputs: dict[str, torch.Tensor]) -> list[np.ndarray]:
    with torch.no_grad():
        out = module(*inputs.values())
    return [t.numpy() for t in ([out] if isinstance(out, torch.Tensor) else out)]


def _check_runs_like_torch(path: Path, name: str) -> None:
    """``path`` passes the full checker and matches torch at batch sizes 2 and 3."""
    onnx.checker.check_model(str(path), full_check=True)
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    module = models.build(name).module
    for batch in (2, 3):
        recipe = models.build(name, batch_size=batch)
        feeds = {k: v.numpy() for k, v in recipe.inputs.items()}
        got = session.run(recipe.output_names, feeds)
        want = _torch_outputs(module, recipe.inputs)
        assert len(got) == len(want)
        for g, w in zip(got, want, strict=True):
            assert g.shape == w.shape and g.shape[0] == batch
            np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)


def _dims(value: onnx.ValueInfoProto) -> list[str | int]:
    return [d.dim_param or d.dim_value for d in value.type.tensor_type.shape.dim]


@pytest.mark.parametrize("name", models.RECIPES)
def test_tiny_export_matches_torch(name: str, tmp_path: Path) -> None:
    path = models.export(name, tmp_path / f"{name}.onnx")
    assert path == tmp_path / f"{name}.onnx"
    # inline weights, the exported program beside, no temp left
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name, f"{name}.pt2"]

    model = onnx.load(str(path))
    recipe = models.build(name)
    assert [i.name for i in model.graph.input] == list(recipe.inputs)
    assert [o.name for o in model.graph.output] == recipe.output_names
    for value in [*model.graph.input, *model.graph.output]:
        assert _dims(value)[0] == "batch", value.name
    assert 20 <= len(model.graph.node) <= 400  # unoptimized: one FX node's ONNX nodes kept apart
    _check_runs_like_torch(path, name)


def test_external_data_lands_next_to_path(tmp_path: Path) -> None:
    """Weights forced out (``external_data=True``, as above 100 MB) go to ``<path>.data``;
    a later inline export over the same path removes that stale file."""
    from onnx_partition import export

    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    recipe = models.Recipe(module.eval(), {"x": torch.randn(2, 8)}, ["y"])

    def export_it(external: bool) -> Path:
        return export(recipe.module, tuple(recipe.inputs.values()), tmp_path / "net.onnx",
                      input_names=list(recipe.inputs), output_names=recipe.output_names,
                      external_data=external)

    path = export_it(True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["net.onnx", "net.onnx.data", "net.pt2"]
    model = onnx.load(str(path), load_external_data=False)
    locations = {
        entry.value
        for init in model.graph.initializer
        for entry in init.external_data
        if entry.key == "location"
    }
    assert locations == {"net.onnx.data"}
    onnx.checker.check_model(str(path), full_check=True)
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    x = torch.randn(3, 8)
    (got,) = session.run(["y"], {"x": x.numpy()})
    np.testing.assert_allclose(got, _torch_outputs(module, {"x": x})[0], rtol=1e-4, atol=1e-5)

    export_it(False)  # inline over it: the stale data file goes
    assert sorted(p.name for p in tmp_path.iterdir()) == ["net.onnx", "net.pt2"]


def test_build_is_deterministic_and_batch_independent() -> None:
    a, b = models.build("gpt"), models.build("gpt", batch_size=5)
    assert b.inputs["input_ids"].shape[0] == 5
    for (ka, va), (kb, vb) in zip(
        a.module.state_dict().items(), b.module.state_dict().items(), strict=True
    ):
        assert ka == kb and torch.equal(va, vb)
    assert not a.module.training
    again = models.build("gpt")
    assert torch.equal(a.inputs["input_ids"], again.inputs["input_ids"])


def test_api_constants() -> None:
    assert models.RECIPES == ("resnet", "inception", "unet", "gpt", "bert", "encdec")
    assert models.SIZES == ("tiny", "small", "realistic")


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"name": "vgg"}, "unknown model 'vgg'; choose one of: resnet, inception"),
        ({"name": "gpt", "size": "huge"}, "unknown size 'huge'; choose one of: tiny, small"),
        ({"name": "gpt", "batch_size": 0}, "batch_size"),
    ],
)
def test_bad_arguments_raise_value_error(
    kwargs: dict[str, object], match: str, tmp_path: Path
) -> None:
    with pytest.raises(ValueError, match=match):
        models.build(**kwargs)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=match):
        models.export(path=tmp_path / "x.onnx", **kwargs)  # type: ignore[arg-type]
    assert not any(tmp_path.iterdir())
