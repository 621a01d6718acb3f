"""Every GGUF quantization transformers can read converts and runs: a 256-wide tiny Llama (a
K-quant block is 256 values) written as F16, Q8_0, Q5_K, Q6_K and a Q4_K_M-like mix, converted
by kvchat, holding exactly the weights gguf-py decodes from the file, and cached == cold."""

from __future__ import annotations

import gguf
import pytest
import torch
from conftest import build_tiny_config, build_tiny_model, write_tiny_gguf

from kvchat.config import CacheConfig
from kvchat.engine.engine import Engine
from kvchat.engine.verify import verify_prompt
from kvchat.models.loading import load_model


def q4_k_m(name: str) -> str:
    # llama.cpp's Q4_K_M: Q4_K, with Q6_K for the output and (some) attn_v and ffn_down
    six = name == "output.weight" or name.endswith((".attn_v.weight", ".ffn_down.weight"))
    return "Q6_K" if six else "Q4_K"


QUANTS = {
    "F16": lambda name: "F16",
    "Q8_0": lambda name: "Q8_0",
    "Q5_K": lambda name: "Q5_K",
    "Q6_K": lambda name: "Q6_K",
    "Q4_K_M": q4_k_m,
}

# the precision class each file runs at without --dtype
PRECISION = {"F16": "float16", "Q8_0": "int8", "Q5_K": "int8", "Q6_K": "int8", "Q4_K_M": "int4"}


@pytest.mark.parametrize("quant", list(QUANTS))
def test_a_quantized_gguf_converts_and_runs_exactly(quant, tiny_tokenizer, tmp_path):
    config = build_tiny_config(tiny_tokenizer, hidden_size=256, intermediate_size=256,
                               num_hidden_layers=1)
    path = write_tiny_gguf(build_tiny_model(config), tiny_tokenizer, tmp_path / f"{quant}.gguf",
                           QUANTS[quant])
    loaded = load_model(str(path), dtype="float32")
    # the converted weights are the file's, as gguf-py decodes them
    tensors = {t.name: t for t in gguf.GGUFReader(path).tensors}
    down = tensors["blk.0.ffn_down.weight"]
    assert down.tensor_type.name == QUANTS[quant]("blk.0.ffn_down.weight")
    decoded = torch.from_numpy(gguf.quants.dequantize(down.data, down.tensor_type).copy())
    assert torch.equal(loaded.model.model.layers[0].mlp.down_proj.weight, decoded.float())
    # and the model runs through the cache at the file's own precision: greedy output with a
    # hit equals a cold run, which equals transformers' generate
    native = load_model(str(path))
    assert native.precision.name == PRECISION[quant]
    engine = Engine.create(native.model, native.tokenizer, CacheConfig(4, num_blocks=128))
    prompt = engine.codec.encode_chat([{"role": "user", "content": "What is a K-quant?"}])
    rows = verify_prompt(engine, prompt, quant, 6)
    assert [r.source for r in rows] == ["radix", "exact", "off"]
    assert all(r.ok and r.generated == 6 for r in rows), rows
