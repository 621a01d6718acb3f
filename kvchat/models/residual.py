"""The residual stream of a quantized model, held in float32.

Under int4 and int8 every weight kernel takes bfloat16 inputs and gives bfloat16 outputs. Between
the kernels runs the residual stream: the embedding, to which each layer adds its attention and
its MLP output. In bfloat16 (8 bits of mantissa) each of those adds rounds away what a small
update contributed, the norms read the rounded sum, and a tied Q8_0 embedding (int8 times a
float16 scale) is rounded before the first layer. The float32 model a GGUF loads as, the
reference `kvchat verify --fidelity` compares with, keeps all of it in float32, as llama.cpp does.

`float32_residual(model)` makes the embedding's output float32 (a tied int8 embedding computes
its rows in float32, so a Q8_0 table arrives exactly). transformers' decoder layers then add in
float32 (type promotion), their RMSNorms compute in float32 and return float32, and each matmul
rounds its own input to bfloat16 (`QuantLinear`): the kernels' input type is unchanged. The
rotary tables are asked for at the compute dtype, so q, k and the cached K/V stay bfloat16, the
pool's dtype. The int8 output head takes the final norm's float32 as it is. Every op added is
elementwise, so a row's numbers still depend on that row alone (batch-invariant). Only the
families of `DECODER_FAMILIES` take it: kvchat's fused forward repeats their modules'
arithmetic, dtypes included, so both forwards keep giving the same bits.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from kvchat.models.architectures import DECODER_FAMILIES

_ATTRIBUTE = "kvchat_residual_dtype"  # set on the model: the residual stream's dtype


def float32_residual(model: Any) -> bool:
    """Hold `model`'s residual stream in float32 (see the module doc); True if it now does.
    Idempotent; a model of another family is left as it is."""
    if getattr(model, _ATTRIBUTE, None) == torch.float32:
        return True
    if type(model).__name__ not in DECODER_FAMILIES or not hasattr(model, "get_decoder"):
        return False
    decoder = model.get_decoder()
    rotary, embed = getattr(decoder, "rotary_emb", None), model.get_input_embeddings()
    if rotary is None or embed is None:
        return False
    compute = next(model.parameters()).dtype
    tables = rotary.forward

    @functools.wraps(tables)  # keeps the signature the fused forward reads (Gemma 3's layer_type)
    def at_compute_dtype(x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        return tables(x.to(compute), *args, **kwargs)

    rotary.forward = at_compute_dtype
    if hasattr(embed, "out_dtype"):  # TiedInt8Embedding: its rows in float32 from the start
        embed.out_dtype = torch.float32
    else:
        embed.register_forward_hook(lambda _module, _args, out: out.float())
    setattr(model, _ATTRIBUTE, torch.float32)
    return True


def residual_dtype(model: Any) -> torch.dtype:
    """The dtype `model`'s residual stream runs in."""
    dtype: torch.dtype = getattr(model, _ATTRIBUTE, None) or next(model.parameters()).dtype
    return dtype
