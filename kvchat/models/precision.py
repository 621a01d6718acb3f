"""Which precision a model runs at: a float dtype, or weight-only int8 / int4.

`--dtype` names it; left unset, a GGUF keeps the precision class of its weights (Q4_* -> int4,
Q5-Q8 -> int8, F16 / BF16 / F32 -> that float), read from the file type its header names
(`general.file_type`: a Q4_K_M file is int4 even where some tensors are Q5_0 or Q6_K, as
llama.cpp's quantizer falls back on shapes its K-quants do not take), else from the type holding
most parameters and any other model keeps float32 on CPU,
bfloat16 on a GPU. Quantized precisions compute in bfloat16 (activations and K/V) over packed
weights (`kvchat.models.quant`). Torch-free: `kvchat models` and the tests of resolution read it
cheaply.
"""

from __future__ import annotations

import mmap
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

from kvchat.errors import ModelOptionError
from kvchat.files import read_map

if TYPE_CHECKING:
    import torch

FLOATS = ("float32", "bfloat16", "float16")
QUANTIZED = ("int8", "int4")
_ALIASES = {
    "float32": "float32", "fp32": "float32", "float": "float32",
    "bfloat16": "bfloat16", "bf16": "bfloat16",
    "float16": "float16", "fp16": "float16", "half": "float16",
    "int8": "int8", "q8": "int8",
    "int4": "int4", "q4": "int4",
}
_ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}
# GGML tensor type ids (ggml.h) and the precision class each keeps.
_GGML_CLASS = {
    0: "float32", 1: "float16", 30: "bfloat16",
    2: "int4", 3: "int4", 10: "int4", 11: "int4", 12: "int4",  # Q4_0 Q4_1 Q2_K Q3_K Q4_K
    16: "int4", 17: "int4", 18: "int4", 19: "int4", 20: "int4", 21: "int4", 22: "int4",
    23: "int4", 29: "int4",  # IQ2_*, IQ3_*, IQ1_*, IQ4_*
    6: "int8", 7: "int8", 8: "int8", 9: "int8", 13: "int8", 14: "int8", 15: "int8",  # Q5-Q8
}
# llama.cpp's file types (gguf.LlamaFileType, `general.file_type`) and the class each keeps
_FILE_TYPE_CLASS = {
    0: "float32", 1: "float16", 32: "bfloat16",
    2: "int4", 3: "int4", 10: "int4", 11: "int4", 12: "int4", 13: "int4", 14: "int4",
    15: "int4", 19: "int4", 20: "int4", 21: "int4", 22: "int4", 23: "int4", 24: "int4",
    25: "int4", 26: "int4", 27: "int4", 28: "int4", 29: "int4", 30: "int4", 31: "int4",
    36: "int4", 37: "int4",  # Q4_0 Q4_1 Q2_K Q3_K_* Q4_K_S Q4_K_M IQ1-IQ4 TQ1_0 TQ2_0
    7: "int8", 8: "int8", 9: "int8", 16: "int8", 17: "int8", 18: "int8",  # Q8_0 Q5_* Q6_K
}


@dataclass(frozen=True)
class Precision:
    """What runs: `name` is a float dtype or int8 / int4 (weight-only, bfloat16 compute)."""

    name: str
    why: str  # one line: where the choice came from

    @property
    def quantized(self) -> bool:
        return self.name in QUANTIZED

    @property
    def compute_dtype(self) -> str:
        """The dtype of activations and of the K/V cache."""
        return "bfloat16" if self.quantized else self.name

    @property
    def kv_itemsize(self) -> int:
        return _ITEMSIZE[self.compute_dtype]


def canonical(option: str) -> str:
    key = option.strip().lower().removeprefix("torch.")
    if key not in _ALIASES:
        raise ModelOptionError(
            f"Unknown --dtype {option!r}. Use float32 (fp32), bfloat16 (bf16), float16 (fp16), "
            "int8 or int4 (weight-only quantized, computing in bfloat16), or leave it out for "
            "the model's own precision."
        )
    return _ALIASES[key]


def dtype_name(dtype: str | torch.dtype | None, device: str = "cpu") -> str:
    """Canonical precision name; None or "auto" means bfloat16 on a GPU, float32 on CPU (a GGUF's
    own class is `resolve_precision`'s to apply)."""
    if dtype is None or (isinstance(dtype, str) and dtype.strip().lower() == "auto"):
        return "bfloat16" if device.startswith("cuda") else "float32"
    return canonical(dtype if isinstance(dtype, str) else str(dtype))


def itemsize(name: str) -> int:
    """Bytes per K/V element at this precision (quantized ones keep K/V in bfloat16)."""
    return _ITEMSIZE[Precision(canonical(name), "").compute_dtype]


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype activations and K/V use at precision `name`."""
    import torch

    dtype: torch.dtype = getattr(torch, Precision(canonical(name), "").compute_dtype)
    return dtype


def resolve_device(device: str | None = "auto") -> str:
    """The device to load on: "auto" is cuda when torch sees a GPU, else cpu."""
    import torch

    text = (device or "auto").strip().lower()
    if text == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        parsed = torch.device(text)
    except (RuntimeError, ValueError):
        raise ModelOptionError(
            f"Unknown --device {device!r}. Use auto, cpu, cuda or cuda:N."
        ) from None
    if parsed.type == "cuda" and not torch.cuda.is_available():
        raise ModelOptionError(
            f"--device {device} was asked for, but torch sees no CUDA GPU here "
            f"(torch {torch.__version__}). Use --device cpu, or --device auto to pick one."
        )
    return str(parsed)


def resolve_precision(option: str | None, device: str, gguf_class: str | None) -> Precision:
    """The precision to run: the option if given, else the GGUF's class, else the device's
    float default. On a GPU int4 runs on torch's CUDA kernel (`gpu_weights`) where it can,
    int8 and older GPUs fall back to bfloat16."""
    on_gpu = device.startswith("cuda")
    if option is not None and option.strip().lower() != "auto":
        name, why = canonical(option), "--dtype"
    elif gguf_class is not None:
        name, why = gguf_class, "the GGUF's own weights"
    else:
        name = "bfloat16" if on_gpu else "float32"
        why = "the default on " + ("a GPU" if on_gpu else "CPU")
    if name == "int4" and on_gpu:
        from kvchat.models.gpu_weights import int4_on_gpu

        if not int4_on_gpu(device):
            return Precision("bfloat16", f"torch's int4 kernel needs a GPU of compute "
                             f"capability 8.0 or later; bfloat16 on {device}")
    elif name in QUANTIZED and on_gpu:
        return Precision("bfloat16", f"{name} kernels run on CPU only; bfloat16 on {device}")
    return Precision(name, why)


def bytes_per_step(n_params: int, embedding: int, tied: bool, name: str) -> int:
    """About how many bytes of weights one decode step reads: every matrix but the input
    embedding (read one row per token) at this precision, int4 with one 16-bit scale and zero
    per 32 weights, int8 with one scale per row; the output head is int8 under int4 too. An
    estimate from the parameter count, for `kvchat models`; a loaded model counts exactly."""
    head = embedding  # the output head has the embedding's shape, tied or not
    body = n_params - embedding - (0 if tied else head)
    if name == "int4":
        return body * 5 // 8 + head
    if name == "int8":
        return body + head
    size = _ITEMSIZE[name]
    return (body + head) * size


def gguf_precision_class(path: Path) -> str | None:
    """The precision class of a GGUF's weights: its file type's (`general.file_type`), else that
    of the type holding most parameters of its 2-D tensors (the token embedding aside), or None
    if the file cannot be read."""
    try:
        with read_map(path) as buf:
            layout = _HeaderReader(buf).layout()
    except (OSError, ValueError, struct.error):
        return None
    if layout.file_type in _FILE_TYPE_CLASS:
        return _FILE_TYPE_CLASS[layout.file_type]
    classes: dict[str, int] = {}
    for ggml_type, n in _tensor_types(layout).items():
        name = _GGML_CLASS.get(ggml_type)
        if name is not None:
            classes[name] = classes.get(name, 0) + n
    return max(classes, key=lambda k: classes[k]) if classes else None


def gguf_tensor_types(path: Path) -> Mapping[int, int]:
    """Parameters per GGML type over a GGUF's matrices (token embedding excluded), read from the
    header alone: no tensor data is touched."""
    with read_map(path) as buf:
        return _tensor_types(_HeaderReader(buf).layout())


def _tensor_types(layout: GGUFLayout) -> dict[int, int]:
    counts: dict[int, int] = {}
    for tensor in layout.tensors:
        if len(tensor.dims) == 2 and tensor.name != "token_embd.weight":
            n = tensor.dims[0] * tensor.dims[1]
            counts[tensor.ggml_type] = counts.get(tensor.ggml_type, 0) + n
    return counts


class GGUFTensor(NamedTuple):
    name: str
    dims: tuple[int, ...]  # GGUF's order: the fastest-varying first
    ggml_type: int
    offset: int  # of its data, from the start of the file


class GGUFLayout(NamedTuple):
    architecture: str
    tensors: tuple[GGUFTensor, ...]
    file_type: int | None = None  # general.file_type (gguf.LlamaFileType), when the header has it


def gguf_layout(buf: mmap.mmap) -> GGUFLayout:
    """The tensors of a GGUF mapped in `buf`, read from its header."""
    return _HeaderReader(buf).layout()


_U64 = struct.Struct("<Q")


class _HeaderReader:
    # value type id -> struct format of a scalar (gguf.GGUFValueType)
    _SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q",
                11: "q", 12: "d"}
    _STRING, _ARRAY = 8, 9

    def __init__(self, buf: mmap.mmap) -> None:
        self.buf, self.at = buf, 0

    def _take(self, fmt: str) -> int:
        (value,) = struct.unpack_from("<" + fmt, self.buf, self.at)
        self.at += struct.calcsize(fmt)
        return int(value)

    def _string(self) -> bytes:
        n = self._take("Q")
        self.at += n
        return bytes(self.buf[self.at - n : self.at])

    def _skip_value(self, vtype: int) -> None:
        if vtype == self._STRING:
            n = self._take("Q")  # read first: `self.at += ...` would add to the old offset
            self.at += n
        elif vtype == self._ARRAY:
            etype, count = self._take("I"), self._take("Q")
            if etype in self._SCALARS:
                self.at += count * struct.calcsize(self._SCALARS[etype])
            elif etype == self._STRING:  # a vocabulary: one length after another, in a loop
                at, buf, length = self.at, self.buf, _U64.unpack_from
                for _ in range(count):
                    at += 8 + length(buf, at)[0]
                self.at = at
            else:
                for _ in range(count):
                    self._skip_value(etype)
        elif vtype in self._SCALARS:
            self.at += struct.calcsize(self._SCALARS[vtype])
        else:
            raise ValueError(f"unknown GGUF value type {vtype}")

    def layout(self) -> GGUFLayout:
        """The architecture, and each tensor's name, dims, type and absolute data offset, from
        the header alone (gguf-py's reader decodes every metadata value on the way: the
        vocabulary's, seconds for a 49k-token one)."""
        if bytes(self.buf[:4]) != b"GGUF":
            raise ValueError("not a GGUF file")
        self.at = 4
        if self._take("I") < 2:
            raise ValueError("GGUF version 1 is not supported")
        n_tensors, n_kv = self._take("Q"), self._take("Q")
        arch, alignment, file_type = "", 32, None
        for _ in range(n_kv):
            key, vtype = self._string(), self._take("I")
            if key == b"general.architecture" and vtype == self._STRING:
                arch = self._string().decode()
            elif key == b"general.alignment" and vtype == 4:
                alignment = self._take("I")
            elif key == b"general.file_type" and vtype in (4, 5):  # uint32 / int32
                file_type = self._take("I" if vtype == 4 else "i")
            else:
                self._skip_value(vtype)
        tensors = []
        for _ in range(n_tensors):
            name = self._string().decode()
            dims = tuple(self._take("Q") for _ in range(self._take("I")))
            tensors.append((name, dims, self._take("I"), self._take("Q")))
        start = -(-self.at // alignment) * alignment
        return GGUFLayout(arch, tuple(GGUFTensor(n, d, t, start + o) for n, d, t, o in tensors),
                          file_type)
