"""Attention on ``meta`` counted as the fused kernel a device runs: the same output as torch's
``scaled_dot_product_attention``, the same saved bytes and working set as a model with weights,
never the ``heads x seq x seq`` scores of meta's math fallback."""

from __future__ import annotations

import pytest
import torch
from onnx_partition.models.hf import export_hf_config
from torch._subclasses.fake_tensor import FakeTensorMode

from onnx_partition.cost.fused_attention import device_attention, meta_attention
from onnx_partition.cost.saved import saved_bytes
from onnx_partition.graph.program import load_program

transformers = pytest.importorskip("transformers")
SDPA = torch.ops.aten.scaled_dot_product_attention.default


def _qkv(heads: int, kv_heads: int, seq: int = 24, dim: int = 8, device: str = "cpu"
         ) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(heads * 10 + kv_heads)
    shapes = [(2, heads, seq, dim), (2, kv_heads, seq, dim), (2, kv_heads, seq, dim)]
    return [torch.randn(s, generator=g).to(device).requires_grad_() for s in shapes]


@pytest.mark.parametrize("mask", ["none", "bool", "float", "causal"])
@pytest.mark.parametrize("kv_heads", [4, 2])
def test_the_fused_call_computes_what_sdpa_computes(mask, kv_heads):
    q, k, v = _qkv(4, kv_heads)
    kwargs: dict = {"scale": 0.3, "enable_gqa": kv_heads != 4}
    if mask == "bool":
        kwargs["attn_mask"] = torch.rand(24, 24, generator=torch.Generator().manual_seed(1)) > 0.3
        kwargs["attn_mask"][:, 0] = True  # no row fully masked
    elif mask == "float":
        kwargs["attn_mask"] = torch.randn(2, 1, 24, 24)
    elif mask == "causal":
        kwargs["is_causal"] = True
    want = SDPA(q, k, v, **kwargs)
    got = device_attention(q, k, v, **kwargs)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    grads = torch.autograd.grad(got.square().sum(), (q, k, v))
    wants = torch.autograd.grad(want.square().sum(), (q, k, v))
    for a, b in zip(grads, wants, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def _saved_by_hooks(fn, *args) -> int:
    """Bytes autograd saves while ``fn(*args)`` runs, each storage once."""
    from torch.multiprocessing.reductions import StorageWeakRef

    seen: dict = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        seen[StorageWeakRef(t.untyped_storage())] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*args)
    return sum(seen.values())


def test_on_meta_it_saves_what_cpu_saves_and_no_scores():
    seq = 256
    cpu = _qkv(4, 4, seq=seq)
    mask = torch.ones(seq, seq, dtype=torch.bool).tril()
    on_cpu = _saved_by_hooks(lambda *t: SDPA(*t, mask), *cpu)
    with FakeTensorMode():
        meta = _qkv(4, 4, seq=seq, device="meta")
        meta_mask = torch.ones(seq, seq, dtype=torch.bool, device="meta").tril()
        assert meta_attention(SDPA, (*meta, meta_mask), {})
        assert not meta_attention(torch.ops.aten.mm.default, tuple(meta), {})
        fused = _saved_by_hooks(lambda *t: device_attention(*t, meta_mask), *meta)
        math = _saved_by_hooks(lambda *t: SDPA(*t, meta_mask), *meta)
    scores = 2 * 4 * seq * seq * 4
    assert fused == on_cpu  # q, k, v, out, log-sum-exp and the additive mask
    assert math > scores > fused  # meta's fallback keeps the probabilities


@pytest.mark.parametrize("policy", ["cuda", "cpu"])
def test_a_weightless_llama_counts_what_the_same_llama_with_weights_counts(tmp_path, policy):
    config = tmp_path / "cfg"
    transformers.LlamaConfig(num_hidden_layers=1, hidden_size=64, num_attention_heads=4,
                             num_key_value_heads=2, intermediate_size=128, vocab_size=100,
                             max_position_embeddings=256,
                             architectures=["LlamaForCausalLM"]).save_pretrained(config)
    counted = {}
    for name, weights in (("none", False), ("random", True)):
        path = export_hf_config(config, tmp_path / f"{name}.onnx", weights=weights, seq_len=128)
        program = load_program(path.with_suffix(".pt2"))
        counted[name] = saved_bytes(program, [[2, 128], [2, 128]], precision="bf16",
                                    policy=policy)  # cpu: meta has no autocast, by hand
    attention = "scaled_dot_product_attention"
    for field in ("per_node", "working"):
        assert getattr(counted["none"], field)[attention] \
            == getattr(counted["random"], field)[attention]
    scores = 2 * 4 * 128 * 128 * 2
    assert counted["none"].working[attention] < scores  # no bf16 score gradient held
