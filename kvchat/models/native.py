"""kvchat's native kernels, the output head's (int8_head.c, block_head.c) and the int4 layers'
(int4_matmul.c):
built with the machine's C compiler on first use, once per source and compiler, into one library
in the kvchat cache dir, and loaded with ctypes.

torch's own int8 kernel reads a 262,144 x 640 head (Gemma 3) at a fraction of what the memory
gives; this one reads the head's int8 groups once per step and computes each logit in a fixed
order, so a row's logits are bitwise the same alone, in a batch, under any thread count, and on
AVX-512, AVX2 or portable C (tests check all three against each other and against the float
definition; the head's wrappers are `head_kernels`). Where no compiler is found, or
KVCHAT_NATIVE=0, the heads compute a float sum in torch: slower, and its bits are its own.

The int4 kernel runs on x86 CPUs with AVX-512 VNNI (AMD Zen 4, Intel Xeons from Cascade Lake) or
with AVX2, FMA and F16C (Intel Haswell and AMD Zen and later): it multiplies the 4-bit
groups by 16-bit integer activations on a power-of-two grid per group, exact integer sums, then
one order of float sums per output whatever the rows, the threads or the instruction set, as its
source says, so the same weights and inputs give the same bits on either kind of machine.
Elsewhere the int4 layers keep torch's own kernel and layout (`int4_native`).

When a model is packed, gguf_blocks.c reads a GGUF's Q4_1 and Q4_K rows straight into the int4
layout (their groups already are grids), de-quantizes its Q6_K blocks and the Q4_K ones bound
elsewhere (gguf-py's numbers, bit for bit), and int4_grid.c finds the grid of each int4 group
that is not one already (`quant.quantize_int4`, op for op and bit for bit), on every thread:
in numpy and torch they were most of a first load.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvchat.errors import KvchatError
from kvchat.files import private_dir
from kvchat.models.gguf import cache_dir

if TYPE_CHECKING:
    import torch

# torch-free at import, like `kvchat.models.precision`: `kvchat models` names the kernel
SOURCES = tuple(Path(__file__).with_name(name)
                for name in ("int8_head.c", "int4_matmul.c", "attention.c", "attention_blocked.c",
                             "int4_grid.c", "gguf_blocks.c", "block_head.c", "layer_ops.c",
                             "decode_layer.c"))
# included by the sources: part of the key
HEADERS = tuple(Path(__file__).with_name(name) for name in ("native_sums.h", "attention.h"))
ENV_VAR = "KVCHAT_NATIVE"  # 0: never build or load it
ISAS = ("portable C", "AVX2", "AVX-512")
INT4_ISAS = ("portable C", "AVX2", "AVX-512 VNNI")
_FLAGS = ["-O2", "-shared", "-fPIC", "-ffp-contract=off", "-fopenmp"]
_LONG7, _LONG13 = ctypes.c_long * 7, ctypes.c_long * 13  # attention's shape and strides


@cache
def _compiler() -> tuple[str, str] | None:
    """(the C compiler's path, its version line), or None."""
    name = os.environ.get("CC") or "cc"
    path = shutil.which(name) or shutil.which("gcc")
    if path is None:
        return None
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return path, (out.stdout.splitlines() or [""])[0]


def _build(target: Path, compiler: str) -> None:
    """Compile into a temporary file beside `target`, then rename it over: a reader never sees
    a half-written library, and two processes building at once both end with a whole one."""
    private_dir(target.parent, "the native kernel folder")
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        done = subprocess.run([compiler, *_FLAGS, *map(str, SOURCES), "-o", tmp, "-lm"],
                              capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            raise OSError(done.stderr.strip()[-2000:] or f"exit {done.returncode}")
        os.chmod(tmp, 0o700)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


@cache
def library() -> ctypes.CDLL | None:
    """The loaded kernel, built first if needed; None where it cannot be (see `reason`)."""
    if os.environ.get(ENV_VAR, "1") == "0" or not all(f.is_file() for f in SOURCES + HEADERS):
        return None
    found = _compiler()
    if found is None:
        return None
    compiler, version = found
    key = hashlib.sha256(b"".join(f.read_bytes() for f in SOURCES + HEADERS) + version.encode()
                         + " ".join(_FLAGS).encode())
    target = cache_dir() / "native" / f"kvchat-{key.hexdigest()[:16]}.so"
    try:
        if not target.is_file():
            _build(target, compiler)
        lib = ctypes.CDLL(str(target))
    except (OSError, subprocess.SubprocessError, KvchatError):
        return None
    p, n, i = ctypes.c_void_p, ctypes.c_long, ctypes.c_int
    for name, args in (("int8_head_mm", [p] * 4 + [n] * 4 + [i] * 2),
                       ("q6k_head_mm", [p] * 3 + [n] * 3 + [i] * 2),
                       ("int4_mm", [p] * 5 + [n] * 3 + [i] * 2),
                       ("attention", [p] * 9 + [ctypes.c_float] * 2 + [i] * 3),
                       ("gguf_blocks", [i, p, n, p, i]),
                       ("int4_from_blocks", [i, p, n, n, p, p, p, i]),
                       ("int4_grid", [p, n, p, p, p, i]),
                       ("rms_norm", [p, n, n, p, p, n, n, n, ctypes.c_float, i, p, i]),
                       ("rotary", [p, p, p, p, p, n, n, n, n, n, p]),
                       ("decode_layer", [p] * 6 + [n, n, i]),
                       ("decode_layers", [p, n] + [p] * 7 + [i]),
                       ("int8_head_isa", []), ("int4_isa", []), ("attention_isa", [])):
        function = getattr(lib, "kvchat_" + name)
        function.restype, function.argtypes = n if name == "int4_grid" else i, args
    return lib


def kernel_name() -> str:
    """What computes the head here, for `kvchat models` and the tests."""
    lib = library()
    if lib is None:
        return "torch (no native kernel: " + ("KVCHAT_NATIVE=0" if os.environ.get(ENV_VAR) == "0"
                                              else "no C compiler found") + ")"
    return f"native {ISAS[lib.kvchat_int8_head_isa()]}"


@cache
def int4_isa() -> int:
    """The int4 kernel's instruction set here, an index into INT4_ISAS (0 also when there is
    no library)."""
    lib = library()
    return 0 if lib is None else int(lib.kvchat_int4_isa())


def int4_native() -> bool:
    """Whether the int4 layers run on kvchat's kernel here (else on torch's)."""
    return int4_isa() >= 1


def int4_kernel_name() -> str:
    """What computes the int4 layers here, for `kvchat models` and the tests."""
    lib = library()
    if lib is None:
        return kernel_name()  # why there is no native library
    if int4_native():
        return f"native {INT4_ISAS[int4_isa()]}"
    return "torch (this CPU has neither AVX-512 VNNI nor AVX2 with FMA and F16C)"


def int4_mm(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
            isa: int = -1) -> torch.Tensor:
    """(M, K) bfloat16 activations times the int4 weight `q` ((N, K / 2) bytes, int4_matmul.c's
    tiles, `quant.pack_int4`) whose groups of 32 columns have float16 `scales` and `zeros`
    ((N, K / 32), tiled alike):
    (M, N) bfloat16. `isa` caps the instruction set (tests: 0 is the portable path)."""
    import torch

    lib = library()
    if lib is None or x.device.type != "cpu":
        raise KvchatError("the native int4 kernel runs on CPU tensors, where it is built")
    n, k = _int4_weight(q, scales, zeros)
    if x.dtype != torch.bfloat16 or x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"int4 matmul takes (M, {k}) bfloat16 inputs, got {tuple(x.shape)} "
                         f"{x.dtype}")
    x = x.contiguous()  # rows read k apart
    m = x.shape[0]
    out = torch.empty(m, n, dtype=torch.bfloat16)
    rc = lib.kvchat_int4_mm(q.data_ptr(), scales.data_ptr(), zeros.data_ptr(), x.data_ptr(),
                            out.data_ptr(), m, n, k, torch.get_num_threads(), isa)
    if rc != 0:
        raise ValueError("int4 matmul: out of memory")
    return out


def _int4_weight(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> tuple[int, int]:
    """(N, K) of an int4 weight in int4_matmul.c's layout, checked, as the kernel reads by them."""
    import torch

    n, k = int(q.shape[0]), int(q.shape[-1]) * 2
    f16, parts = torch.float16, (q, scales, zeros)
    if q.dtype != torch.uint8 or q.dim() != 2 or scales.dtype != f16 or zeros.dtype != f16 \
            or scales.shape != (n, k // 32) or zeros.shape != (n, k // 32) \
            or not all(t.is_contiguous() for t in parts):
        raise ValueError("int4 matmul takes a contiguous (N, K / 2) uint8 weight and (N, K / 32) "
                         "float16 scales and zeros")
    if n == 0 or n % 16 or k % 32:
        raise ValueError(f"int4 matmul needs N % 16 == 0 (rows in tiles of 16) and K % 32 == 0, "
                         f"got N={n}, K={k}")
    return n, k


def int4_bound(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor
               ) -> Callable[[torch.Tensor], torch.Tensor]:
    """`int4_mm` by one weight, its pointers and shape bound once: what a decode step calls
    per layer, a few microseconds cheaper than `int4_mm` (which checks and converts every
    argument per call). The function holds the tensors; it is for a weight that stays where it
    is (the fused forward's)."""
    import torch

    lib = library()
    if lib is None or q.device.type != "cpu":
        raise KvchatError("the native int4 kernel runs on CPU tensors, where it is built")
    n, k = _int4_weight(q, scales, zeros)
    kernel, bf16, threads = lib.kvchat_int4_mm, torch.bfloat16, torch.get_num_threads
    pointers = (q.data_ptr(), scales.data_ptr(), zeros.data_ptr())

    def mm(x: torch.Tensor) -> torch.Tensor:
        if x.dtype != bf16 or x.device.type != "cpu":
            raise ValueError(f"int4 matmul takes bfloat16 CPU inputs, got {x.dtype}")
        if x.dim() != 2 or x.shape[1] != k:  # the kernel would read past a narrower row
            raise ValueError(f"int4 matmul takes (M, {k}) inputs, got {tuple(x.shape)}")
        if not x.is_contiguous():
            x = x.contiguous()
        m = x.shape[0]
        out = torch.empty(m, n, dtype=bf16)
        rc = kernel(*pointers, x.data_ptr(), out.data_ptr(), m, n, k, threads(), -1)
        if rc != 0:
            raise ValueError("int4 matmul: out of memory")
        return out

    mm.weights = (q, scales, zeros)  # type: ignore[attr-defined]  # alive while mm is
    return mm


def int4_grid(weight: torch.Tensor, group: int = 32
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """`quant.quantize_int4`'s grid of a float32 (N, K) CPU weight, found by int4_grid.c (the
    same bits, one pass over the weight on every thread): (q as (N, K) uint8, scales, zeros as
    (N, K / 32) float16); None where it cannot run (no library, another group, a NaN)."""
    import torch

    lib = library()
    if lib is None or group != 32 or weight.device.type != "cpu" or weight.dim() != 2 \
            or weight.shape[1] % group:
        return None
    w = weight.detach().float().contiguous()
    n, k = w.shape
    q = torch.empty(n, k, dtype=torch.uint8)
    scales = torch.empty(n, k // group, dtype=torch.float16)
    zeros = torch.empty(n, k // group, dtype=torch.float16)
    bad = lib.kvchat_int4_grid(w.data_ptr(), n * k // group, q.data_ptr(), scales.data_ptr(),
                               zeros.data_ptr(), torch.get_num_threads())
    return None if bad else (q, scales, zeros)


def gguf_blocks(data: Any, ggml_type: int) -> Any:
    """A GGUF tensor's Q4_K or Q6_K blocks (`data`: its rows of bytes, gguf-py's shape) as the
    float32 numpy array gguf-py's `dequantize` gives, bit for bit, by gguf_blocks.c on every
    thread; None for another type or where the library is not built."""
    import numpy as np
    import torch
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    lib = library()
    kinds = (GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q6_K)  # gguf_blocks.c's
    if lib is None or ggml_type not in kinds or data.ndim < 1:
        return None
    values, size = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
    if data.shape[-1] % size:
        return None
    src = np.ascontiguousarray(data)
    out = np.empty((*src.shape[:-1], src.shape[-1] // size * values), np.float32)
    blocks = src.size // size
    if lib.kvchat_gguf_blocks(ggml_type, src.ctypes.data, blocks, out.ctypes.data,
                              torch.get_num_threads()) != 0:
        return None
    return out


def int4_from_blocks(data: Any, ggml_type: int, order: Any = None
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """A GGUF tensor's Q4_1 or Q4_K rows (`data`: its rows of bytes, gguf-py's shape), put in
    `order` (None: as they are), as the int4 layers' own layout, read as they are
    (gguf_blocks.c): (q (N, K / 2) bytes, scales, zeros (N, K / 32) float16, int4_matmul.c's
    tiles). None for another type, rows not in whole tiles of 16, where the layers do not run on
    kvchat's kernel, or where a scale overflows float16; each checked before any bytes are
    copied."""
    import numpy as np
    import torch
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    from kvchat.models.heap import huge_empty

    lib = library()
    kinds = (GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q4_K)
    if lib is None or not int4_native() or ggml_type not in kinds or data.ndim != 2:
        return None
    values, size = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
    if data.shape[-1] % size or data.shape[0] % 16:
        return None
    src = np.ascontiguousarray(data if order is None else data[order])
    n, k = src.shape[0], src.shape[1] // size * values
    q = huge_empty((n, k // 2), torch.uint8)
    scales = huge_empty((n, k // 32), torch.float16)
    zeros = huge_empty((n, k // 32), torch.float16)
    rc = lib.kvchat_int4_from_blocks(int(ggml_type), src.ctypes.data, n, k, q.data_ptr(),
                                     scales.data_ptr(), zeros.data_ptr(),
                                     torch.get_num_threads())
    return (q, scales, zeros) if rc == 0 else None


def attention_native() -> bool:
    """Whether attention runs on kvchat's fixed-order kernel here (`attention`)."""
    return library() is not None


def attention_isa() -> int:
    """The attention kernel's instruction set here: 2 AVX-512, 1 AVX2, 0 the baseline (also
    when there is no library); each gives the same bits."""
    lib = library()
    return 0 if lib is None else int(lib.kvchat_attention_isa())


def attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              mask: torch.Tensor | None, scaling: float, softcap: float | None = None,
              head: tuple[torch.Tensor, torch.Tensor] | None = None,
              isa: int = -1) -> torch.Tensor:
    """attention.c's fixed-order attention: query (B, H, Q, D), key / value (B, KH, N, D),
    each with its last dim contiguous, in one dtype (bfloat16 or float32); `mask` (B, Q, N)
    bool (True: attend) or None (causal, bottom-right aligned); `head` a (1, KH, P, D) K/V
    every row sees first. Returns (B, Q, H, D) in the query's dtype."""
    import torch

    lib = library()
    if lib is None:
        raise KvchatError("the native attention kernel is not built here")
    b, heads, n_queries, dim = query.shape
    kv_heads, n_keys = key.shape[1], key.shape[2]
    dtype, qs, ks, vs = query.dtype, query.stride(), key.stride(), value.stride()
    hk, hv = head if head is not None else (key, value)
    hks, hvs = (hk.stride(), hv.stride()) if head is not None else (ks, vs)
    if key.dtype != dtype or value.dtype != dtype or hk.dtype != dtype or hv.dtype != dtype \
            or qs[3] != 1 or ks[3] != 1 or vs[3] != 1 or hks[3] != 1 or hvs[3] != 1:
        raise ValueError("attention: tensors of one dtype with a contiguous last dim")
    mask_bytes = None
    if mask is not None:
        mask_bytes = mask.expand(b, n_queries, n_keys).contiguous().view(torch.uint8)
    out = torch.empty(b, n_queries, heads, dim, dtype=dtype)
    shape = _LONG7(b, heads, kv_heads, n_queries, n_keys, hk.shape[2] if head is not None else 0,
                   dim)
    strides = _LONG13(qs[0], qs[1], qs[2], ks[0], ks[1], ks[2], vs[0], vs[1], vs[2], hks[1],
                      hks[2], hvs[1], hvs[2])
    rc = lib.kvchat_attention(
        query.data_ptr(), key.data_ptr(), value.data_ptr(),
        hk.data_ptr() if head is not None else None, hv.data_ptr() if head is not None else None,
        None if mask_bytes is None else mask_bytes.data_ptr(), out.data_ptr(), shape, strides,
        scaling, softcap or 0.0, int(dtype == torch.bfloat16), torch.get_num_threads(), isa)
    if rc != 0:
        raise ValueError("attention: bad shapes" if rc == -1 else "out of memory")
    return out
