"""Under quantized weights the residual stream runs in float32 (kvchat.models.residual) while
every kernel keeps its bfloat16 input, and the cached K/V keep the pool's dtype."""

from __future__ import annotations

import pytest
import torch
from conftest import build_tiny_config, build_tiny_model

from kvchat.models.quant import quantize_model
from kvchat.models.residual import float32_residual, residual_dtype


def _outputs(model, ids):
    seen = {}
    decoder = model.get_decoder()
    hooks = [decoder.layers[0].register_forward_hook(
                 lambda _m, _a, out: seen.__setitem__("layer", out[0] if isinstance(out, tuple)
                                                      else out)),
             decoder.layers[0].self_attn.q_proj.register_forward_pre_hook(
                 lambda _m, args: seen.__setitem__("matmul_in", args[0]))]
    try:
        with torch.inference_mode():
            out = model(input_ids=ids, use_cache=True)
    finally:
        for hook in hooks:
            hook.remove()
    return seen, out


@pytest.mark.parametrize("precision", ["int4", "int8"])
def test_a_quantized_model_adds_in_float32_and_caches_bfloat16(tiny_tokenizer, precision):
    model = build_tiny_model(build_tiny_config(tiny_tokenizer))
    quantize_model(model, precision)
    assert residual_dtype(model) == torch.float32
    seen, out = _outputs(model, torch.tensor([[5, 6, 7, 8]]))
    assert seen["layer"].dtype == torch.float32  # the residual stream
    # the layer itself takes its input as it comes; the packed kernel rounds it to bfloat16
    layer = model.get_decoder().layers[0].self_attn.q_proj
    assert layer(seen["matmul_in"]).dtype == torch.bfloat16
    keys, values = out.past_key_values.layers[0].keys, out.past_key_values.layers[0].values
    assert keys.dtype == values.dtype == torch.bfloat16
    assert out.logits.dtype == torch.float32


def test_it_is_applied_once_and_only_to_the_families_it_knows(tiny_tokenizer):
    model = build_tiny_model(build_tiny_config(tiny_tokenizer))
    quantize_model(model, "int4")
    rotary = model.get_decoder().rotary_emb.forward
    assert float32_residual(model) and model.get_decoder().rotary_emb.forward is rotary
    ids = torch.tensor([[5, 6, 7]])
    with torch.inference_mode():
        once = model(input_ids=ids).logits
    assert torch.equal(once, model(input_ids=ids).logits)

    from transformers import GPT2Config, GPT2LMHeadModel

    other = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64))
    assert not float32_residual(other) and residual_dtype(other) == torch.float32
    other.to(torch.bfloat16)
    assert residual_dtype(other) == torch.bfloat16


def test_a_float_model_keeps_its_own_dtype(tiny_tokenizer):
    model = build_tiny_model(build_tiny_config(tiny_tokenizer)).to(torch.bfloat16)
    assert residual_dtype(model) == torch.bfloat16
    seen, _ = _outputs(model, torch.tensor([[5, 6, 7, 8]]))
    assert seen["layer"].dtype == torch.bfloat16
