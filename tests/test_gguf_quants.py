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
from kvchat.models.block_head import BlockHeadLinear
from kvchat.models.loading import load_model
from kvchat.models.quant_embeddings import BlockEmbedding


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
    assert [r.source for r in rows] == ["radix", "exact", "off", "off"]
    assert all(r.ok and r.generated == 6 for r in rows), rows
    # bitwise wherever the fixed-order kernels take the compute dtype (not float16)
    assert all(r.exact for r in rows) == (native.precision.compute_dtype != "float16")


@pytest.mark.parametrize(("quant", "precision"), [("Q4_K_M", "int4"), ("Q8_0", "int8"),
                                                  ("Q6_K", "int4"), ("F16", "bfloat16")])
def test_a_gguf_streams_into_the_model_bit_for_bit_as_a_float32_copy_gave(
        quant, precision, tiny_tokenizer, tmp_path):
    """Each tensor read from the file and packed as it arrives gives the very numbers that
    de-quantizing the whole file to float32 (transformers' GGUF loader) and packing that gave,
    while holding one tensor in float32 at a time; except the Q4_K layers at int4, which are
    read as they are (their groups already are int4 grids): their q * scale + zero is the
    float32 copy's value to float16's rounding of the scale and zero."""
    from transformers import AutoModelForCausalLM

    from kvchat.models.gguf_weights import load_gguf_weights
    from kvchat.models.native import int4_native
    from kvchat.models.precision import torch_dtype
    from kvchat.models.quant import Int4Linear, quantize_model, unpack_int4

    config = build_tiny_config(tiny_tokenizer, hidden_size=256, intermediate_size=256,
                               num_hidden_layers=2)
    path = write_tiny_gguf(build_tiny_model(config), tiny_tokenizer, tmp_path / f"{quant}.gguf",
                           QUANTS[quant])
    loaded = load_model(str(path), dtype=precision)
    dtype = torch_dtype("bfloat16")
    whole = AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32 if precision != "bfloat16"
        else dtype, local_files_only=True).eval()
    floats = {name: m.weight.detach().clone() for name, m in whole.named_modules()
              if isinstance(m, torch.nn.Linear)}
    if precision in ("int4", "int8"):
        quantize_model(whole, precision)
    head = loaded.model.get_output_embeddings()
    if isinstance(head, BlockHeadLinear):  # a Q6_K head kept as the file's blocks
        assert quant in ("Q4_K_M", "Q6_K")
        assert torch.equal(head.dequantized(), floats["lm_head"])  # the file's numbers
        whole.lm_head = head  # the rest compared beside the same head
    ours, theirs = loaded.model.state_dict(), whole.state_dict()
    embed = loaded.model.get_input_embeddings()
    if isinstance(embed, BlockEmbedding):  # a K-quant table kept as the file's blocks
        assert quant in ("Q4_K_M", "Q6_K") and precision in ("int4", "int8")
        ids = torch.arange(embed.num_embeddings)
        assert torch.equal(embed(ids), whole.get_input_embeddings()(ids))
        ours = {k: v for k, v in ours.items() if k != "model.embed_tokens.blocks"}
        theirs = {k: v for k, v in theirs.items() if k != "model.embed_tokens.weight"}
    assert ours.keys() == theirs.keys()
    # llama.cpp's names of the layers, for their type in the file
    file_names = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v",
                  "o_proj": "attn_output", "gate_proj": "ffn_gate", "up_proj": "ffn_up",
                  "down_proj": "ffn_down"}
    as_they_are = set()
    for name, layer in loaded.model.named_modules():
        leaf, index = name.rpartition(".")[2], name.split(".")[2] if ".layers." in name else ""
        kind = QUANTS[quant](f"blk.{index}.{file_names.get(leaf, leaf)}.weight")
        if isinstance(layer, Int4Linear) and kind == "Q4_K" and int4_native():
            as_they_are.add(name)
            q, scales, zeros = unpack_int4(layer.qweight, layer.scales, layer.zeros)
            w = q.reshape(layer.out_features, -1, 32) * scales.float()[..., None] \
                + zeros.float()[..., None]
            slack = 16 * 2.0**-11 * (scales.float().abs() + zeros.float().abs())
            error = (w - floats[name].reshape(w.shape)).abs()
            assert (error <= slack[..., None] + 2.0**-24).all(), name
    assert bool(as_they_are) == (quant == "Q4_K_M" and precision == "int4" and int4_native())
    assert all(ours[k].dtype == theirs[k].dtype and torch.equal(ours[k], theirs[k])
               for k in ours if k.rpartition(".")[0] not in as_they_are)
    ids = torch.tensor([[5, 9, 2, 40, 7]])
    with torch.no_grad():
        if as_they_are:  # the weights checked above; the logits near the re-gridded ones
            assert torch.allclose(loaded.model(ids).logits, whole(ids).logits, atol=0.1)
        else:
            assert torch.equal(loaded.model(ids).logits, whole(ids).logits)
    _, done = load_gguf_weights(path, loaded.model.config, precision, dtype)
    kept = {"token_embd.weight"} if isinstance(embed, BlockEmbedding) else set()  # as blocks
    kept |= {"output.weight"} if isinstance(head, BlockHeadLinear) else set()
    biggest = max(t.n_elements for t in gguf.GGUFReader(path).tensors if t.name not in kept)
    assert done.largest_float_bytes == 4 * biggest  # one tensor at a time, never the model
    assert done.n_params == loaded.facts.n_params


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("precision", ["int4", "int8", "bfloat16"])
def test_the_embedding_and_head_read_by_rows_give_the_whole_tensors_numbers(
        precision, tied, tiny_tokenizer, tmp_path, monkeypatch):
    """With chunks of 4 KiB the token embedding and the head are read a few rows at a time
    (cast into the embedding's rows, and quantized row by row for an int8 head, the one tied
    to the embedding too): the same state as reading each whole, and never the whole tensor
    in float32."""
    from kvchat.models import gguf_weights
    from kvchat.models.precision import torch_dtype

    config = build_tiny_config(tiny_tokenizer, hidden_size=256, intermediate_size=256,
                               num_hidden_layers=1, tie_word_embeddings=tied)
    # a Q5_K head: packed int8 from its rows (a Q6_K one keeps the file's blocks)
    path = write_tiny_gguf(build_tiny_model(config), tiny_tokenizer, tmp_path / "m.gguf",
                           lambda name: "Q5_K" if name == "output.weight" else q4_k_m(name))
    whole = load_model(str(path), dtype=precision)
    dtype = torch_dtype("bfloat16")
    _, read_whole = gguf_weights.load_gguf_weights(path, whole.model.config, precision, dtype)
    monkeypatch.setattr(gguf_weights, "CHUNK_ROWS_BYTES", 4096)
    model, by_rows = gguf_weights.load_gguf_weights(path, whole.model.config, precision, dtype)
    ours, theirs = model.state_dict(), whole.model.state_dict()
    assert ours.keys() == theirs.keys()
    assert all(ours[k].dtype == theirs[k].dtype and torch.equal(ours[k], theirs[k])
               for k in ours)
    assert (by_rows.int4_layers, by_rows.int8_layers, by_rows.n_params) == \
        (read_whole.int4_layers, read_whole.int8_layers, read_whole.n_params)
    embedding = len(tiny_tokenizer) * 256 * 4
    assert read_whole.largest_float_bytes == embedding
    # the largest float tensor held is now a layer's (256 x 256), not the embedding
    assert by_rows.largest_float_bytes == 256 * 256 * 4 < embedding
    if tied and precision == "bfloat16":
        assert model.get_output_embeddings().weight is model.get_input_embeddings().weight


@pytest.mark.parametrize(("quant", "shared"), [("Q8_0", True), ("Q4_K_M", False)])
def test_a_tied_embedding_the_int8_head_holds_exactly_is_read_from_it(
        quant, shared, tiny_tokenizer, tmp_path, monkeypatch):
    """Read by rows, a tied Q8_0 table is the int8 head's rows exactly, so the embedding reads
    them from the head instead of holding a bfloat16 copy: the same logits, bitwise, as a
    load that keeps the copy. Q4_K_M's K-quant table is not on int8's grid and is kept as the
    file's blocks (`BlockEmbedding`), the same rows as a bfloat16 copy."""
    from kvchat.models import gguf_weights
    from kvchat.models.precision import torch_dtype
    from kvchat.models.quant_embeddings import TiedInt8Embedding

    config = build_tiny_config(tiny_tokenizer, hidden_size=256, intermediate_size=256,
                               num_hidden_layers=1, tie_word_embeddings=True)
    path = write_tiny_gguf(build_tiny_model(config), tiny_tokenizer, tmp_path / "m.gguf",
                           QUANTS[quant])
    # both in bfloat16 throughout: a float32 residual stream would read a shared table's rows
    # exactly, and a bfloat16 copy's rounded (checked below)
    monkeypatch.setattr("kvchat.models.residual.float32_residual", lambda model: False)
    whole = load_model(str(path), dtype="int8")
    assert type(whole.model.get_input_embeddings()) is \
        (torch.nn.Embedding if shared else BlockEmbedding)
    monkeypatch.setattr(gguf_weights, "CHUNK_ROWS_BYTES", 4096)
    model, _ = gguf_weights.load_gguf_weights(path, whole.model.config, "int8",
                                              torch_dtype("bfloat16"))
    embed = model.get_input_embeddings()
    assert isinstance(embed, TiedInt8Embedding) == shared
    assert isinstance(embed, BlockEmbedding) != shared
    ids = torch.tensor([[5, 9, 2, 40, 7, 0]])
    assert torch.equal(embed(ids), whole.model.get_input_embeddings()(ids))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, whole.model(ids).logits)
    if shared:  # no parameter holds the table
        assert not any(p.numel() == len(tiny_tokenizer) * 256 for p in model.parameters())
        embed.out_dtype = torch.float32  # as under the float32 residual: the file's numbers
        assert torch.equal(embed(ids), model.get_output_embeddings().rows(ids))
