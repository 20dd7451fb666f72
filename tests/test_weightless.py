"""A model without its weights: a Llama from a config exports weightless (every parameter's name,
dtype and shape, no data), plans like any model, `train --check` makes each stage's weights on
its rank from (seed, name) after the model's own rules and matches one process, `run` refuses
it, and bad input is one line with exit code 2."""

from __future__ import annotations

import json
from pathlib import Path

import onnx
import pytest
import torch

from onnx_partition.cli.verbs import main
from onnx_partition.graph.weightless import is_weightless
from onnx_partition.plan import read_plan
from onnx_partition.runtime.train.weightless import materialize

transformers = pytest.importorskip("transformers")

SMALL = {"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
         "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 128,
         "max_position_embeddings": 16}


def _config(folder: Path, architectures: list[str] | None = None, **shape: int) -> Path:
    transformers.LlamaConfig(**shape, architectures=architectures).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def planned(tmp_path_factory) -> Path:
    """export --hf-config --no-weights, then partition --mode train --stages 2."""
    work = tmp_path_factory.mktemp("weightless")
    config = _config(work / "cfg", ["LlamaForCausalLM"], **SMALL)
    model = work / "llama.onnx"
    assert main(["export", "--hf-config", str(config), "--no-weights", "--seq-len", "16",
                 "-o", str(model)]) == 0
    plan = work / "plan"
    assert main(["partition", str(model), "--mode", "train", "--stages", "2",
                 "--batch-size", "2", "-o", str(plan)]) == 0
    return plan


def test_the_weightless_file_keeps_names_dtypes_shapes_and_no_bytes(planned):
    model_path = planned.parent / "llama.onnx"
    model = onnx.load(str(model_path), load_external_data=False)
    with torch.device("meta"):
        llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMALL))
    params = dict(llama.named_parameters())
    inits = {t.name: t for t in model.graph.initializer}
    assert set(params) <= set(inits)
    for name, p in params.items():
        assert is_weightless(inits[name]) and list(inits[name].dims) == list(p.shape)
        assert inits[name].data_type == onnx.TensorProto.FLOAT
    weight_bytes = sum(p.numel() * 4 for p in params.values())
    held = sum(len(t.raw_data) for t in model.graph.initializer)
    assert held < 1024 < weight_bytes  # only small constants hold data
    assert not model_path.with_name("llama.onnx.data").exists()
    for stage in sorted(planned.glob("stage_*.onnx")):  # the stage files keep them so
        inits = onnx.load(str(stage), load_external_data=False).graph.initializer
        assert any(is_weightless(t) for t in inits)
    assert not list(planned.glob("*.data"))
    plan = read_plan(planned)
    assert plan.weights == "none" and plan.origin is not None
    assert plan.origin["hf"]["class"] == "LlamaForCausalLM"
    assert plan.origin["hf"]["config"]["hidden_size"] == 64


def test_train_check_makes_the_weights_on_each_rank_as_one_process_does(planned, capsys):
    """... and what `train --save` writes has every weight, so `run --check` serves it."""
    saved = planned.parent / "trained"
    assert main(["train", str(planned), "--steps", "2", "--microbatches", "2", "--check",
                 "--optimizer", "sgd", "--lr", "0.1", "--save", str(saved)]) == 0
    checks = [line for line in capsys.readouterr().out.splitlines()
              if line.startswith("check against single-process training")]
    assert checks and all(line.endswith(": OK") for line in checks), checks
    assert read_plan(saved).weights == "data"
    for stage in sorted(saved.glob("stage_*.onnx")):
        inits = onnx.load(str(stage), load_external_data=False).graph.initializer
        assert not any(is_weightless(t) for t in inits)
    assert main(["run", str(saved), "--check", "--iterations", "1"]) == 0
    assert "(OK)" in capsys.readouterr().out


def test_the_weights_follow_the_models_rules_and_depend_on_seed_and_name(planned):
    from onnx_partition.runtime.train.modules import whole_module

    plan = read_plan(planned)
    made = [materialize(whole_module(planned), torch.device("cpu"), plan, seed)
            for seed in (0, 0, 1)]
    tensors = [dict(m.named_parameters()) for m in made]
    norm = tensors[0]["model.layers.0.input_layernorm.weight"]
    assert torch.equal(norm, torch.ones_like(norm))  # RMSNorm: ones
    q = tensors[0]["model.layers.0.self_attn.q_proj.weight"]
    assert 0.01 < float(q.detach().std()) < 0.03  # Linear: normal(0, initializer_range)
    assert torch.equal(q, tensors[1]["model.layers.0.self_attn.q_proj.weight"])
    assert not torch.equal(q, tensors[2]["model.layers.0.self_attn.q_proj.weight"])
    assert not torch.equal(q, tensors[0]["model.layers.0.self_attn.o_proj.weight"])
    buffers = dict(made[0].named_buffers())
    inv = buffers.get("model.rotary_emb.inv_freq")
    assert inv is not None and float(inv[0]) == 1.0  # rotary: the model's own rule


@pytest.mark.parametrize(("argv", "said"), [
    (["run", "{plan}"], "no weights"),
    (["profile", "--plan", "{plan}"], "no weights"),
    (["train", "{plan}", "--engine", "torch", "--microbatches", "2"], "use --engine ours"),
])
def test_what_needs_weights_refuses_a_weightless_plan(planned, capsys, argv, said):
    assert main([a.format(plan=planned) for a in argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and said in err and "\n" not in err


@pytest.mark.parametrize(("make", "argv", "said"), [
    (None, ["gpt", "--hf-config", "{cfg}"], "exactly one of"),
    (None, [], "exactly one of"),
    ("bare", ["--hf-config", "{cfg}"], "names no architectures: give the class with --hf-class"),
    ("bare", ["--hf-config", "{cfg}", "--hf-class", "NotAModel"], "not a transformers model"),
    ("none", ["--hf-config", "{cfg}"], "no config.json"),
    ("unbuildable", ["--hf-config", "{cfg}", "--no-weights"],
     "LlamaForCausalLM does not build on meta: "),
    (None, ["gpt", "--no-weights"], "--no-weights goes with --hf-config"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys, make, argv, said):
    cfg = tmp_path / "cfg"
    cfg.mkdir()
    if make == "bare":
        _config(cfg, None, **SMALL)
    if make == "unbuildable":  # an activation transformers does not know
        _config(cfg, ["LlamaForCausalLM"], **SMALL)
        body = json.loads((cfg / "config.json").read_text())
        (cfg / "config.json").write_text(json.dumps({**body, "hidden_act": "no-such-act"}))
    argv = [a.format(cfg=cfg) for a in argv]
    assert main(["export", *argv, "-o", str(tmp_path / "m.onnx")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and said in err[0], err


def test_a_bigger_model_plans_from_a_file_of_its_graph_not_its_weights(tmp_path):
    """Hidden 1024, vocabulary 32,000: 180 MB of float32 weights, a file of under 2 MB."""
    config = _config(tmp_path / "cfg", ["LlamaForCausalLM"], num_hidden_layers=1,
                     hidden_size=1024, num_attention_heads=16, num_key_value_heads=4,
                     intermediate_size=4096, vocab_size=32000)
    model = tmp_path / "big.onnx"
    assert main(["export", "--hf-config", str(config), "--no-weights", "--seq-len", "64",
                 "-o", str(model)]) == 0
    assert model.stat().st_size < 2 * 2**20 and model.with_suffix(".pt2").stat().st_size < 2**20
    assert main(["partition", str(model), "--mode", "train", "--stages", "2", "--batch-size",
                 "1", "-o", str(tmp_path / "plan")]) == 0
    plan = read_plan(tmp_path / "plan")
    weights = sum(s.predicted.weights_bytes or 0 for s in plan.stages if s.predicted)
    assert weights > 150e6  # priced as the 180 MB it stands for


@pytest.mark.parametrize("inputs_on", ["cpu", "meta"])
def test_the_python_export_takes_a_module_on_meta(tmp_path, capsys, inputs_on):
    """onnx_partition.export of a module built on meta, example inputs real or meta; profile
    (which times the model) refuses the result in one line."""
    import onnx_partition

    with torch.device("meta"):
        module = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(),
                                     torch.nn.Linear(16, 4))
    path = onnx_partition.export(module, (torch.zeros(2, 8, device=inputs_on),),
                                 tmp_path / "seq.onnx")
    inits = onnx.load(str(path)).graph.initializer
    assert [t.name for t in inits] == ["0.weight", "0.bias", "2.weight", "2.bias"]
    assert all(is_weightless(t) for t in inits)
    assert main(["partition", str(path), "--mode", "train", "--stages", "2", "--batch-size", "2",
                 "--gpu", "h100", "-o", str(tmp_path / "plan")]) == 0  # saved tensors and
    # the backward per aten op priced on meta too
    assert main(["profile", str(path), "--batch-size", "2", "-o", str(tmp_path / "c.json")]) == 2
    assert "has no weights" in capsys.readouterr().err


def test_without_no_weights_the_config_gets_random_weights(tmp_path):
    """export --hf-config without --no-weights: random weights (as from_config), recorded."""
    from onnx_partition.graph.weightless import model_origin, model_weights

    config = _config(tmp_path / "cfg", ["LlamaForCausalLM"], **{**SMALL, "num_hidden_layers": 1})
    model = tmp_path / "r.onnx"
    assert main(["export", "--hf-config", str(config), "--seq-len", "8", "-o", str(model)]) == 0
    proto = onnx.load(str(model))
    assert model_weights(proto) == "random" and not any(map(is_weightless, proto.graph.initializer))
    origin = model_origin(proto)
    assert origin is not None and origin["hf"]["class"] == "LlamaForCausalLM"
    embed = next(t for t in proto.graph.initializer if t.name == "model.embed_tokens.weight")
    values = onnx.numpy_helper.to_array(embed)
    assert 0.01 < float(values.std()) < 0.03  # normal(0, initializer_range)
