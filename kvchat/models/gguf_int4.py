"""A GGUF's 4-bit linear weights put into kvchat's int4 layers as the file holds them.

A Q4_1 or Q4_K group of 32 weights already is an int4 grid (w = q * scale + zero, q in
[0, 15]), so such a tensor needs neither a float copy nor a grid search
(`quant.quantize_int4`): `native.int4_from_blocks` reads its rows as they are into the int4
kernel's tiles (int4_matmul.c), and transformers' tensor processor, asked what it does to the
row numbers, says which order they go in first (Llama's q and k rows, interleaved by llama.cpp
for its rope, go back to Hugging Face's). A tensor
whose processor does more than reorder rows, and every other type, is read as before
(`gguf_weights`).
"""

from __future__ import annotations

import contextlib
import mmap
from pathlib import Path
from typing import Any

from torch import nn

from kvchat.files import read_map
from kvchat.models.native import int4_from_blocks
from kvchat.models.precision import GGUFTensor, gguf_layout


def row_order(processor: Any, name: str, names: dict[str, str], config: Any, n: int
              ) -> tuple[Any, str] | None:
    """(the row order the processor puts an (n, K) tensor named `name` in, None when it keeps
    them; the parameter it goes to), found by passing it the row numbers; None where it does
    anything else to them."""
    found = _permutation(processor, name, config, n)
    if found is None:
        return None
    order, result_name = found
    hf_name = names.get(result_name)
    return None if hf_name is None else (order, hf_name)


def _permutation(processor: Any, name: str, config: Any, n: int) -> tuple[Any, str] | None:
    """(the processor's row order for tensor `name` with n rows, None for as they are; the name
    it gives the result), or None where it does more than reorder rows."""
    import numpy as np

    probe = np.arange(n, dtype=np.float64).reshape(n, 1)
    try:
        result = processor.process(weights=probe, name=name, tensor_key_mapping={},
                                   parsed_parameters={"config": config.to_dict(), "tensors": {}})
    except Exception:  # a processor that needs the real values: read them
        return None
    rows = getattr(result, "weights", None)
    if not isinstance(rows, np.ndarray) or rows.shape != (n, 1) \
            or not np.array_equal(np.sort(rows[:, 0]), probe[:, 0]):
        return None
    order = rows[:, 0].astype(np.int64)
    same = np.array_equal(order, probe[:, 0])
    return (None if same else order), str(getattr(result, "name", ""))


def read_back(model: nn.Module, layers: dict[str, str], gguf: Path, config: Any) -> None:
    """Fill each int4 layer of `layers` (module path -> GGUF tensor name), a shell a packed
    file made, with its rows read from `gguf` as the first load read them. Raises ValueError
    where one cannot be (the file lacks the tensor, or it is no longer such a tensor)."""
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

    with read_map(gguf) as buf:
        layout = gguf_layout(buf)
        processor = TENSOR_PROCESSORS.get(layout.architecture, TensorProcessor)(
            config=config.to_dict())
        tensors = {t.name: t for t in layout.tensors}
        for path, name in layers.items():
            layer, tensor = model.get_submodule(path), tensors.get(name)
            if tensor is None or len(tensor.dims) != 2:
                raise ValueError(f"{gguf.name} has no 2-D tensor {name}")
            k, n = tensor.dims
            found = _permutation(processor, name, config, n)
            blocks = None if found is None else int4_from_blocks(tensor_data(buf, tensor),
                                                                 tensor.ggml_type, found[0])
            if blocks is None or (getattr(layer, "in_features", 0),
                                  getattr(layer, "out_features", 0)) != (k, n):
                raise ValueError(f"{name} is no longer read as it is")
            for buffer, value in zip(("qweight", "scales", "zeros"), blocks, strict=True):
                layer.register_buffer(buffer, value)
            drop_pages(buf, tensor.offset, int(tensor_data(buf, tensor).nbytes))


def tensor_data(buf: mmap.mmap, tensor: GGUFTensor) -> Any:
    """A tensor's data in the memory map, shaped as gguf-py's reader shapes it (numpy's order;
    the quantized types as rows of bytes), read-only: what `dequantize` takes."""
    import numpy as np
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import quant_shape_to_byte_shape

    kind = GGMLQuantizationType(tensor.ggml_type)
    shape = tuple(reversed(tensor.dims))
    plain = {GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16}
    if kind in plain:
        count = int(np.prod(shape))
        return np.frombuffer(buf, plain[kind], count, tensor.offset).reshape(shape)
    block, size = GGML_QUANT_SIZES[kind]
    count = int(np.prod(shape)) * size // block
    return np.frombuffer(buf, np.uint8, count, tensor.offset).reshape(
        quant_shape_to_byte_shape(shape, kind))


def drop_pages(buf: mmap.mmap, start: int, length: int) -> None:
    """Tell the system that this process is done with the file's pages just read
    (MADV_DONTNEED): they stay in the page cache but leave this process's resident memory, which
    would otherwise grow by the whole file during the load."""
    advice = getattr(mmap, "MADV_DONTNEED", None)
    lo = start - start % mmap.PAGESIZE
    if advice is None or length <= 0 or lo >= len(buf):
        return
    with contextlib.suppress(OSError, ValueError):
        buf.madvise(advice, lo, min(len(buf), start + length) - lo)
