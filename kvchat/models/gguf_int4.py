"""A GGUF's 4-bit linear weights put into kvchat's int4 layers as the file holds them.

A Q4_1 or Q4_K group of 32 weights already is an int4 grid (w = q * scale + zero, q in
[0, 15]), and Q4_K's nibbles are already laid out as kvchat's int4 kernel reads them
(int4_matmul.c), so such a tensor needs neither a float copy nor a grid search
(`quant.quantize_int4`): `native.int4_from_blocks` reads its rows as they are, and transformers'
tensor processor, asked what it does to the row numbers, says which order they go in (Llama's
q and k rows, interleaved by llama.cpp for its rope, go back to Hugging Face's). A tensor
whose processor does more than reorder rows, and every other type, is read as before
(`gguf_weights`).
"""

from __future__ import annotations

import mmap
from typing import Any

import torch
from torch import nn

from kvchat.models.gguf_weights import _data, _owner, _place
from kvchat.models.precision import GGUFTensor
from kvchat.models.quant import Int4Linear


def read_int4(buf: mmap.mmap, tensor: GGUFTensor, model: Any, names: dict[str, str],
               processor: Any, config: Any) -> int:
    """Put a Q4_1 or Q4_K linear weight (not the head) into its int4 layer as the file holds it
    (`native.int4_from_blocks`: no float copy, no grid search), its rows in the order the
    processor gives them. Returns the parameters set; 0 where this does not apply (another
    type or layer, no native kernel, a processor that does more than reorder rows): the tensor
    is then de-quantized and packed as any other."""
    from kvchat.models.native import int4_from_blocks

    if len(tensor.dims) != 2:
        return 0
    k, n = tensor.dims
    found = row_order(processor, tensor.name, names, config, n)
    if found is None:
        return 0
    order, hf_name = found
    parent, leaf = _owner(model, hf_name)
    if leaf != "weight" or not isinstance(parent, nn.Linear) \
            or parent is model.get_output_embeddings() \
            or (parent.out_features, parent.in_features) != (n, k) or not Int4Linear.fits(parent):
        return 0
    blocks = int4_from_blocks(_data(buf, tensor), tensor.ggml_type)
    if blocks is None:
        return 0
    q, scales, zeros = blocks
    if order is not None:
        rows = torch.from_numpy(order)
        q, scales, zeros = (t.index_select(0, rows).contiguous() for t in blocks)
    dense = nn.Linear(k, n, bias=False, device="meta")
    _place(model, hf_name.rpartition(".")[0], parent, dense,
           lambda linear: Int4Linear.from_native(linear, q, scales, zeros))
    return n * k


def row_order(processor: Any, name: str, names: dict[str, str], config: Any, n: int
               ) -> tuple[Any, str] | None:
    """(the row order the processor puts an (n, K) tensor named `name` in, None when it keeps
    them; the parameter it goes to), found by passing it the row numbers; None where it does
    anything else to them."""
    import numpy as np

    probe = np.arange(n, dtype=np.float64).reshape(n, 1)
    try:
        result = processor.process(weights=probe, name=name, tensor_key_mapping=names,
                                   parsed_parameters={"config": config.to_dict(), "tensors": {}})
    except Exception:  # a processor that needs the real values: read them
        return None
    rows, hf_name = getattr(result, "weights", None), names.get(getattr(result, "name", ""))
    if hf_name is None or not isinstance(rows, np.ndarray) or rows.shape != (n, 1) \
            or not np.array_equal(np.sort(rows[:, 0]), probe[:, 0]):
        return None
    order = rows[:, 0].astype(np.int64)
    return (None if np.array_equal(order, probe[:, 0]) else order), hf_name
