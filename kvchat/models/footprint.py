"""The memory a model holds once loaded, estimated before it loads, and the memory this machine
has for it.

Four parts, each from files alone (a GGUF's header, a folder's safetensors headers):
- weights as kvchat packs them (`kvchat.models.quant`, `kvchat.models.gguf_weights`): under int4
  a linear weight is 4 bits plus a 16-bit scale and zero per 32 weights (5/8 byte), under int8
  1 byte plus a bfloat16 scale per row, the output head int8 with a float32 scale per 32 weights
  (9/8 byte) under both, or a GGUF's Q6_K head as the file's blocks (0.82 byte); a tied head is
  packed on its own while the embedding, the norms and the biases stay bfloat16 (a large Q8_0
  embedding is read from the head's rows instead, a Q4_K or Q6_K one kept as the file's blocks,
  which a Q6_K head shares).
  Float precisions: the precision's itemsize per parameter, a tied head stored once.
- the K/V pool at its configured size (`CacheConfig.blocks_for`), counted full: it is reserved
  at once and its pages become resident as blocks fill.
- the runtime: python with torch, transformers and kvchat imported, and a tokenizer.
- what a load holds on the side: a GGUF one tensor at a time, in float32 with the copies its
  de-quantizing makes; a folder at int4 / int8 its whole float32 model, the packing's input.
  It is freed before the tokenizer loads and the pool is made, so the need is the larger of the
  two moments, not their sum.

Torch-free, like `kvchat.models.precision`: `kvchat models` reads it cheaply.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

from kvchat.errors import ModelTooLarge
from kvchat.files import read_map
from kvchat.models.precision import GGUFTensor, gguf_layout

if TYPE_CHECKING:
    from kvchat.config import CacheConfig
    from kvchat.models.loading import ModelSource

# Measured on a 2-core x86 VM (VmRSS in /proc/self/status) loading the embedded SmolLM2 (int4)
# and Gemma 3 270M (Q4_K_M, int8) as `kvchat batch` does: 340 MiB with python, torch,
# transformers and kvchat imported, before any model; after the load, less the weights and the
# tokenizer, 130 / 65 MiB more (heap the load leaves behind, the model's classes).
IMPORTS_BYTES = 340 * 2**20
RUNTIME_BYTES = 470 * 2**20
# A GGUF's loaded tokenizer (`gguf.load_tokenizer`, the heap handed back after it) holds
# 18 MiB for SmolLM2's 3.5 MB tokenizer.json and 109 MiB for Gemma 3's 33 MB: about 8 MiB plus
# 3.2 bytes per byte of the file (a class transformers builds itself, Qwen2's, holds more).
# It loads before the weights, and its passing peak (363 MiB for Gemma 3) is over before they
# arrive.
TOKENIZER_BYTES = 8 * 2**20
TOKENIZER_PER_FILE_BYTE = 3.2
# De-quantizing a GGUF's largest tensor and packing it peaked at 3.8x (SmolLM2's embedding) and
# 4.3x (Gemma 3's, with 0.3x of the file's own pages) its float32 size: gguf-py's float32
# intermediates, the result, the bfloat16 copy and the int8 head's temporaries.
GGUF_LOAD_COPIES = 4.0
# The token embedding and the output head are read this many float32 bytes of rows at a time
# (kvchat.models.gguf_weights), so only a chunk of them is ever held in float32.
CHUNK_ROWS_BYTES = 32 << 20
ROW_CHUNKED = frozenset({"token_embd.weight", "output.weight"})
IGNORE_ENV_VAR = "KVCHAT_IGNORE_MEMORY"
_GROUP = 32  # int4 weights per scale and zero (kvchat.models.quant.GROUP)
_Q8_0 = 8  # GGMLQuantizationType.Q8_0: a tied embedding the int8 head holds exactly
_Q6_K = 14
_BLOCKS = {12: (144, 256), 14: (210, 256)}  # Q4_K, Q6_K embeddings: `BlockEmbedding`'s bytes
# the architectures whose loads keep such an embedding as blocks (a plain or scaled embedding,
# read by rows: `gguf_weights._KEEPS_EMBEDDINGS`); elsewhere it is counted as a table
_KEEPS_BLOCKS = frozenset({"llama", "qwen2", "qwen3", "gemma2", "gemma3", "phi3"})
_ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2, "int8": 2, "int4": 2}
_SAFETENSORS_ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2,
                         "I8": 1, "U8": 1, "BOOL": 1}
_UNLIMITED = 2**60  # a cgroup v1 "no limit" is 2**63 less a page


@dataclass(frozen=True)
class Footprint:
    """Bytes a model needs in memory: `resident` once loaded with the pool full, `while_loading`
    at the load's peak (counting every weight already there), `total` the larger."""

    weights: int
    kv_pool: int
    runtime: int  # the interpreter and libraries, the tokenizer
    loading: int  # float32 held on the side while the weights load
    tokenizer: int = 0  # the tokenizer's share of `runtime`, resident before the weights load

    @property
    def resident(self) -> int:
        return self.weights + self.kv_pool + self.runtime

    @property
    def while_loading(self) -> int:
        # the tokenizer loads before the weights, the pool is made after them
        return self.weights + IMPORTS_BYTES + self.tokenizer + self.loading

    @property
    def total(self) -> int:
        return max(self.resident, self.while_loading)


@dataclass(frozen=True)
class Available:
    """Memory this process may still take, and where the number was read."""

    bytes: int
    where: str


class _Weights(NamedTuple):
    packed: int  # bytes the loaded model's tensors hold
    loading: int  # float32 bytes held on the side during the load
    step: int = 0  # bytes a decode step reads (`quant.step_bytes`); 0: not counted


def footprint_of(source: ModelSource, folder: Path | None, precision: str, tied: bool,
                 kv_bytes_per_token: int, cache: CacheConfig | None,
                 packed: bool = False) -> Footprint | None:
    """The footprint of a resolved model whose config and tokenizer are in `folder` (the
    converted folder of a GGUF); None for a hub id, whose files are not read before loading.
    `packed`: the load reads a packed-weights file (`packed_weights`), each tensor straight
    into its own allocation, so it holds no float32 copies on the side."""
    if not source.is_local or folder is None:
        return None
    weights = Path(source.location) if source.is_gguf else folder
    footprint = estimate(weights, source.is_gguf, precision, tied, kv_bytes_per_token, cache,
                         folder)
    if footprint is not None and packed:
        footprint = replace(footprint, loading=0)
    return footprint


def estimate(location: Path, is_gguf: bool, precision: str, tied: bool,
             kv_bytes_per_token: int, cache: CacheConfig | None,
             tokenizer_folder: Path | None = None) -> Footprint | None:
    """The footprint of the model at `location` (a .gguf file, or a folder of safetensors) at
    `precision`, with a pool sized by `cache` (None: no pool) and the tokenizer.json of
    `tokenizer_folder`; None if no weights can be read there (a hub id, a folder of .bin
    files)."""
    try:
        weights = _gguf_weights(location, precision, tied) if is_gguf \
            else _folder_weights(location, precision, tied)
    except (OSError, ValueError, KeyError, TypeError, struct.error):
        return None
    if weights is None:
        return None
    pool = 0
    if cache is not None:
        pool = cache.blocks_for(kv_bytes_per_token) * cache.block_size * kv_bytes_per_token
    tokenizer = tokenizer_bytes(tokenizer_folder)
    return Footprint(weights.packed, pool, RUNTIME_BYTES + tokenizer, weights.loading, tokenizer)


def tokenizer_bytes(tokenizer_folder: Path | None) -> int:
    """What a model's tokenizer holds once loaded."""
    path = tokenizer_folder / "tokenizer.json" if tokenizer_folder is not None else None
    size = path.stat().st_size if path is not None and path.is_file() else 0
    return TOKENIZER_BYTES + int(size * TOKENIZER_PER_FILE_BYTE)


def _linear_bytes(n: int, k: int, precision: str, is_head: bool) -> int:
    """Bytes of an (n, k) linear weight as `gguf_weights._pack` / `quantize_model` pack it: the
    kernels' own shape conditions (`Int4Linear.fits`, `Int8Linear.fits`) decide, else dense."""
    if precision == "int4" and not is_head and k % _GROUP == 0 and n % 16 == 0:
        return n * k // 2 + (k // _GROUP) * n * 4  # (N, K/2) uint8 + (K/32, N, 2) bfloat16
    if is_head and precision in ("int4", "int8") and k % 16 == 0:
        groups = k // _GROUP if k % _GROUP == 0 else 1
        return n * k + n * groups * 4  # (N, K) int8 + (N, K/32) float32
    if precision in ("int4", "int8") and k % 16 == 0:
        return n * k + n * 2  # (N, K) int8 + (N,) bfloat16
    return n * k * _ITEMSIZE[precision]


def _gguf_weights(path: Path, precision: str, tied: bool) -> _Weights:
    packs = precision in ("int4", "int8")
    size = _ITEMSIZE[precision]
    with read_map(path) as buf:
        layout = gguf_layout(buf)
    tensors, arch = layout.tensors, layout.architecture
    total = largest = 0
    own = 0  # the embedding's own bytes: a step reads a row of them per token, not all
    for tensor in tensors:
        if tensor.name.startswith("rope_freqs"):  # llama.cpp's own; transformers has none
            continue
        before = total
        count = math.prod(tensor.dims)
        chunked = tensor.name in ROW_CHUNKED and len(tensor.dims) == 2
        held = min(count, max(tensor.dims[0], CHUNK_ROWS_BYTES // 4)) if chunked else count
        largest = max(largest, held)
        embedding = "embd" in tensor.name  # token_embd, position_embd: not linear layers
        head_blocks = packs and head_kept_as_blocks(tensor, arch)
        if packs and len(tensor.dims) == 2 and not embedding:
            k, n = tensor.dims  # GGUF's order: the fastest-varying (input) first
            is_head = tensor.name == "output.weight"
            total += count // 256 * 210 if is_head and head_blocks \
                else _linear_bytes(n, k, precision, is_head)
        elif packs and tensor.name == "token_embd.weight" and tensor.ggml_type in _BLOCKS \
                and arch in _KEEPS_BLOCKS and tensor.dims[0] % 256 == 0:
            block_bytes, values = _BLOCKS[tensor.ggml_type]  # kept as the file's blocks
            total += count // values * block_bytes
        else:
            total += count * size
        packed_head = 0
        if packs and tied and tensor.name == "token_embd.weight" and not head_blocks:
            k, n = tensor.dims  # the head, packed from the embedding's numbers
            packed_head = _linear_bytes(n, k, precision, True)
            total += packed_head
            if tensor.ggml_type == _Q8_0 and chunked and count * 4 > CHUNK_ROWS_BYTES:
                total -= count * size  # read from the head's rows (`TiedInt8Embedding`)
        if tensor.name == "token_embd.weight":
            # tied: a float head is the table itself, a Q6_K head reads the blocks
            own = total - before - packed_head if not tied or packed_head else 0
    return _Weights(total, int(GGUF_LOAD_COPIES * 4 * largest), total - own)


def gguf_step_bytes(path: Path, precision: str, tied: bool) -> int:
    """The bytes of weights one decode step reads once the GGUF at `path` is loaded at
    `precision`: what `quant.step_bytes` counts on the loaded model, from the header alone."""
    return _gguf_weights(path, precision, tied).step


def head_kept_as_blocks(tensor: GGUFTensor, arch: str) -> bool:
    """Whether a packed load keeps `tensor` (the head, or a tied head's embedding) as a Q6_K
    head's blocks (`BlockHeadLinear`): the rule `gguf_weights` loads by (with the head's own
    conditions, `BlockHeadLinear.takes`), the estimate counts by and `kvchat models` names."""
    return tensor.ggml_type == _Q6_K and arch in _KEEPS_BLOCKS and tensor.dims[0] % 256 == 0 \
        and tensor.name in ROW_CHUNKED and len(tensor.dims) == 2


def gguf_head(path: Path, tied: bool) -> str:
    """What a packed load of the GGUF at `path` makes its output head, for `kvchat models`."""
    with read_map(path) as buf:
        layout = gguf_layout(buf)
    name = "token_embd.weight" if tied else "output.weight"
    tensor = next((t for t in layout.tensors if t.name == name), None)
    if tensor is not None and head_kept_as_blocks(tensor, layout.architecture):
        return "Q6_K as the file holds it, a float32 scale per 16 weights"
    return "int8, a float32 scale per 32 weights"


def _folder_weights(folder: Path, precision: str, tied: bool) -> _Weights | None:
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        return None
    packs = precision in ("int4", "int8")
    total = largest = floats = 0
    for path in files:
        with open(path, "rb") as fh:
            (length,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(length))
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            shape, count = entry["shape"], math.prod(entry["shape"])
            floats += 4 * count
            largest = max(largest, count * _SAFETENSORS_ITEMSIZE.get(entry["dtype"], 4))
            embedding = "embed" in name or name.endswith(("wte.weight", "wpe.weight"))
            if packs and len(shape) == 2 and name.endswith(".weight") and not embedding:
                total += _linear_bytes(shape[0], shape[1], precision, name == "lm_head.weight")
            else:
                total += count * _ITEMSIZE[precision]
            if packs and tied and embedding and "embed_tokens" in name:
                total += _linear_bytes(shape[0], shape[1], precision, True)
    # int4 / int8 load the float32 model whole and pack it; a float load reads tensor by tensor
    return _Weights(total, floats if packs else largest)


# --- what this machine has ------------------------------------------------------------------


def available_memory() -> Available | None:
    """MemAvailable of /proc/meminfo, or less where a cgroup limit leaves less (its limit less
    what the group holds, reclaimable file pages aside); None where neither can be read."""
    found: list[Available] = []
    meminfo = _read("/proc/meminfo")
    for line in (meminfo or "").splitlines():
        if line.startswith("MemAvailable:"):
            found.append(Available(int(line.split()[1]) * 1024, "MemAvailable in /proc/meminfo"))
    for limit, usage, stat, inactive in (
        ("memory.max", "memory.current", "memory.stat", "inactive_file"),  # cgroup v2
        ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes", "memory/memory.stat",
         "total_inactive_file"),  # cgroup v1
    ):
        left = _cgroup_left(Path("/sys/fs/cgroup"), limit, usage, stat, inactive)
        if left is not None:
            found.append(Available(left, f"the cgroup limit in /sys/fs/cgroup/{limit}"))
    return min(found, key=lambda a: a.bytes) if found else None


def _cgroup_left(root: Path, limit: str, usage: str, stat: str, inactive: str) -> int | None:
    text = _read(root / limit)
    if text is None or text.strip() in ("", "max"):
        return None
    try:
        cap = int(text)
        used = int(_read(root / usage) or 0)
    except ValueError:
        return None
    if cap >= _UNLIMITED:
        return None
    reclaimable = 0
    for line in (_read(root / stat) or "").splitlines():
        key, _, value = line.partition(" ")
        if key == inactive and value.strip().isdigit():
            reclaimable = int(value)
    return max(0, cap - max(0, used - reclaimable))


def _read(path: str | Path) -> str | None:
    try:
        return Path(path).read_text()
    except OSError:
        return None


# --- the refusal ----------------------------------------------------------------------------


def check_fits(footprint: Footprint | None, available: Available | None, what: str,
               precision: str) -> None:
    """Raise ModelTooLarge when `footprint` needs more than `available`, unless
    $KVCHAT_IGNORE_MEMORY is set; an unknown footprint or an unreadable machine passes."""
    if footprint is None or available is None or footprint.total <= available.bytes:
        return
    if os.environ.get(IGNORE_ENV_VAR, "").strip() not in ("", "0"):
        return
    pool = f", K/V pool {mib(footprint.kv_pool)} when full" if footprint.kv_pool else ""
    peak = footprint.while_loading
    smaller = "run it at --dtype int4 (4-bit weights)" if precision != "int4" \
        else "pick a smaller model or a smaller quantization of it"
    pool_advice = ", give the K/V pool less with --cache-mb" if footprint.kv_pool else ""
    raise ModelTooLarge(
        f"{what} would need about {mib(footprint.total)} of memory at {precision} (once loaded "
        f"{mib(footprint.resident)}: weights {mib(footprint.weights)}{pool}, runtime "
        f"{mib(footprint.runtime)}; while loading up to {mib(peak)}, "
        f"{mib(footprint.loading)} of it float32 copies), but this machine has "
        f"{mib(available.bytes)} available ({available.where}), so it was not loaded. To fit, "
        f"{smaller}{pool_advice}, or free memory; set {IGNORE_ENV_VAR}=1 to load it anyway."
    )


def mib(n_bytes: int) -> str:
    return f"{n_bytes / 2**20:,.0f} MiB"
