"""A decoder layer in one native call (engine/native_layer.py, models/decode_layer.c): for one
row and one new token it gives the fused forward's bits, logits and K/V, step after step, on
Llama and on the families with q / k norms, sandwich norms, GELU and local layers; it takes
edited and replaced norm weights; torch's activation is its table; what it does not run, the
fused forward's layer runs."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import build_tiny_config, build_tiny_model, make_engine
from torch import nn

from kvchat.config import SamplingParams
from kvchat.engine.engine import Engine
from kvchat.engine.model_runner import ModelRunner
from kvchat.engine.native_layer import NativeLayer, activation_table, silu_table
from kvchat.engine.past import past_kv, reserved_past
from kvchat.engine.sequence import Request
from kvchat.models import native
from kvchat.models.quant import quantize_model
from tests.test_engine import prompt

needs_kernel = pytest.mark.skipif(not native.int4_native(), reason=native.int4_kernel_name())


def _runners(tokenizer, precision: str = "int4", hidden: int = 128, model=None):
    """(fused runner with native layers, the same model's copy with them off)."""
    if model is None:
        model = build_tiny_model(build_tiny_config(tokenizer, hidden_size=hidden,
                                                   intermediate_size=2 * hidden))
    quantize_model(model, precision)
    python = ModelRunner(copy.deepcopy(model))
    python.fused.native = [None] * len(python.fused.native)
    python.fused.stack = None
    return ModelRunner(model), python


def _counted(runner: ModelRunner) -> tuple[list[bool], list[bool]]:
    """Each native layer's own run, and each run of the stack (every layer in one call),
    recorded: whether it ran."""
    ran: list[bool] = []
    for layer in runner.fused.native:
        run = layer.run

        def counted(*args, _run=run):
            ran.append(_run(*args))
            return ran[-1]

        layer.run = counted
    stacked: list[bool] = []
    stack = runner.fused.stack
    if stack is not None:
        run_all = stack.run

        def counted_all(*args):
            stacked.append(run_all(*args))
            return stacked[-1]

        stack.run = counted_all
    return ran, stacked


def _reserved(runner: ModelRunner, ids: list[int], room: int):
    """`ids` prefilled, their K/V in a reserved one-row past with `room` positions more."""
    with torch.no_grad():
        past = runner.past()
        runner.model(input_ids=torch.tensor([ids]), past_key_values=past, use_cache=True)
        kv = past_kv(past, 0, len(ids))
        buffers = [tuple(torch.cat([t, t.new_zeros(*t.shape[:2], room, t.shape[3])], dim=2)
                         for t in pair) for pair in kv]
        return reserved_past(buffers, len(ids), runner.config)


def _decode(runner: ModelRunner, ids: list[int], steps: int):
    """Prefill `ids`, then `steps` greedy tokens one at a time in a reserved one-row past:
    (each step's logits, the K/V)."""
    past = _reserved(runner, ids, steps + 2)
    with torch.no_grad():
        token, logits = ids[-1], []
        for _ in range(steps):
            out, _ = runner.forward(torch.tensor([[token]]), past)
            logits.append(out.reshape(-1).clone())
            token = int(out.reshape(-1).argmax())
        return logits, past_kv(past, 0, len(ids) + steps)


@needs_kernel
@pytest.mark.parametrize("hidden", [64, 128])
@pytest.mark.parametrize("stacked", [True, False])
def test_it_gives_the_fused_forwards_bits_step_after_step(tiny_tokenizer, hidden, stacked):
    """Every layer in one call (the stack), or each layer's own call: the fused forward's
    bits either way."""
    fast, python = _runners(tiny_tokenizer, hidden=hidden)
    assert all(layer is not None for layer in fast.fused.native)
    assert f"{len(fast.fused.native)} layers one native call a token" in fast.plan.describe()
    assert fast.fused.stack is not None and len(fast.fused.stack.layers) == len(fast.fused.native)
    if not stacked:
        fast.fused.stack = None
    ran, stacked_runs = _counted(fast)
    ids = prompt(5, 19)
    got, want = _decode(fast, ids, 6), _decode(python, ids, 6)
    if stacked:
        assert stacked_runs == [True] * 6 and not ran
    else:
        assert not stacked_runs and ran == [True] * 6 * len(fast.fused.native)
    assert all(torch.equal(a, b) for a, b in zip(got[0], want[0], strict=True))
    assert all(torch.equal(ka, kb) and torch.equal(va, vb)
               for (ka, va), (kb, vb) in zip(got[1], want[1], strict=True))


@needs_kernel
@pytest.mark.parametrize("family", ["qwen3", "gemma3", "mistral", "phi3", "qwen2", "gemma2",
                                    "gemma2-global"])
def test_the_families_layers_give_the_fused_forwards_bits(tiny_tokenizer, family):
    """Qwen3's q / k norms, Gemma 3's sandwich norms, GELU and local layers (a past inside
    the window: no mask), Mistral's and Phi-3's windows, Qwen2's q / k / v biases and Gemma 2's
    soft-capped scores (a cap of 0.5 here, which bends them) run natively."""
    from tests.test_fused_families import _model

    fast, python = _runners(tiny_tokenizer, model=_model(family, len(tiny_tokenizer)))
    built = [layer is not None for layer in fast.fused.native]
    assert all(built) and fast.fused.stack is not None
    ran, stacked = _counted(fast)
    ids = prompt(7, 4)  # with 3 new tokens, inside the tiny models' window of 8
    got, want = _decode(fast, ids, 3), _decode(python, ids, 3)
    assert stacked == [True] * 3 and not ran  # Gemma's local and global tables in one call
    assert all(torch.equal(a, b) for a, b in zip(got[0], want[0], strict=True))
    assert all(torch.equal(ka, kb) and torch.equal(va, vb)
               for (ka, va), (kb, vb) in zip(got[1], want[1], strict=True))


@needs_kernel
def test_an_engine_generates_the_same_tokens_and_logits(tiny_tokenizer):
    fast, python = _runners(tiny_tokenizer)
    ran, stacked = _counted(fast)
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    outs = []
    for runner in (fast, python):
        engine = Engine(runner, make_engine(runner.model, tiny_tokenizer).codec, None)
        outs.append(engine.generate(Request(prompt(4, 30), params, record_logits=True)))
    assert stacked and all(stacked) and not ran
    assert outs[0].token_ids == outs[1].token_ids
    assert torch.equal(torch.stack(outs[0].step_logits), torch.stack(outs[1].step_logits))


@needs_kernel
@pytest.mark.parametrize("refusal", ["full cache", "float32 table", "other cache type"])
def test_a_stack_that_cannot_run_every_layer_writes_nothing(tiny_tokenizer, refusal):
    """One layer the stack cannot run (its last here) and it returns False with the stream and
    every cache as they were, for the layers to run one by one; given what it runs, it runs."""
    fast, _ = _runners(tiny_tokenizer)
    stack, ids = fast.fused.stack, prompt(5, 19)
    past = _reserved(fast, ids, 2)
    layers = past.layers
    width = fast.config.hidden_size
    hidden = torch.randn(1, width, generator=torch.Generator().manual_seed(3))
    position = torch.tensor([[len(ids)]])
    cos, sin = fast.fused.decoder.rotary_emb(hidden.to(torch.bfloat16).view(1, 1, -1),
                                             position_ids=position)
    tables = [(cos, sin)] * len(layers)
    caches = list(layers)
    if refusal == "full cache":
        layers[-1]._len = layers[-1]._k.shape[2]
    elif refusal == "float32 table":
        tables[-1] = (cos.float(), sin.float())
    else:
        caches[-1] = object()
    before = hidden.clone(), [(layer._len, layer._k.clone(), layer._v.clone())
                              for layer in layers]
    assert not stack.run(hidden, caches, tables)
    assert torch.equal(hidden, before[0])
    for layer, (n, k, v) in zip(layers, before[1], strict=True):
        assert layer._len == n and torch.equal(layer._k, k) and torch.equal(layer._v, v)
    fresh = _reserved(fast, ids, 2)
    assert stack.run(hidden, list(fresh.layers), [(cos, sin)] * len(layers))
    assert not torch.equal(hidden, before[0])
    assert all(layer._len == len(ids) + 1 for layer in fresh.layers)


@needs_kernel
def test_edited_and_replaced_norm_weights_are_seen(tiny_tokenizer):
    fast, python = _runners(tiny_tokenizer)
    ids = prompt(6, 11)
    _decode(fast, ids, 1)  # the norms' weights taken once
    for runner in (fast, python):
        layer = runner.model.model.layers[1]
        layer.input_layernorm.weight.data.mul_(1.5)
        layer.post_attention_layernorm.weight = nn.Parameter(
            layer.post_attention_layernorm.weight.detach() * 0.5)
    got, want = _decode(fast, ids, 3), _decode(python, ids, 3)
    assert all(torch.equal(a, b) for a, b in zip(got[0], want[0], strict=True))


def test_its_silu_table_is_torchs_silu():
    table = silu_table()
    x = torch.randn(4096).to(torch.bfloat16)
    x[:8] = torch.tensor([0.0, -0.0, torch.inf, -torch.inf, 1e-38, -88.0, 88.0, 3.0])
    bits = x.view(torch.int16).long() & 0xFFFF
    assert torch.equal(table[bits], nn.functional.silu(x).view(torch.int16))


def test_layers_it_does_not_run_keep_the_fused_forwards_layer(tiny_tokenizer):
    int8, _ = _runners(tiny_tokenizer, "int8")
    assert all(layer is None for layer in int8.fused.native)  # int8 weights: not its kernel
    fast, _ = _runners(tiny_tokenizer)
    layer = fast.fused.layers[0]
    assert NativeLayer.build(layer._replace(act=lambda x: x.float()), 128) is None
    assert NativeLayer.build(layer._replace(intermediate=200), 128) is None


def test_a_tables_values_are_the_activations_own():
    gelu = activation_table(lambda x: nn.functional.gelu(x, approximate="tanh"))
    x = torch.randn(2048).to(torch.bfloat16)
    bits = x.view(torch.int16).long() & 0xFFFF
    assert torch.equal(gelu[bits], nn.functional.gelu(x, approximate="tanh").view(torch.int16))
