"""Precision: which one runs (--dtype, a GGUF's own class, the device default), the packed
int4 / int8 layers that run it, and the real model at its own precision."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from torch import nn

from kvchat.errors import ModelOptionError
from kvchat.models.loading import describe_model, load_model
from kvchat.models.precision import (
    gguf_precision_class,
    gguf_tensor_types,
    resolve_precision,
)
from kvchat.models.quant import (
    Int4Linear,
    Int8HeadLinear,
    Int8Linear,
    precision_of,
    quantize_model,
    step_bytes,
)

# --- which precision runs -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("option", "device", "gguf_class", "expected"),
    [(None, "cpu", None, "float32"), (None, "cuda", None, "bfloat16"),
     (None, "cpu", "int4", "int4"), ("auto", "cpu", "int8", "int8"),
     ("fp32", "cpu", "int4", "float32"), ("q4", "cpu", None, "int4"),
     ("int8", "cpu", "float16", "int8"), (None, "cpu", "float16", "float16"),
     ("int4", "cuda:0", None, "bfloat16"), (None, "cuda", "int4", "bfloat16"),
     ("int8", "cuda", None, "bfloat16")],
)  # fmt: skip
def test_resolve_precision(option, device, gguf_class, expected, monkeypatch):
    from kvchat.models import gpu_weights

    monkeypatch.setattr(gpu_weights, "int4_on_gpu", lambda device: False)  # as without a GPU
    precision = resolve_precision(option, device, gguf_class)
    assert precision.name == expected
    assert precision.compute_dtype == ("bfloat16" if expected in ("int4", "int8") else expected)
    asked = option or gguf_class or ""
    if device.startswith("cuda") and asked.startswith(("int", "q")):  # no GPU here
        assert ("capability 8.0" if asked in ("int4", "q4") else "CPU only") in precision.why


def test_unknown_precision_names_the_choices():
    with pytest.raises(ModelOptionError, match="int4"):
        resolve_precision("int3", "cpu", None)


def _write_gguf(path, tensors: dict[str, tuple[np.ndarray, gguf.GGMLQuantizationType]],
                file_type: gguf.LlamaFileType | None = None):
    writer = gguf.GGUFWriter(str(path), "llama")
    if file_type is not None:
        writer.add_file_type(int(file_type))
    writer.add_token_list(["a", "b", "c"] * 100)  # an array of strings the header walk skips
    writer.add_context_length(16)
    for name, (array, qtype) in tensors.items():
        if qtype == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(name, array)
        else:  # packed bytes; the writer works out the logical shape from the type
            writer.add_tensor(name, gguf.quants.quantize(array, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_gguf_header_walk_counts_parameters_per_type(tmp_path):
    q8, f32 = gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.F32
    q4 = gguf.GGMLQuantizationType.Q4_0
    rng = np.random.default_rng(0)
    path = _write_gguf(tmp_path / "m.gguf", {
        "token_embd.weight": (rng.standard_normal((64, 32), dtype=np.float32), q8),
        "blk.0.attn_q.weight": (rng.standard_normal((64, 64), dtype=np.float32), q4),
        "blk.0.ffn_up.weight": (rng.standard_normal((128, 64), dtype=np.float32), q4),
        "blk.0.attn_norm.weight": (rng.standard_normal(64, dtype=np.float32), f32),
        "output.weight": (rng.standard_normal((64, 32), dtype=np.float32), q8),
    })
    # the token embedding and 1-D tensors do not count; the same as gguf's own reader sees
    assert gguf_tensor_types(path) == {int(q4): 64 * 64 + 128 * 64, int(q8): 64 * 32}
    reader = gguf.GGUFReader(str(path))
    assert {int(t.tensor_type) for t in reader.tensors if len(t.shape) == 2} == {int(q4), int(q8)}
    assert gguf_precision_class(path) == "int4"


@pytest.mark.parametrize(("file_type", "expected"), [
    (gguf.LlamaFileType.MOSTLY_Q4_K_M, "int4"), (gguf.LlamaFileType.MOSTLY_Q4_K_S, "int4"),
    (gguf.LlamaFileType.MOSTLY_Q3_K_M, "int4"), (gguf.LlamaFileType.MOSTLY_Q6_K, "int8"),
    (None, "int8"),
])
def test_the_file_type_decides_over_the_tensors_most_parameters_sit_in(tmp_path, file_type,
                                                                         expected):
    """A Q4_K_M file whose shapes made llama.cpp's quantizer fall back to Q5_0 / Q8_0 for most
    of its tensors (Gemma 3 270M's width, 640, is no multiple of a K-quant's 256) is int4; a
    file that names no type keeps the majority rule."""
    q5, q8 = gguf.GGMLQuantizationType.Q5_0, gguf.GGMLQuantizationType.Q8_0
    q4 = gguf.GGMLQuantizationType.Q4_0
    rng = np.random.default_rng(1)
    path = _write_gguf(tmp_path / "m.gguf", {
        "token_embd.weight": (rng.standard_normal((64, 32), dtype=np.float32), q8),
        "blk.0.attn_q.weight": (rng.standard_normal((64, 64), dtype=np.float32), q5),
        "blk.0.ffn_up.weight": (rng.standard_normal((128, 64), dtype=np.float32), q5),
        "blk.0.attn_output.weight": (rng.standard_normal((4, 256), dtype=np.float32), q4),
    }, file_type)
    assert gguf_precision_class(path) == expected


def test_tiny_f32_gguf_keeps_float32(tiny_gguf):
    assert gguf_precision_class(tiny_gguf) == "float32"
    report = describe_model(str(tiny_gguf), device="cpu")
    assert report.precision.name == "float32" and "GGUF" in report.precision.why


def test_not_a_gguf_has_no_class(tmp_path):
    (tmp_path / "x.gguf").write_bytes(b"nope" * 10)
    assert gguf_precision_class(tmp_path / "x.gguf") is None


# --- the packed layers --------------------------------------------------------------------


def _on_grid(n: int, k: int, q_lo: int, q_hi: int, seed: int = 0) -> torch.Tensor:
    """Weights on a 4-bit affine grid per 32 columns (what a Q4 GGUF de-quantizes to), each group
    using levels q_lo..q_hi only."""
    gen = torch.Generator().manual_seed(seed)
    step = 0.005 + 0.005 * torch.rand(n, k // 32, 1, generator=gen)
    low = 0.01 * torch.randn(n, k // 32, 1, generator=gen)
    q = torch.randint(q_lo, q_hi + 1, (n, k // 32, 32), generator=gen).float()
    q[..., 0], q[..., 1] = q_lo, q_hi
    return (low + step * q).reshape(n, k), step


@pytest.mark.parametrize(("q_lo", "q_hi"), [(0, 15), (3, 12), (5, 6)])
def test_int4_finds_the_grid_weights_came_from(q_lo, q_hi):
    weight, step = _on_grid(64, 128, q_lo, q_hi)
    layer = nn.Linear(128, 64, bias=False)
    layer.weight.data = weight
    error = (Int4Linear(layer).dequantized() - weight).abs().reshape(64, 4, 32) / step
    # bfloat16 scale / zero and output rounding only: a tenth of a step, where a fresh grid
    # over the group's range would be off by up to half of one of its own steps
    assert float(error.max()) < 0.2


def test_int4_and_int8_rows_are_independent_of_the_batch():
    """Each output row depends on its own input row only, bitwise: what keeps prefill,
    batched decode and draft verification consistent."""
    gen = torch.Generator().manual_seed(1)
    layer = nn.Linear(64, 48, bias=True)
    x = torch.randn(40, 64, generator=gen)
    for packed in (Int4Linear(layer), Int8Linear(layer)):
        full = packed(x)
        for rows in (1, 3, 17):
            assert torch.equal(packed(x[:rows]), full[:rows])
        reference = torch.nn.functional.linear(x, packed.dequantized(), layer.bias)
        assert torch.allclose(full.float(), reference, rtol=0.03, atol=0.05)


def test_quantize_model_swaps_layers_and_counts_bytes(tiny_model):
    before = step_bytes(tiny_model)
    summary = quantize_model(tiny_model, "int4")
    layers = tiny_model.model.layers
    assert all(isinstance(getattr(layer.self_attn, name), Int4Linear)
               for layer in layers for name in ("q_proj", "k_proj", "v_proj", "o_proj"))
    assert isinstance(tiny_model.lm_head, Int8HeadLinear)  # the head stays at 8 bits
    assert (summary.int4_layers, summary.int8_layers, summary.dense_layers) == (14, 1, 0)
    assert precision_of(tiny_model) == "int4"
    assert {p.dtype for p in tiny_model.parameters()} == {torch.bfloat16}
    assert summary.step_bytes < before / 3


def test_a_shape_no_kernel_takes_stays_dense():
    model = nn.Sequential(nn.Linear(24, 8))
    model.get_output_embeddings = lambda: None  # type: ignore[method-assign]
    model.get_input_embeddings = lambda: None  # type: ignore[method-assign]
    summary = quantize_model(model, "int4")
    assert summary.dense_layers == 1 and isinstance(model[0], nn.Linear)


def test_load_model_packs_at_the_asked_precision(tiny_model_dir):
    loaded = load_model(str(tiny_model_dir), dtype="int8", device="cpu")
    assert loaded.precision.name == "int8" and precision_of(loaded.model) == "int8"
    assert loaded.dtype == torch.bfloat16  # activations and K/V
    assert loaded.facts.n_params is not None and loaded.facts.n_params > 0
    assert 0 < loaded.step_bytes < 2 * loaded.facts.n_params


# --- the real model -----------------------------------------------------------------------


@pytest.mark.slow
def test_embedded_model_runs_int4_by_default(embedded_gguf, use_embedded_cache):
    from kvchat.config import CacheConfig
    from kvchat.engine.engine import Engine
    from kvchat.engine.verify import verify_prompt

    report = describe_model(None, device="cpu")
    assert report.precision.name == "int4" and report.step_bytes is not None
    assert 80 << 20 < report.step_bytes < 100 << 20  # llama.cpp reads ~85 MB per token
    loaded = load_model(None, device="cpu")
    assert precision_of(loaded.model) == "int4"
    dense = load_model(None, dtype="float32", device="cpu").model
    for packed, original in ((loaded.model.model.layers[3].mlp.down_proj,
                              dense.model.layers[3].mlp.down_proj),
                             (loaded.model.model.layers[0].self_attn.q_proj,
                              dense.model.layers[0].self_attn.q_proj)):
        w = original.weight.detach()
        groups = w.reshape(w.shape[0], -1, 32)
        step = (groups.amax(-1) - groups.amin(-1)) / 15  # Q4_1 spans each group's range
        error = (packed.dequantized() - w).abs().reshape(groups.shape).amax(-1)
        assert float((error / step.clamp_min(1e-8)).max()) < 0.25
    engine = Engine.create(loaded.model, loaded.tokenizer, CacheConfig(16, num_blocks=256))
    ids = engine.codec.encode_chat([{"role": "user", "content": "Name three colours."}])
    rows = verify_prompt(engine, ids, "colours", max_new_tokens=24)
    assert all(r.ok for r in rows), rows
    assert rows[3].scenario == "plain generate" and rows[3].tokens_equal
    assert all(r.exact and r.max_logit_diff == 0.0 for r in rows), rows
    assert rows[1].draft_accepted > 0
