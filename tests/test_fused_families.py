"""The fused decode forward of each family it covers (Mistral, Qwen2, Qwen3, Phi-3, Gemma 2 and 3;
Llama has tests/test_fused_decode.py) computes bitwise what that family's own transformers
forward does, at int4 and int8: logits and the K/V it writes, for one row after a past longer
than the sliding window and for a left-padded batch with a hole, one query and several. Each
tiny model has what sets its family apart: q/k/v biases, q/k norms, fused qkv and gate_up,
partial rotary, sandwich norms, scaled embeddings, local and global layers with their own
rotary tables, an attention soft-cap, a final soft-cap. Norm weights and biases are random, so
a formula that ignores one of them fails."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import TINY_INIT_STD, TINY_SEED

from kvchat.config import SamplingParams
from kvchat.engine.engine import Engine
from kvchat.engine.fused_decode import FusedDecoder
from kvchat.engine.model_runner import ModelRunner
from kvchat.engine.sequence import Request
from kvchat.models.quant import quantize_model
from tests.test_engine import prompt
from tests.test_fused_decode import check_left_padded_batch, check_one_row

WINDOW = 8  # shorter than the pasts below, so the sliding layers' masks cut keys


def _config(family: str, vocab: int):
    import transformers

    shape = {"vocab_size": vocab, "hidden_size": 128, "intermediate_size": 256,
             "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
             "max_position_embeddings": 2048, "initializer_range": TINY_INIT_STD,
             "tie_word_embeddings": False}
    if family == "mistral":
        return transformers.MistralConfig(sliding_window=WINDOW, **shape)
    if family == "qwen2":  # layer 0 slides, layer 1 is full
        return transformers.Qwen2Config(use_sliding_window=True, sliding_window=WINDOW,
                                        max_window_layers=1, **shape)
    if family == "qwen3":
        return transformers.Qwen3Config(head_dim=32, **shape)
    if family == "phi3":
        return transformers.Phi3Config(partial_rotary_factor=0.5, sliding_window=WINDOW,
                                       pad_token_id=0, **shape)
    if family.startswith("gemma2"):  # a soft-cap small enough to bend these scores
        layers = ["full_attention"] * 2 if family == "gemma2-global" else \
            ["sliding_attention", "full_attention"]
        return transformers.Gemma2Config(
            head_dim=32, query_pre_attn_scalar=24, sliding_window=WINDOW, layer_types=layers,
            attn_logit_softcapping=0.5, final_logit_softcapping=30.0, **shape)
    if family == "gemma3":
        return transformers.Gemma3TextConfig(
            head_dim=32, query_pre_attn_scalar=24, sliding_window=WINDOW,
            layer_types=["sliding_attention", "full_attention"], final_logit_softcapping=30.0,
            rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10_000},
                             "full_attention": {"rope_type": "default",
                                                "rope_theta": 1_000_000}},
            **shape)
    raise AssertionError(family)


def _model(family: str, vocab: int):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(TINY_SEED)
    model = AutoModelForCausalLM.from_config(_config(family, vocab)).float().eval()
    # Gemma 2 attends eagerly for its soft-cap, which SDPA lacks
    assert model.config._attn_implementation == ("eager" if family.startswith("gemma2")
                                                  else "sdpa")
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias") or "norm" in name:  # not the init's zeros and ones
                param.add_(torch.randn_like(param) * 0.2)
    return model


# gemma2-global: Gemma 2 with no sliding layer, its soft-cap alone
FAMILIES = ["mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma2-global", "gemma3"]


def _pair(tokenizer, family: str, precision: str):
    """(reference runner, fused runner) over two copies of one packed tiny model."""
    model = _model(family, len(tokenizer))
    quantize_model(model, precision)
    reference = ModelRunner(copy.deepcopy(model))
    reference.fused = None
    fused = ModelRunner(model)
    assert fused.fused is not None and fused.fused.family == family.split("-")[0]
    return reference, fused


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("precision", ["int4", "int8"])
@pytest.mark.parametrize("queries", [1, 3])
def test_one_row_after_a_past_longer_than_the_window(tiny_tokenizer, family, precision,
                                                     queries):
    check_one_row(*_pair(tiny_tokenizer, family, precision), queries)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("queries", [1, 3])
def test_left_padded_batch_with_a_hole(tiny_tokenizer, family, queries):
    check_left_padded_batch(*_pair(tiny_tokenizer, family, "int4"), queries)


@pytest.mark.parametrize("family", FAMILIES)
def test_generation_through_the_engine_is_the_same(tiny_tokenizer, family):
    """Greedy decoding of a prompt past the window, the engine over each runner: the same
    tokens and the same logits at every step."""
    reference, fused = _pair(tiny_tokenizer, family, "int4")
    from conftest import make_engine

    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    outs = []
    for runner in (reference, fused):
        engine = Engine(runner, make_engine(runner.model, tiny_tokenizer).codec, None)
        outs.append(engine.generate(Request(prompt(4, 20), params, record_logits=True)))
    assert outs[0].token_ids == outs[1].token_ids
    assert torch.equal(torch.stack(outs[0].step_logits), torch.stack(outs[1].step_logits))


def test_only_models_without_sliding_layers_share_a_head(tiny_tokenizer):
    # a soft-capped model never shares a head, sliding layers or not
    for family, shares in (("qwen3", True), ("mistral", False), ("gemma2", False),
                           ("gemma2-global", False), ("gemma3", False)):
        _, fused = _pair(tiny_tokenizer, family, "int4")
        assert fused.fused is not None and fused.fused.shares_heads is shares
        assert fused.attends_heads is shares


def test_a_norm_it_does_not_know_keeps_the_models_forward(tiny_tokenizer):
    model = _model("qwen3", len(tiny_tokenizer))
    quantize_model(model, "int4")

    class OtherNorm(torch.nn.Module):
        def __init__(self, weight):
            super().__init__()
            self.weight = weight

        def forward(self, x):
            return x * self.weight

    attn = model.model.layers[1].self_attn
    attn.k_norm = OtherNorm(attn.k_norm.weight)
    assert ModelRunner(model).fused is None
    assert FusedDecoder.build(model) is None


@pytest.mark.parametrize("native", [True, False])
def test_gemma2s_attention_soft_cap_is_applied_as_its_eager_attention_does(
        tiny_tokenizer, monkeypatch, native):
    """Switched from its eager attention to kvchat's, Gemma 2 keeps its soft-cap, through the
    fixed-order kernel and through the fallback where the kernel cannot run: float32 logits
    within rounding of the eager forward's, while the cap moves them by far more."""
    from kvchat.engine import decode_attention
    from kvchat.models import native as native_lib

    if not native:
        monkeypatch.setattr(native_lib, "attention_native", lambda: False)
    elif not native_lib.attention_native():
        pytest.skip("no native library here")
    eager = _model("gemma2", len(tiny_tokenizer))
    ours = copy.deepcopy(eager)
    assert decode_attention.use_decode_attention(ours)
    uncapped = copy.deepcopy(eager)
    for layer in uncapped.model.layers:
        layer.self_attn.attn_logit_softcapping = None
    ids = torch.tensor([prompt(4, 20)])
    with torch.no_grad():
        want, got, off = (m(ids).logits for m in (eager, ours, uncapped))
    assert (got - want).abs().max() < 1e-4
    assert (off - want).abs().max() > 100 * (got - want).abs().max()


def test_gemma2s_soft_cap_holds_in_h2os_tracked_forward(tiny_tokenizer):
    """H2O's forwards run eager attention that reports mass; for Gemma 2 it applies the soft-cap
    too: float32 logits within rounding of the model's own eager forward."""
    from kvchat.engine.attention import attention_mass, track_attention

    eager = _model("gemma2", len(tiny_tokenizer))
    tracked = copy.deepcopy(eager)
    track_attention(tracked)
    ids = torch.tensor([prompt(4, 20)])
    with torch.no_grad(), attention_mass(True) as rows:
        got = tracked(ids).logits
    assert rows  # the tracked path ran
    with torch.no_grad():
        want = eager(ids).logits
    assert (got - want).abs().max() < 1e-4
