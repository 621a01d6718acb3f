"""--compile: one-token decode steps of a batch through torch.compile, on the tiny model at int4
(a one-row step keeps the fused forward, which is faster there). Compiling takes ~25 s here, so
one test covers it: the compiled step runs for a batch and not for one row, and its tokens and
logits stay within the precision's rounding of the eager step's."""

from __future__ import annotations

from kvchat.config import CacheConfig, SamplingParams
from kvchat.engine.engine import Engine
from kvchat.engine.sequence import Request
from kvchat.engine.verify import compare
from tests.test_engine import at_precision, prompt


def _pair(engine: Engine, prompts, params):
    handles = [engine.submit(Request(p, params, record_logits=True)) for p in prompts]
    while not engine.idle:
        engine.step()
    return [h.result for h in handles]


def test_compiled_decode_steps_match_eager_ones(tiny_model, tiny_tokenizer):
    engine = Engine.create(at_precision(tiny_model, "int4"), tiny_tokenizer,
                           CacheConfig(4, num_blocks=256))
    params = SamplingParams(max_new_tokens=10, ignore_eos=True)
    prompts = [prompt(300, 25), prompt(301, 19)]
    eager = _pair(engine.without_cache(), prompts, params)
    runner = engine.runner
    assert runner.fused is not None
    runner.compile_decode()
    compiled, calls = runner._decode_fn, []
    assert compiled is not None

    def counted(*args, **kwargs):
        calls.append(kwargs["input_ids"].shape[0])
        return compiled(*args, **kwargs)

    runner._decode_fn = counted
    again = _pair(Engine(runner, engine.codec, None), prompts, params)
    assert calls == [2] * 9  # every decode step of the pair after its first tokens
    for cold, warm in zip(eager, again, strict=True):
        c = compare(cold, warm, "int4")
        assert c.ok, c
    calls.clear()
    alone = Engine(runner, engine.codec, None).generate(Request(prompts[0], params))
    assert calls == [] and alone.token_ids  # one row: the fused forward, not the compiled one
