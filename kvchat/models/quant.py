"""Weight-only quantized linear layers, run by torch's own CPU kernels and kvchat's (native.py),
and the swap that puts them into a loaded model.

Decode on CPU is bound by reading the weights, so bytes per step are the speed: SmolLM2's 30
layers x 7 linear shapes at one row took 25.5 ms in float32, 14.1 ms in bfloat16, 4.6 ms as
int8 and 3.2 ms as int4 here (2 threads). Both kernels take bfloat16 activations (given float32
they fall back to a path ~30x slower) and compute each output row from its own input row only:
a row's result is bitwise the same whatever else is in the batch, so prefill, batched decode and
draft verification all see the same numbers.

- int4: groups of 32 input columns share a float16 scale and zero, w = q * scale + zero with q
  in [0, 15] (GGUF's Q4_1 and Q4_K are such grids; a Q4_1 group's d and m are float16, so its
  weights come back exactly, those of the float32 model a GGUF loads as), computed by kvchat's
  kernel where the CPU has AVX-512 VNNI or AVX2 with FMA and F16C (int4_matmul.c: exact
  integer sums per group, then one fixed order of float sums per output, the same bits on
  either), else packed by
  `_convert_weight_to_int4pack_for_cpu` for torch's, whose bfloat16 scales and zeros round
  them (w = (q - 8) * scale + zero there).
- int8: one scale per output row, w = q * scale, q in [-127, 127].
- the output head, under int4 and int8: int8 in groups of 32 columns with a float32 scale each
  (GGUF's Q8_0, which a GGUF's Q8_0 head loads as without rounding), float32 logits, computed by
  kvchat's own kernel (native.py): torch's int8 kernel read Gemma 3's 262,144-row head at a
  quarter of the memory's speed, and the head sets every logit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import nn

from kvchat.models.dense_rows import RowBlockLinear
from kvchat.models.head_kernels import int8_group_values

GROUP = 32
_BF16 = torch.bfloat16
_F16 = torch.float16
_F16_MAX = 65504.0
_SNAP_TOLERANCE = 1e-3  # in grid steps: how far from a grid point a value may sit and be "on" it


def _round_up(x: torch.Tensor, dtype: torch.dtype = _BF16) -> torch.Tensor:
    """The smallest `dtype` values >= x (x > 0): a scale the kernel can hold exactly that
    still keeps every quantized value in range."""
    down = x.to(dtype)
    up = torch.nextafter(down, torch.full_like(down, float("inf")))
    return torch.where(down.float() >= x, down, up)


def _on_grid(columns: torch.Tensor, lo: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """(M,) bool: every value of each group (a column of `columns`, (group, M)) within
    _SNAP_TOLERANCE steps of lo + i * step (lo, step: (M,))."""
    t = (columns - lo).div_(step.clamp_min(torch.finfo(torch.float32).tiny))
    return t.sub_(t.round()).abs_().amax(0) <= _SNAP_TOLERANCE


def _grid_steps(columns: torch.Tensor, lo: torch.Tensor, span: torch.Tensor) -> torch.Tensor:
    """Per group (a column), the step of a grid anchored at the group's minimum with at most 16
    levels that holds every value exactly, when there is one (weights de-quantized from a 4-bit
    GGUF come back on their own grid, not a finer one), else span / 15. The step tried is
    span / 15 (a group that uses the full range, as Q4_1's always do), then, for the groups not
    on it only, span over the number of smallest gaps it spans (Q4_K's groups need not reach
    both ends)."""
    step = span / 15
    found = _on_grid(columns, lo, step) | (span == 0)
    if bool(found.all()):
        return step
    rest = ~found
    sub, sub_lo, sub_span = columns[:, rest], lo[rest], span[rest]
    gaps = sub.t().contiguous().sort(dim=-1).values.diff(dim=-1).t()  # rows sort faster
    smallest = torch.where(gaps > sub_span * 1e-4, gaps, sub_span).amin(0)
    levels = (sub_span / smallest.clamp_min(torch.finfo(torch.float32).tiny)).round()
    candidate = sub_span / levels.clamp(1, 15)
    fits = (levels <= 15) & _on_grid(sub, sub_lo, candidate)
    steps = step.clone()
    steps[rest] = torch.where(fits, candidate, step[rest])
    return steps


class Int4Grid(NamedTuple):
    """A weight as 4-bit groups: w[r, c] = q[r, c] * scales[r, g] + zeros[r, g], g = c // group."""

    q: torch.Tensor  # (N, K) int32 in [0, 15]
    scales: torch.Tensor  # (N, K / group) float16
    zeros: torch.Tensor  # (N, K / group) float16


def quantize_int4(weight: torch.Tensor, group: int = GROUP) -> Int4Grid:
    """The 4-bit grid of `weight` (see `_grid_steps`), its scale rounded up to float16 and its
    zero (the group's minimum) to the nearest float16: a Q4_1 weight comes back exactly."""
    from kvchat.models.native import int4_grid

    found = int4_grid(weight, group)  # the same grid in C (int4_grid.c), where it is built
    if found is not None:
        q, scales, zeros = found
        return Int4Grid(q.to(torch.int32), scales, zeros)
    return _quantize_int4_torch(weight, group)


def _quantize_int4_torch(weight: torch.Tensor, group: int) -> Int4Grid:
    """`quantize_int4` in torch ops: the definition int4_grid.c follows. The groups are laid
    out as the columns of a (group, N * K / group) matrix, so every per-group operation runs
    along long contiguous rows instead of a 32-wide broadcast (an order of magnitude faster on
    CPU); each value takes the same operations either way."""
    n, k = weight.shape
    columns = weight.detach().float().reshape(n * k // group, group).t().contiguous()
    columns.clamp_(-_F16_MAX, _F16_MAX)
    lo, hi = columns.amin(0), columns.amax(0)  # (aminmax over dim 0 is ~30x slower)
    span = hi - lo
    step = _grid_steps(columns, lo, span)
    # a constant group: scale 0, every value its zero
    scale = torch.where(span == 0, torch.zeros_like(step).to(_F16), _round_up(step, _F16))
    zero = lo.to(_F16)
    q = (columns - zero.float()).div_(scale.float().clamp_min(torch.finfo(torch.float32).tiny))
    q = q.round_().clamp_(0, 15).to(torch.int32).t().reshape(n, k)
    return Int4Grid(q, scale.view(n, k // group), zero.view(n, k // group))


def torch_int4_scales(grid: Int4Grid) -> torch.Tensor:
    """(K / group, N, 2) bfloat16 scales and zeros of torch's int4 kernel, which computes
    (q - 8) * scale + zero: the grid's, each rounded to bfloat16."""
    scale = grid.scales.float()
    zero = grid.zeros.float() + 8 * scale
    return torch.stack([scale.to(_BF16), zero.to(_BF16)], dim=-1).transpose(0, 1).contiguous()


def head_group(k: int) -> int:
    """The columns sharing one scale in a head of `k` input columns (a multiple of 16)."""
    return GROUP if k % GROUP == 0 else k


def quantize_int8_groups(weight: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(q (N, K) int8, scales (N, K / group) float32): w = q * scale per group of `group`
    columns, symmetric, as GGUF's Q8_0 makes them (`int8_group_values` is the inverse). Each
    row depends on itself only."""
    n, k = weight.shape
    w = weight.detach().float().reshape(n, k // group, group)
    scale = w.abs().amax(-1) / 127
    q = (w / scale.clamp_min(torch.finfo(torch.float32).tiny)[..., None]).round_()
    return q.clamp_(-127, 127).to(torch.int8).reshape(n, k), scale.contiguous()


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q (N, K) int8, scales (N,) bfloat16) with one symmetric scale per output row."""
    w = weight.detach().float()
    amax = w.abs().amax(dim=1).clamp_min(torch.finfo(torch.float32).tiny)
    scale = _round_up(amax / 127)
    q = (w / scale.float()[:, None]).round().clamp(-127, 127).to(torch.int8)
    return q, scale


class QuantLinear(nn.Module):
    """A linear layer whose weight is stored quantized; inputs of any float dtype, output in
    bfloat16."""

    bits = 16

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        bias = linear.bias
        self.bias = None if bias is None else nn.Parameter(bias.detach().to(_BF16),
                                                           requires_grad=False)

    def _mm(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        out = self._mm(x.reshape(-1, shape[-1]).to(_BF16).contiguous())  # (rows, N)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*shape[:-1], self.out_features)

    def weight_bytes(self) -> int:
        tensors = [b for b in self.buffers()] + [p for p in self.parameters()]
        return sum(t.numel() * t.element_size() for t in tensors)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, " \
               f"bits={self.bits}"


TILE = 16  # output rows of one int4_matmul.c tile


def pack_int4(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(N, K) values in [0, 15] and their (N, K / 32) float16 scales and zeros in int4_matmul.c's
    tiles of 16 rows, which its header describes (gguf_blocks.c's tile_pack writes the same, and
    tests hold both to `unpack_int4`): (N, K / 2) bytes, scales and zeros held as (N, K / 32)."""
    n, k = q.shape
    groups = k // GROUP
    cols = q.to(torch.uint8).reshape(n // TILE, TILE, groups, 2, 8, 2)  # t, r, g, half, s, h
    cols = cols.permute(0, 2, 4, 1, 5, 3)  # t, g, s, r, h, half
    packed = (cols[..., 0] | (cols[..., 1] << 4)).reshape(n, k // 2).contiguous()
    return packed, _tiled(scales), _tiled(zeros)


def _tiled(values: torch.Tensor) -> torch.Tensor:
    n, groups = values.shape
    return values.reshape(n // TILE, TILE, groups).transpose(1, 2).reshape(n, groups).contiguous()


def unpack_int4(packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`pack_int4`'s inverse: (N, K) uint8 values, (N, K / 32) scales and zeros by rows."""
    n, half_k = packed.shape
    groups = half_k // 16
    b = packed.reshape(n // TILE, groups, 8, TILE, 2)  # t, g, s, r, h
    cols = torch.stack([b & 15, b >> 4], dim=-1)  # t, g, s, r, h, half
    q = cols.permute(0, 3, 1, 5, 2, 4).reshape(n, 2 * half_k).contiguous()

    def rows(values: torch.Tensor) -> torch.Tensor:
        return values.reshape(n // TILE, groups, TILE).transpose(1, 2).reshape(n, groups)

    return q, rows(scales).contiguous(), rows(zeros).contiguous()


class Int4Linear(QuantLinear):
    """4-bit groups of 32 columns. Where kvchat's kernel runs (`native.int4_native`) the layer
    holds its tile layout (`pack_int4`): `qweight` (N, K / 2) bytes, `scales` and `zeros`
    (N, K / 32) float16;
    elsewhere torch's packed weight and (K / 32, N, 2) bfloat16 scales and zeros."""

    bits = 4
    gguf_tensor: str | None = None  # read as a GGUF holds it: that tensor's name

    @staticmethod
    def fits(linear: nn.Linear) -> bool:
        # the packing kernel's own conditions (it raises otherwise)
        return linear.in_features % GROUP == 0 and linear.out_features % 16 == 0

    def __init__(self, linear: nn.Linear, group: int = GROUP) -> None:
        from kvchat.models.native import int4_native

        super().__init__(linear)
        self.group = group
        grid = quantize_int4(linear.weight, group)
        self.native = group == GROUP and linear.weight.device.type == "cpu" and int4_native()
        if self.native:
            for name, tensor in zip(("qweight", "scales", "zeros"),
                                    pack_int4(grid.q, grid.scales, grid.zeros), strict=True):
                self.register_buffer(name, tensor)
            return
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(grid.q, 1)  # (N, K / 2) uint8
        self.register_buffer("packed", packed)
        self.register_buffer("scales_and_zeros", torch_int4_scales(grid))

    @classmethod
    def from_native(cls, linear: nn.Linear, qweight: torch.Tensor, scales: torch.Tensor,
                    zeros: torch.Tensor, gguf_tensor: str) -> Int4Linear:
        """`linear`'s layer (its shape and bias) holding int4_matmul.c's layout as read from
        a GGUF's Q4_1 / Q4_K tensor `gguf_tensor` (`native.int4_from_blocks`)."""
        layer = cls.__new__(cls)
        QuantLinear.__init__(layer, linear)
        layer.group, layer.native, layer.gguf_tensor = GROUP, True, gguf_tensor
        for name, tensor in (("qweight", qweight), ("scales", scales), ("zeros", zeros)):
            layer.register_buffer(name, tensor)
        return layer

    def _mm(self, x: torch.Tensor) -> torch.Tensor:
        if self.native:
            from kvchat.models.native import int4_mm

            return int4_mm(x, self.get_buffer("qweight"), self.get_buffer("scales"),
                           self.get_buffer("zeros"))
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed, self.group,
                                                          self.scales_and_zeros)

    def dequantized(self) -> torch.Tensor:
        """The (N, K) float32 weight this layer multiplies by (for tests and checks)."""
        eye = torch.eye(self.in_features, dtype=_BF16)
        return self._mm(eye).float().t().contiguous()


class Int8Linear(QuantLinear):
    bits = 8

    @staticmethod
    def fits(linear: nn.Linear) -> bool:
        # other widths crash the kernel (torch 2.13, seen at 3, 8 and 24 input columns)
        return linear.in_features % 16 == 0

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__(linear)
        q, scales = quantize_int8(linear.weight)
        self.register_buffer("qweight", q)
        self.register_buffer("scales", scales)

    def _mm(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int8pack_mm(x, self.qweight, self.scales)

    def dequantized(self) -> torch.Tensor:
        q, scales = self.get_buffer("qweight"), self.get_buffer("scales")
        return q.float() * scales.float()[:, None]


class Int8HeadLinear(QuantLinear):
    """The output head: `quantize_int8_groups`' layout, float32 logits (`head_kernels.int8_head_mm`:
    each logit in one fixed order, whatever the batch or the threads)."""

    bits = 8

    @staticmethod
    def fits(linear: nn.Linear) -> bool:
        return linear.in_features % 16 == 0

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__(linear)
        self.group = head_group(self.in_features)
        q, scales = quantize_int8_groups(linear.weight, self.group)
        self.register_buffer("qweight", q)
        self.register_buffer("scales", scales)

    @classmethod
    def from_quantized(cls, q: torch.Tensor, scales: torch.Tensor) -> Int8HeadLinear:
        """The layer of int8 `q` (N, K) and float32 `scales` (N, K / group), made elsewhere
        (a chunk of rows at a time, or a GGUF's Q8_0 blocks as they are)."""
        layer = cls.__new__(cls)
        n, k = q.shape
        QuantLinear.__init__(layer, nn.Linear(k, n, bias=False, device="meta"))
        layer.group = k // scales.shape[1]
        layer.register_buffer("qweight", q)
        layer.register_buffer("scales", scales.float().contiguous())
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        out = self._mm(x.reshape(-1, shape[-1]))
        if self.bias is not None:
            out = out + self.bias.float()
        return out.reshape(*shape[:-1], self.out_features)

    def _mm(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type != "cpu":  # on a GPU: a bfloat16 copy (`gpu_weights.place_on_gpu`)
            return nn.functional.linear(x.to(_BF16), self.get_buffer("dense_weight")).float()
        from kvchat.models.head_kernels import int8_head_mm

        return int8_head_mm(x, self.get_buffer("qweight"), self.get_buffer("scales"),
                            self.group)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The float32 weight rows `ids` (any shape): (*ids.shape, K)."""
        q, scales = self.get_buffer("qweight")[ids], self.get_buffer("scales")[ids]
        return int8_group_values(q, scales, self.group)

    def dequantized(self) -> torch.Tensor:
        return self.rows(torch.arange(self.out_features, device=self.get_buffer("qweight").device))


@dataclass(frozen=True)
class Quantized:
    """What `quantize_model` did: layers swapped per kind, and the bytes one decode step reads
    (every linear weight once; the embedding table is read one row per token)."""

    int4_layers: int
    int8_layers: int
    dense_layers: int  # linear layers of a shape neither kernel takes
    step_bytes: int


def quantize_model(model: Any, precision: str) -> Quantized:
    """Swap every `nn.Linear` of `model` for an int4 (or int8) one, the output head for
    `Int8HeadLinear`, and cast the rest (embeddings, norms) to bfloat16, the dtype the kernels
    compute in."""
    if precision not in ("int4", "int8"):
        raise ValueError(f"not a quantized precision: {precision}")
    head = model.get_output_embeddings()
    counts = {"int4": 0, "int8": 0, "dense": 0}
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if not isinstance(child, nn.Linear):
                continue
            new: QuantLinear
            if child is head and Int8HeadLinear.fits(child):
                new, kind = Int8HeadLinear(child), "int8"
            elif precision == "int4" and child is not head and Int4Linear.fits(child):
                new, kind = Int4Linear(child), "int4"
            elif Int8Linear.fits(child):
                new, kind = Int8Linear(child), "int8"
            else:  # a shape neither kernel takes: stays dense, in bfloat16
                counts["dense"] += 1
                continue
            setattr(parent, name, new)
            counts[kind] += 1
    for param in model.parameters():
        if param.is_floating_point():
            param.data = param.data.to(_BF16)
    from kvchat.models.layer_ops import between_kernels

    between_kernels(model)
    return Quantized(counts["int4"], counts["int8"], counts["dense"], step_bytes(model))


def rows_alone(model: Any) -> bool:
    """Whether every weight matrix of `model` sits in a layer that computes each row alone
    (quantized, RowBlockLinear) or in an embedding (a lookup): no MoE experts' batched matmuls,
    no Conv1D, nothing else whose sums depend on the other rows."""
    for module in model.modules():
        if isinstance(module, (QuantLinear, RowBlockLinear, nn.Embedding)):
            continue
        if any(p.dim() >= 2 for p in module.parameters(recurse=False)):
            return False
    return True


def step_bytes(model: Any) -> int:
    """Bytes of weights one decode step reads: every linear layer's (quantized or not) and the
    norms; the input embedding contributes one row per token, so it is left out."""
    embed = model.get_input_embeddings()
    skip = {id(p) for p in embed.parameters()} if embed is not None else set()
    head = model.get_output_embeddings()
    total = 0
    for module in model.modules():
        if isinstance(module, QuantLinear):
            total += module.weight_bytes()
            skip.update(id(p) for p in module.parameters())
    for param in model.parameters():
        tied_head = head is not None and not isinstance(head, QuantLinear) \
            and param is getattr(head, "weight", None)
        if id(param) not in skip or tied_head:
            total += param.numel() * param.element_size()
            skip.add(id(param))
    return total


PRECISION_ATTRIBUTE = "kvchat_precision"  # set on a model by load_model: the precision it chose


def precision_of(model: Any) -> str:
    """The precision load_model chose for `model`; for a model it did not load, int4 / int8 if
    it carries quantized layers, else its parameters' dtype name."""
    chosen = getattr(model, PRECISION_ATTRIBUTE, None)
    if isinstance(chosen, str):
        return chosen
    bits = {m.bits for m in model.modules() if isinstance(m, QuantLinear)}
    if bits:
        return "int4" if 4 in bits else "int8"
    return str(next(model.parameters()).dtype).removeprefix("torch.")
