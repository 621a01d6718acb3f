"""--compile: one-token decode steps through torch.compile, on the tiny model at int4. Compiling
takes ~25 s here, so one test covers it: the compiled step runs, and its tokens and logits
stay within the precision's rounding of the eager step's."""

from __future__ import annotations

from kvchat.config import CacheConfig, SamplingParams
from kvchat.engine.engine import Engine
from kvchat.engine.sequence import Request
from kvchat.engine.verify import compare
from tests.test_engine import at_precision, prompt


def test_compiled_decode_steps_match_eager_ones(tiny_model, tiny_tokenizer):
    engine = Engine.create(at_precision(tiny_model, "int4"), tiny_tokenizer,
                           CacheConfig(4, num_blocks=256))
    params = SamplingParams(max_new_tokens=10, ignore_eos=True)
    ids = prompt(300, 25)
    eager = engine.without_cache().generate(Request(ids, params, record_logits=True))
    runner = engine.runner
    runner.compile_decode()
    compiled, calls = runner._decode_fn, []
    assert compiled is not None

    def counted(*args, **kwargs):
        calls.append(1)
        return compiled(*args, **kwargs)

    runner._decode_fn = counted
    again = Engine(runner, engine.codec, None).generate(Request(ids, params, record_logits=True))
    assert len(calls) == 9  # every decode step after the first token, none of the prefill
    c = compare(eager, again, "int4")
    assert c.ok, c
