"""A GGUF's weights loaded straight into the model, one tensor at a time: no float32 copy on disk
or in memory.

The model is built weightless (parameters on the meta device, buffers real), then each tensor of
the file is read through gguf-py's memory map, de-quantized on its own (gguf-py decodes every
type it knows: F32, F16, BF16, Q8_0, Q4_0/1, Q5_0/1, the K-quants, IQ*), turned into the form
transformers' own GGUF loader gives it (`TENSOR_PROCESSORS`: Llama's q/k rows back in Hugging
Face order, Gemma's norms less one) and put where it belongs, packed at once when it is a linear
layer's weight at int4 or int8 (`kvchat.models.quant`). Peak memory is the packed model plus one
tensor in float32, not the whole float model; the numbers are the ones a float32 conversion
gave, so a packed layer is bit for bit what quantizing the converted model gave. At int4 a
Q4_1 or Q4_K layer is not de-quantized at all: its groups already are int4 grids, and it is
read as the file holds it (`kvchat.models.gguf_int4`).

The token embedding and the output head are often the largest tensors by far (Gemma 3 270M's
embedding: 168 M of its 268 M parameters, 640 MiB in float32; Llama 3.2 3B's: 1.5 GiB) and no
processor changes them, so they are read `CHUNK_ROWS_BYTES` of float32 at a time: each chunk
of rows is de-quantized, cast into its rows of the embedding and, for a head packed at int8
(the output head, or the head tied to the embedding), quantized row by row, which is what the
whole tensor gave, since every row's scale is its own.
"""

from __future__ import annotations

import mmap
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from kvchat.errors import ModelError
from kvchat.files import read_map
from kvchat.models.block_head import BlockHeadLinear
from kvchat.models.footprint import CHUNK_ROWS_BYTES, ROW_CHUNKED, head_kept_as_blocks
from kvchat.models.gguf_int4 import drop_pages as _drop_pages
from kvchat.models.gguf_int4 import row_order
from kvchat.models.gguf_int4 import tensor_data as _data
from kvchat.models.heap import (
    MMAP_THRESHOLD_AFTER,
    MMAP_THRESHOLD_LOADING,
    TRIM_EVERY,
    heap_mmap_threshold,
    huge_empty,
    release_freed,
)
from kvchat.models.native import int4_from_blocks
from kvchat.models.precision import GGUFTensor, gguf_layout
from kvchat.models.quant import Int4Linear, Int8HeadLinear, Int8Linear, QuantLinear
from kvchat.models.quant_embeddings import BlockEmbedding

Progress = Callable[[int, int], None]
# transformers' processors that leave those two as they are (GPT-2's, for one, renames the head)
_KEEPS_EMBEDDINGS = frozenset({"TensorProcessor", "LlamaTensorProcessor", "Gemma2TensorProcessor"})


@dataclass(frozen=True)
class StreamedLoad:
    """What loading a GGUF did: tensors read, layers packed per kind, the largest float tensor
    it held at once (bytes), and the parameters the file set."""

    tensors: int
    int4_layers: int
    int8_layers: int
    dense_layers: int
    largest_float_bytes: int
    n_params: int


def load_gguf_weights(gguf: Path, config: Any, precision: str, dtype: torch.dtype,
                      progress: Progress | None = None) -> tuple[Any, StreamedLoad]:
    """The causal LM of `config` with the weights of `gguf`: linear layers packed to `precision`
    ("int4": int4 groups, the output head int8; "int8": int8 rows) where the kernels take their
    shape, everything else in `dtype`; for any other precision every tensor in `dtype`."""
    heap_mmap_threshold(MMAP_THRESHOLD_LOADING)
    try:
        with read_map(gguf) as buf:
            return _load(buf, gguf, config, precision, dtype, progress)
    finally:
        heap_mmap_threshold(MMAP_THRESHOLD_AFTER)


def _load(buf: mmap.mmap, gguf: Path, config: Any, precision: str, dtype: torch.dtype,
          progress: Progress | None) -> tuple[Any, StreamedLoad]:
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import (
        TENSOR_PROCESSORS,
        TensorProcessor,
        get_gguf_hf_weights_map,
    )

    from kvchat.models.gguf import quiet_transformers

    layout = gguf_layout(buf)
    arch = layout.architecture
    with init_empty_weights(include_buffers=False), quiet_transformers():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.eval()
    processor = TENSOR_PROCESSORS.get(arch, TensorProcessor)(config=config.to_dict())
    names = _tensor_names(model, processor, arch, config)
    if not set(names.values()) >= {n for n, _ in model.named_parameters()}:
        names = get_gguf_hf_weights_map(model, processor)  # nested models: transformers' walk
    packs = precision in ("int4", "int8")
    head = model.get_output_embeddings()
    tied = bool(getattr(config.get_text_config(), "tie_word_embeddings", False))
    embed = model.get_input_embeddings()
    counts = {"int4": 0, "int8": 0, "dense": 0}
    largest = n_params = 0
    total = len(layout.tensors)
    for done, tensor in enumerate(layout.tensors, 1):
        by_rows = _by_rows(model, names, tensor, packs, tied, arch) \
            if type(processor).__name__ in _KEEPS_EMBEDDINGS else None
        if by_rows is not None:
            kind, chunk_bytes, params = by_rows(buf, dtype)
            for packed in kind:
                counts[packed] += 1
            largest, n_params = max(largest, chunk_bytes), n_params + params
            if progress is not None:
                progress(done, total)
            continue
        if packs and precision == "int4":
            direct = _read_int4(buf, tensor, model, names, processor, config)
            if direct:
                counts["int4"] += 1
                n_params += direct
                _drop_pages(buf, tensor.offset, int(_data(buf, tensor).nbytes))
                if progress is not None:
                    progress(done, total)
                continue
        weights = _dequantize(_data(buf, tensor), tensor.ggml_type)
        result = processor.process(weights=weights, name=tensor.name, tensor_key_mapping=names,
                                   parsed_parameters={"config": config.to_dict(), "tensors": {}})
        hf_name = names.get(result.name)
        if hf_name is not None:
            array = result.weights  # a view of the memory map for F32: copied, else fresh
            value = torch.from_numpy(array if array.flags.writeable else array.copy()).float()
            largest = max(largest, value.numel() * 4)
            n_params += value.numel()
            parent, leaf = _owner(model, hf_name)
            linear = isinstance(parent, (nn.Linear, QuantLinear))
            if packs and linear and leaf == "weight":
                counts[_pack(model, hf_name, value, precision, parent is head)] += 1
            elif isinstance(parent, QuantLinear) and leaf == "bias":  # after its packed weight
                parent.bias = nn.Parameter(value.to(torch.bfloat16), requires_grad=False)
            else:
                param = nn.Parameter(value.to(torch.bfloat16 if packs else dtype),
                                     requires_grad=False)
                parent.register_parameter(leaf, param)
                if tied and parent is embed and leaf == "weight" and head is not None:
                    if packs:  # the head reads the embedding's numbers, packed from them
                        counts[_pack(model, _name_of(model, head) + ".weight", value, precision,
                                     True)] += 1
                    else:
                        head.weight = param
            del value
        release_freed(int(weights.nbytes))
        del weights, result
        _drop_pages(buf, tensor.offset, int(_data(buf, tensor).nbytes))
        if progress is not None:
            progress(done, total)
    release_freed(TRIM_EVERY)  # what the last tensors left
    missing = [name for name, p in model.named_parameters() if p.device.type == "meta"]
    if missing:
        raise ModelError(f"{gguf.name} lacks tensors this {type(model).__name__} needs: "
                         f"{', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''}.")
    return model, StreamedLoad(total, counts["int4"], counts["int8"], counts["dense"], largest,
                               n_params)


RowLoad = Callable[[mmap.mmap, torch.dtype], tuple[list[str], int, int]]


def _by_rows(model: Any, names: dict[str, str], tensor: GGUFTensor, packs: bool,
             tied: bool, arch: str) -> RowLoad | None:
    """How to read `tensor` a chunk of rows at a time into the embedding and / or the head, or
    None when it is read whole (small, another tensor, or a head of another kind)."""
    hf_name = names.get(tensor.name)
    if tensor.name not in ROW_CHUNKED or hf_name is None or len(tensor.dims) != 2:
        return None
    parent, leaf = _owner(model, hf_name)
    head = model.get_output_embeddings()
    embed = model.get_input_embeddings()
    if leaf != "weight" or parent is not head and parent is not embed:
        return None
    blocks = packs and parent is embed and BlockEmbedding.takes(embed, tensor.ggml_type)
    # a Q6_K head keeps the file's blocks (a tied one: the embedding's)
    head_blocks = packs and (parent is head or tied) \
        and BlockHeadLinear.takes(head, tensor.ggml_type) and head_kept_as_blocks(tensor, arch)
    if tensor.dims[0] * tensor.dims[1] * 4 <= CHUNK_ROWS_BYTES and not blocks \
            and not head_blocks:
        return None  # small: read whole (blocks kept as they are are read here at any size)
    int8_head = packs and not head_blocks and isinstance(head, nn.Linear) \
        and head.bias is None and int(head.in_features) % 16 == 0  # Int8HeadLinear.fits
    if parent is head:
        if packs and not int8_head and not head_blocks:
            return None
        if packs:  # the file's own head, packed int8 or kept as blocks
            return lambda buf, dtype: _rows_into(buf, tensor, model, None, None, int8_head,
                                                 head_blocks=head_blocks)
        return lambda buf, dtype: _rows_into(buf, tensor, model, head, dtype, False)
    if tied and packs and not int8_head and not head_blocks:
        return None

    def load(buf: mmap.mmap, dtype: torch.dtype) -> tuple[list[str], int, int]:
        return _rows_into(buf, tensor, model, embed, torch.bfloat16 if packs else dtype,
                          tied and int8_head, tie_plain=tied and not packs, keep_blocks=packs,
                          head_blocks=tied and head_blocks)

    return load


def _rows_into(buf: mmap.mmap, tensor: GGUFTensor, model: Any, target: nn.Module | None,
               dtype: torch.dtype | None, head_int8: bool, tie_plain: bool = False,
               keep_blocks: bool = False, head_blocks: bool = False
               ) -> tuple[list[str], int, int]:
    """Fill `target`'s weight (in `dtype`) and / or pack the int8 head from `tensor`'s rows, a
    chunk at a time (a Q8_0 head is the file's q and d themselves, `_q8_0_rows`, read without
    de-quantizing); `tie_plain`: the head's weight is the embedding's. A tied embedding whose
    rows the int8 head gives back exactly (Q8_0) is read from the head (`TiedInt8Embedding`)
    instead of held again in bfloat16; `keep_blocks`: one of Q4_K or Q6_K keeps the file's
    blocks instead (`BlockEmbedding`); `head_blocks`: the head is a Q6_K tensor's blocks as
    the file holds them (`BlockHeadLinear`), which a tied embedding kept as blocks reads too.
    Returns (kinds packed, the chunk's float bytes, parameters read)."""
    from gguf import GGMLQuantizationType

    from kvchat.models.head_kernels import int8_group_values
    from kvchat.models.quant import head_group, quantize_int8_groups
    from kvchat.models.quant_embeddings import TiedInt8Embedding

    kind = GGMLQuantizationType(tensor.ggml_type)
    cols, rows = tensor.dims
    data = _data(buf, tensor)
    step = max(1, CHUNK_ROWS_BYTES // (cols * 4))
    group = head_group(cols)
    blocks = keep_blocks and target is not None and dtype == torch.bfloat16 \
        and BlockEmbedding.takes(target, tensor.ggml_type)
    shares = head_int8 and target is not None and dtype == torch.bfloat16 and not blocks \
        and TiedInt8Embedding.takes(target)
    table = torch.empty(rows, cols, dtype=dtype) \
        if target is not None and not shares and not blocks else None
    q = huge_empty((rows, cols), torch.int8) if head_int8 else None
    scales = torch.empty(rows, cols // group) if head_int8 else None
    packed: list[str] = []
    if blocks or head_blocks:  # the file's bytes, copied (once) before its pages drop
        file_blocks = huge_empty(tuple(data.shape), torch.uint8)
        file_blocks.numpy()[...] = data
        block_head = None
        if head_blocks:
            head_path = _name_of(model, model.get_output_embeddings())
            owner, attr = _owner(model, head_path)
            block_head = BlockHeadLinear(  # the file's rows, as block_head.c reads them
                nn.Linear(cols, rows, bias=False, device="meta"), file_blocks)
            setattr(owner, attr, block_head)
            packed.append("int8")  # the head, as an int8 one counts
        if blocks and target is not None:
            model.set_input_embeddings(BlockEmbedding(
                target, None if block_head else file_blocks, tensor.ggml_type, cols,
                head=block_head))
        _drop_pages(buf, tensor.offset, int(data.nbytes))  # copied: the map's pages can go
    # a Q8_0 head is the file's own int8 values and scales, read without a float in between
    q8_0 = q is not None and kind == GGMLQuantizationType.Q8_0 and group == _Q8_0_BLOCK
    floats = table is not None or (q is not None and not q8_0)  # else no row de-quantized
    for start in range(0, rows if floats or q8_0 else 0, step):
        end = min(rows, start + step)
        value: torch.Tensor | None = None
        if q8_0 and q is not None and scales is not None:
            q[start:end], scales[start:end] = _q8_0_rows(data[start:end], cols)
            if table is not None:
                value = int8_group_values(q[start:end], scales[start:end], group)
        else:
            chunk = _dequantize(data[start:end], kind)
            value = torch.from_numpy(chunk if chunk.flags.writeable else chunk.copy()).float()
            release_freed(int(chunk.nbytes))
            del chunk
            if q is not None and scales is not None:
                q[start:end], scales[start:end] = quantize_int8_groups(value, group)
                if shares and table is None and not torch.equal(
                        int8_group_values(q[start:end], scales[start:end], group), value):
                    # not exact: the embedding keeps its own table, the rows so far from the head
                    table = torch.empty(rows, cols, dtype=dtype)
                    table[:start] = int8_group_values(q[:start], scales[:start], group).to(dtype)
        if table is not None and value is not None:
            table[start:end] = value.to(dtype)
        del value
        row_bytes = int(data[0:1].nbytes)
        _drop_pages(buf, tensor.offset + start * row_bytes, (end - start) * row_bytes)
    if target is not None and table is not None:
        param = nn.Parameter(table, requires_grad=False)
        target.register_parameter("weight", param)
        if tie_plain:
            model.get_output_embeddings().weight = param
    if q is not None and scales is not None:
        head_path = _name_of(model, model.get_output_embeddings())
        owner, attr = _owner(model, head_path)
        head = Int8HeadLinear.from_quantized(q, scales)
        setattr(owner, attr, head)
        packed.append("int8")
        if shares and table is None and target is not None:
            model.set_input_embeddings(TiedInt8Embedding(target, head))
    return packed, min(rows, step) * cols * 4 if floats else 0, rows * cols


_Q8_0_BLOCK = 32  # a Q8_0 block's values: a float16 scale d, then 32 int8 q (value d * q)


def _q8_0_rows(data: Any, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of Q8_0 blocks ((rows, cols / 32 * 34) bytes) as (q (rows, cols) int8, scales
    (rows, cols / 32) float32): each block's q and float32(d), so that q * scale is, exactly,
    what gguf-py de-quantizes (d and q as float32, multiplied)."""
    import numpy as np

    blocks = np.asarray(data).reshape(-1, 2 + _Q8_0_BLOCK)
    rows = len(data)
    d = blocks[:, :2].copy().view(np.float16).astype(np.float32).reshape(rows, -1)
    q = blocks[:, 2:].copy().view(np.int8).reshape(rows, cols)
    return torch.from_numpy(q), torch.from_numpy(d)


def _dequantize(data: Any, ggml_type: int) -> Any:
    """gguf-py's `dequantize`, its K-quant blocks by kvchat's native code where it is built
    (`native.gguf_blocks`: the same numbers, on every thread)."""
    from gguf import GGMLQuantizationType, dequantize

    from kvchat.models.native import gguf_blocks

    found = gguf_blocks(data, int(ggml_type))
    return found if found is not None else dequantize(data, GGMLQuantizationType(ggml_type))


def _tensor_names(model: nn.Module, processor: Any, arch: str, config: Any) -> dict[str, str]:
    """GGUF tensor name -> the model's parameter name, from gguf-py's table for the file's
    architecture: what transformers' `get_gguf_hf_weights_map` finds, in one pass instead of
    one per submodule (seconds for a 30-layer model)."""
    from gguf import MODEL_ARCH_NAMES, get_tensor_name_map

    key = next((k for k, v in MODEL_ARCH_NAMES.items() if v == arch), None)
    if key is None:
        return {}
    table = get_tensor_name_map(key, int(config.get_text_config().num_hidden_layers))
    names: dict[str, str] = {}
    for hf_name in model.state_dict():
        base, dot, suffix = processor.preprocess_name(hf_name).rpartition(".")
        if suffix not in ("weight", "bias"):
            base, dot, suffix = hf_name, "", ""
        found = table.get_name(base)
        if found is not None:
            names[found + dot + suffix] = hf_name
    return names


def _owner(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    """The module holding the tensor `name`, and the tensor's own name in it."""
    path, _, leaf = name.rpartition(".")
    return model.get_submodule(path), leaf


def _name_of(model: nn.Module, module: nn.Module) -> str:
    return next(name for name, m in model.named_modules() if m is module)


def _read_int4(buf: mmap.mmap, tensor: GGUFTensor, model: Any, names: dict[str, str],
               processor: Any, config: Any) -> int:
    """Put a Q4_1 or Q4_K linear weight (not the head) into its int4 layer as the file holds it
    (`kvchat.models.gguf_int4`), its rows in the order the processor gives them. Returns the
    parameters set; 0 where this does not apply (another type or layer, no native kernel, a
    processor that does more than reorder rows): the tensor is then read as any other."""
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
    blocks = int4_from_blocks(_data(buf, tensor), tensor.ggml_type, order)
    if blocks is None:
        return 0
    q, scales, zeros = blocks
    dense = nn.Linear(k, n, bias=False, device="meta")
    _place(model, hf_name.rpartition(".")[0], parent, dense,
           lambda linear: Int4Linear.from_native(linear, q, scales, zeros, tensor.name))
    return n * k


def _place(model: nn.Module, path: str, layer: nn.Module, dense: nn.Linear,
           make: Callable[[nn.Linear], nn.Module]) -> nn.Module:
    """Replace `layer` (at `path`) by `make(dense)`, `dense` carrying `layer`'s bias where it is
    already read; one the file gives later stays on the meta device until it comes (a file
    without it is refused)."""
    n = int(dense.out_features)
    bias = layer.bias if isinstance(layer.bias, torch.Tensor) else None
    waits = bias is not None and bias.device.type == "meta"
    if bias is not None and not waits:
        dense.bias = nn.Parameter(bias.detach(), requires_grad=False)
    packed = make(dense)
    if waits:
        packed.bias = nn.Parameter(torch.empty(n, device="meta"), requires_grad=False)
    parent, attr = _owner(model, path)
    setattr(parent, attr, packed)
    return packed


def _pack(model: nn.Module, name: str, weight: torch.Tensor, precision: str,
          is_head: bool) -> str:
    """Replace the linear layer whose weight is `name` by its packed form built from `weight`
    (float32), as `quantize_model` packs one: int4 groups under int4 (the head int8), int8 rows,
    or dense bfloat16 where neither kernel takes the shape. Returns which."""
    path = name.rpartition(".")[0]
    layer = model.get_submodule(path)
    assert isinstance(layer, (nn.Linear, QuantLinear))
    n, k = int(layer.out_features), int(layer.in_features)
    dense = nn.Linear(k, n, bias=False, device="meta")  # no random init to throw away
    dense.weight = nn.Parameter(weight, requires_grad=False)
    make: Callable[[nn.Linear], nn.Module]
    if is_head and Int8HeadLinear.fits(dense):
        make, kind = Int8HeadLinear, "int8"
    elif precision == "int4" and not is_head and Int4Linear.fits(dense):
        make, kind = Int4Linear, "int4"
    elif Int8Linear.fits(dense):
        make, kind = Int8Linear, "int8"
    else:
        dense.weight = nn.Parameter(weight.to(torch.bfloat16), requires_grad=False)
        make, kind = (lambda linear: linear), "dense"
    _place(model, path, layer, dense, make)
    return kind
