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

from typing import Any

import torch


def int4_rows(data: Any, ggml_type: int, order: Any) -> tuple[torch.Tensor, ...] | None:
    """The int4 layout (qweight, scales, zeros) of a Q4_1 / Q4_K tensor's rows of bytes `data`,
    its rows put in `order` (None: as they are); None for another type or where kvchat's int4
    kernel does not run."""
    from kvchat.models.native import int4_from_blocks

    blocks = int4_from_blocks(data, ggml_type)
    if blocks is None or order is None:
        return blocks
    rows = torch.from_numpy(order)
    return tuple(t.index_select(0, rows).contiguous() for t in blocks)


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
