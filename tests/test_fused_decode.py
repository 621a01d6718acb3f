"""The fused decode forward computes bitwise what the model's own forward does: logits and the
K/V it writes, for one row and for left-padded batches, one query and several (drafts), with the
projections stacked into one matmul (widths in whole int4 packing blocks) and without."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import build_tiny_config, build_tiny_model, make_engine

from kvchat.config import SamplingParams
from kvchat.engine.engine import Engine
from kvchat.engine.fused_decode import FusedDecoder
from kvchat.engine.model_runner import ModelRunner
from kvchat.engine.past import pack_right_aligned, past_kv, reserved_past, wrap_past
from kvchat.engine.sequence import Request
from kvchat.models.quant import quantize_model
from tests.test_engine import prompt


def _pair(tokenizer, precision: str, hidden: int):
    """(reference runner, fused runner) over two copies of one packed tiny model."""
    model = build_tiny_model(build_tiny_config(tokenizer, hidden_size=hidden,
                                               intermediate_size=2 * hidden))
    quantize_model(model, precision)
    reference = ModelRunner(copy.deepcopy(model))
    reference.fused = None
    fused = ModelRunner(model)
    assert fused.fused is not None
    return reference, fused


def _prefilled(runner: ModelRunner, ids: list[int]):
    past = runner.past()
    with torch.no_grad():
        runner.model(input_ids=torch.tensor([ids]), past_key_values=past, use_cache=True)
    return past_kv(past, 0, len(ids))


def _copy(kv):
    return [(k.clone(), v.clone()) for k, v in kv]


def _same_kv(a, b, width: int) -> bool:
    return all(torch.equal(ka, kb) and torch.equal(va, vb)
               for (ka, va), (kb, vb) in zip(past_kv(a, 0, width), past_kv(b, 0, width),
                                             strict=True))


# hidden 64: k/v projections of 32 rows, one call each; 128: q/k/v and gate/up stacked
@pytest.mark.parametrize("hidden", [64, 128])
@pytest.mark.parametrize("precision", ["int4", "int8"])
@pytest.mark.parametrize("queries", [1, 3])
def test_one_row_after_a_wrapped_past(tiny_tokenizer, precision, hidden, queries):
    check_one_row(*_pair(tiny_tokenizer, precision, hidden), queries)


def check_one_row(reference: ModelRunner, fused: ModelRunner, queries: int) -> None:
    """One row of `queries` ids after a 21-token past: the same logits and K/V from both."""
    kv = _prefilled(reference, prompt(1, 21))
    ids = torch.tensor([prompt(2, queries)])
    with torch.no_grad():
        past_a, past_b = wrap_past(_copy(kv), reference.config), wrap_past(_copy(kv), fused.config)
        a, _ = reference.forward(ids, past_a, columns=range(queries))
        b, _ = fused.forward(ids, past_b, columns=range(queries))
    assert torch.equal(a, b)
    assert _same_kv(past_a, past_b, 21 + queries)


def check_left_padded_batch(reference: ModelRunner, fused: ModelRunner, queries: int) -> None:
    """Three rows of different lengths left-padded into reserved buffers, one with a hole as a
    rejected draft leaves: the same logits and K/V from both runners."""
    lengths = [9, 17, 13]
    rows = [_prefilled(reference, prompt(10 + i, n)) for i, n in enumerate(lengths)]
    width, capacity = max(lengths), max(lengths) + 8
    buffers = pack_right_aligned(rows, lengths, width, capacity, like=rows[0])
    mask = torch.zeros(len(rows), capacity, dtype=torch.bool)
    for i, n in enumerate(lengths):
        mask[i, width - n : width + queries] = True
    mask[1, width - 5] = False  # a hole, as a rejected draft leaves
    pos = torch.tensor(lengths)[:, None] + torch.arange(queries)
    ids = torch.tensor([prompt(20 + i, queries) for i in range(len(rows))])
    columns = list(range(queries)) if queries > 1 else None
    with torch.no_grad():
        past_a = reserved_past(_copy(buffers), width, reference.config)
        past_b = reserved_past(_copy(buffers), width, fused.config)
        a, _ = reference.forward(ids, past_a, mask, pos, columns=columns)
        b, _ = fused.forward(ids, past_b, mask, pos, columns=columns)
    assert torch.equal(a, b)
    assert _same_kv(past_a, past_b, width + queries)


@pytest.mark.parametrize("hidden", [64, 128])
@pytest.mark.parametrize("precision", ["int4", "int8"])
@pytest.mark.parametrize("queries", [1, 3])
def test_left_padded_batch_in_reserved_buffers(tiny_tokenizer, precision, hidden, queries):
    check_left_padded_batch(*_pair(tiny_tokenizer, precision, hidden), queries)


def test_an_empty_past(tiny_tokenizer):
    reference, fused = _pair(tiny_tokenizer, "int4", 128)
    ids = torch.tensor([prompt(3, 5)])
    with torch.no_grad():
        past_a, past_b = reference.past(), fused.past()
        a, _ = reference.forward(ids, past_a)
        b, _ = fused.forward(ids, past_b)
    assert torch.equal(a, b)
    assert _same_kv(past_a, past_b, 5)


def test_decode_runs_fused_and_generates_the_same_tokens(tiny_tokenizer):
    reference, fused = _pair(tiny_tokenizer, "int4", 128)
    calls = []
    forward = fused.fused.forward

    def counted(*args):
        calls.append(args[0].shape)
        return forward(*args)

    fused.fused.forward = counted  # type: ignore[method-assign]
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    ids = prompt(4, 30)
    outs = []
    for runner in (reference, fused):
        engine = Engine(runner, make_engine(runner.model, tiny_tokenizer).codec, None)
        outs.append(engine.generate(Request(ids, params, record_logits=True)))
    assert outs[0].token_ids == outs[1].token_ids
    assert torch.equal(torch.stack(outs[0].step_logits), torch.stack(outs[1].step_logits))
    assert len(calls) == 7 and all(shape == (1, 1) for shape in calls)  # decode steps only


def test_models_it_does_not_cover_keep_their_forward(tiny_model, tiny_tokenizer):
    assert FusedDecoder.build(tiny_model) is None  # float32: the model's own forward
    assert ModelRunner(tiny_model).fused is None
    model = build_tiny_model(build_tiny_config(tiny_tokenizer, hidden_size=128))
    quantize_model(model, "int4")
    assert ModelRunner(model).fused is not None
    assert ModelRunner(model).fused is ModelRunner(model).fused  # built once per model
    other = build_tiny_model(build_tiny_config(tiny_tokenizer, hidden_size=128))
    quantize_model(other, "int4")
    down = other.model.layers[1].mlp.down_proj  # a layer left dense: not a packed matmul
    other.model.layers[1].mlp.down_proj = torch.nn.Linear(down.in_features, down.out_features,
                                                          bias=False)
    assert ModelRunner(other).fused is None
    gelu = build_tiny_model(build_tiny_config(tiny_tokenizer, hidden_size=128))
    quantize_model(gelu, "int4")
    gelu.model.layers[1].mlp.act_fn = torch.nn.GELU()  # another activation: its own module
    assert ModelRunner(gelu).fused is not None


@pytest.mark.parametrize("queries", [1, 3])
def test_a_batch_holding_its_rows_shared_head_once(tiny_tokenizer, queries):
    """Rows that start with the same 70 positions, held once beside their own columns (a
    left-padded batch with a hole), give the logits of the same rows each holding a copy:
    the attention differs only in how its matmuls split, so within a few bfloat16 steps."""
    reference, fused = _pair(tiny_tokenizer, "int4", 128)
    header = prompt(30, 70)
    tails = [prompt(40 + i, n) for i, n in enumerate([4, 9, 6])]
    rows = [_prefilled(reference, header + t) for t in tails]
    lengths = [70 + len(t) for t in tails]
    width, capacity = max(lengths), max(lengths) + 8
    full = pack_right_aligned(rows, lengths, width, capacity, like=rows[0])
    own = [len(t) for t in tails]
    own_width = max(own)
    held = pack_right_aligned([[(k[:, :, 70:], v[:, :, 70:]) for k, v in r] for r in rows], own,
                              own_width, own_width + 8, like=rows[0])
    head = [(k[:, :, :70].clone(), v[:, :, :70].clone()) for k, v in rows[0]]
    masks = []
    for w, cap, n_of in ((width, capacity, lengths), (own_width, own_width + 8, own)):
        mask = torch.zeros(len(rows), cap, dtype=torch.bool)
        for i, n in enumerate(n_of):
            mask[i, w - n : w + queries] = True
        mask[1, w - 3] = False  # a hole, as a rejected draft leaves (in row 1's own columns)
        masks.append(mask)
    pos = torch.tensor(lengths)[:, None] + torch.arange(queries)
    ids = torch.tensor([prompt(50 + i, queries) for i in range(len(rows))])
    columns = list(range(queries)) if queries > 1 else None
    with torch.no_grad():
        copies = reserved_past(_copy(full), width, fused.config)
        once = reserved_past(_copy(held), own_width, fused.config, head=head)
        a, _ = fused.forward(ids, copies, masks[0], pos, columns=columns)
        b, _ = fused.forward(ids, once, masks[1], pos, columns=columns)
        with pytest.raises(RuntimeError, match="shared head"):
            reference.forward(ids, reserved_past(_copy(held), own_width, fused.config, head=head),
                              masks[1], pos, columns=columns)
    scale = float(a.abs().max())
    assert a.shape == b.shape and float((a - b).abs().max()) <= scale * 2**-5
