"""One place decides the forward (kvchat/engine/forward_plan.py): from the family, precision,
device, policy and --compile to a plan whose capabilities the runner and the engine obey."""

from __future__ import annotations

import pytest
import torch
from conftest import build_tiny_config, build_tiny_model, make_engine

from kvchat.engine.forward_plan import choose_forward, compiled
from kvchat.engine.model_runner import ModelRunner
from kvchat.models import native
from kvchat.models.quant import quantize_model

LLAMA = "LlamaForCausalLM"


def test_the_default_is_the_fused_forward_on_the_fixed_order_kernel():
    plan = choose_forward(LLAMA, "int4", "bfloat16", "cpu", native=True)
    assert plan.family == "llama" and plan.attention == "fixed-order"
    assert plan.drafts and plan.shared_head and not plan.attention_mass
    assert plan.invariant and plan.residual == "float32"
    assert plan.describe() == ("fused llama forward · kvchat's fixed-order attention · "
                               "batch-invariant")


def test_a_ggufs_family_name_plans_as_its_class_does():
    assert choose_forward("llama", "int4", "bfloat16", "cpu", native=True) \
        == choose_forward(LLAMA, "int4", "bfloat16", "cpu", native=True)


@pytest.mark.parametrize(("change", "limit"), [
    ({"device": "cuda"}, "on cuda"),
    ({"compute": "float16", "precision": "float16"}, "float16 compute"),
    ({"native": False}, "no native library"),
    ({"policy": "h2o"}, "H2O's forwards"),
    ({"compiled": True}, "--compile"),
])
def test_what_is_not_invariant_says_why(change, limit):
    args = {"architecture": LLAMA, "precision": "int4", "compute": "bfloat16", "device": "cpu",
            "native": True, **change}
    plan = choose_forward(**args)
    assert not plan.invariant and limit in plan.limits and limit in plan.describe()


def test_h2o_gets_eager_attention_with_mass_and_no_drafts_or_heads():
    plan = choose_forward(LLAMA, "int4", "bfloat16", "cpu", policy="h2o", native=True)
    assert plan.attention_mass and plan.attention == "eager with mass"
    assert not plan.drafts and not plan.shared_head and plan.family is None


def test_float_models_and_other_families_keep_transformers_forward():
    for plan in (choose_forward(LLAMA, "bfloat16", "bfloat16", "cpu", native=True),
                 choose_forward("GPT2LMHeadModel", "int4", "bfloat16", "cpu", native=True)):
        assert plan.family is None and not plan.shared_head
        assert plan.describe().startswith("transformers' forward")
    assert choose_forward(LLAMA, "bfloat16", "bfloat16", "cpu", native=True).residual \
        == "bfloat16"
    # a window would reach into a shared head's columns
    assert not choose_forward("Gemma3ForCausalLM", "int4", "bfloat16", "cpu", sliding=True,
                              native=True).shared_head


def test_compiling_drops_the_shared_head_and_invariance():
    plan = compiled(choose_forward(LLAMA, "int4", "bfloat16", "cpu", native=True))
    assert plan.compiled and not plan.shared_head and not plan.invariant


@pytest.mark.parametrize("policy", ["lru", "h2o"])
def test_the_runner_and_engine_follow_the_plan(tiny_tokenizer, policy):
    model = build_tiny_model(build_tiny_config(tiny_tokenizer))
    quantize_model(model, "int4")
    engine = make_engine(model, tiny_tokenizer, policy=policy)
    plan = engine.runner.plan
    assert plan.precision == "int4" and plan.compute == "bfloat16"
    assert engine.runner.track_mass == plan.attention_mass == (policy == "h2o")
    assert engine.drafting == plan.drafts and engine.runner.attends_heads == plan.shared_head
    assert engine.runner.invariant == (plan.invariant and native.attention_native())
    # the fused forward runs decode steps exactly when the plan says so
    calls = []
    fused = engine.runner.fused
    assert fused is not None
    real = fused.forward
    fused.forward = lambda *a, **k: calls.append(1) or real(*a, **k)
    try:
        ids = torch.tensor([[5]])
        engine.runner.forward(ids, engine.runner.past())
    finally:
        fused.forward = real
    assert bool(calls) == plan.fused


def test_a_model_without_the_fused_forward_is_planned_without_it(tiny_tokenizer):
    model = build_tiny_model(build_tiny_config(tiny_tokenizer))
    runner = ModelRunner(model)  # float32: no packed layers to stack
    assert runner.fused is None and runner.plan.family is None
    assert runner.plan.describe().startswith("transformers' forward")


def test_the_chat_banner_names_the_forward(tiny_tokenizer, tmp_path):
    from conftest import make_runtime

    from kvchat.chat.backend import LocalBackend

    model = build_tiny_model(build_tiny_config(tiny_tokenizer))
    quantize_model(model, "int4")
    rt = make_runtime(model, tiny_tokenizer, tmp_path / "sessions")
    lines = LocalBackend(rt).banner_lines()
    assert f"forward  {rt.engine.runner.plan.describe()}" in lines
    assert any(line.startswith("forward  fused llama forward") for line in lines)
