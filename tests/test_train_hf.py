"""Hugging Face GPT-2 (tied embeddings), BERT and a Llama-style decoder, built from tiny configs
with random weights (no downloads), exported through onnx_partition.export: stage modules of
2- and 3-stage train plans chained equal the whole program, forward and gradients."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import transformers
from support.training import assert_stages_equal_whole, assert_stages_run_on_meta, train_checked

from onnx_partition import export
from onnx_partition.partition import partition
from onnx_partition.runtime.train.modules import lazy_stages, stage_modules

VOCAB = 100


def _build(name: str) -> torch.nn.Module:
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    small = {"vocab_size": VOCAB, "max_position_embeddings": 16}
    if name == "gpt2":
        return transformers.GPT2LMHeadModel(transformers.GPT2Config(
            n_layer=2, n_embd=32, n_head=4, n_positions=16, vocab_size=VOCAB,
            bos_token_id=0, eos_token_id=0))
    if name == "bert":
        return transformers.BertForMaskedLM(transformers.BertConfig(
            num_hidden_layers=2, hidden_size=32, num_attention_heads=4, intermediate_size=64,
            **small))
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=64, **small))


class Logits(torch.nn.Module):
    """``input_ids -> logits`` of a Hugging Face language model (no cache, plain tuple)."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, return_dict=False)[0]


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    root = tmp_path_factory.mktemp("hf")
    cache: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in cache:
            model = _build(name)
            model.config.use_cache = False
            ids = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(0))
            cache[name] = export(Logits(model), (ids,), root / f"{name}.onnx",
                                 input_names=["input_ids"], output_names=["logits"])
        return cache[name]

    return get


@pytest.mark.parametrize("stages", [2, 3])
@pytest.mark.parametrize("name", ["gpt2", "bert", "llama"])
def test_hf_stage_modules_equal_whole(
    name: str, stages: int, hf_model: Callable[[str], Path], tmp_path: Path
) -> None:
    plan = partition(hf_model(name), stages, tmp_path / "plan", mode="train", batch_size=2,
                     ordering="topo")
    assert_stages_equal_whole(tmp_path / "plan")
    if stages == 3:
        assert_stages_run_on_meta(tmp_path / "plan")
    if name == "gpt2":  # lm_head is wte: one parameter, held by the first and last stages
        tied = stage_modules(tmp_path / "plan")[0].tied
        assert tied == {"model.transformer.wte.weight": (0, len(plan.stages) - 1)}
        # a training rank's stages: every stage's ties known, only the module read is built
        lazy = lazy_stages(tmp_path / "plan")
        assert [s.tied for s in lazy] == [s.tied for s in stage_modules(tmp_path / "plan")]
        assert lazy[-1].module is lazy[-1].module
        assert [s.built is not None for s in lazy] == [False] * (stages - 1) + [True]


@pytest.mark.parametrize("name", ["gpt2", "bert", "llama"])
def test_hf_trains_over_gloo_like_one_process(
    name: str, hf_model: Callable[[str], Path], tmp_path: Path
) -> None:
    """2 stages, 2 ranks, 2 SGD steps: every rank's parameters (GPT-2's tied ``wte`` summed
    across its first and last stage) equal single-process training."""
    train_checked(hf_model(name), tmp_path / "plan", 2, ordering="topo")
