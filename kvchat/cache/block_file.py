"""The on-disk form of one cached block (a `.kvb` file), checksummed end to end.

    offset 0   magic b"KVCB", version (u16), header length h (u32)     10 bytes, little-endian
    offset 10  header: JSON {key, n_layers, n_kv_heads, head_dim, block_size, dtype, tokens},
               padded with spaces so that 10 + h is a multiple of 64
    10 + h     payload: for each layer K then V, each (n_kv_heads, block_size, head_dim), raw
    end - 32   BLAKE2b-256 of everything before it

A reader checks the length the header implies, the checksum, then that the header names the key
and layout it asked for, before any tensor is built: a damaged file is never served.
The module imports torch only inside the functions that touch tensors.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    import torch

    from kvchat.cache.blocks import BlockManager

MAGIC = b"KVCB"
VERSION = 1
_PREFIX = struct.Struct("<4sHI")
CHECKSUM_BYTES = 32
PAYLOAD_ALIGN = 64  # the payload starts at a multiple of this offset
_MAX_HEADER = 1 << 24  # a header is a few KB; a larger length field means a damaged file
_ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}

BlockKV = list[tuple["torch.Tensor", "torch.Tensor"]]  # per layer (K, V), each (H, bs, D), CPU


class BlockFileError(ValueError):
    """A block file that must not be served; the message says why in a few words."""


@dataclass(frozen=True)
class BlockLayout:
    """The shape of one block's K/V: what a file must match to be loaded into a pool."""

    n_layers: int
    n_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str  # torch dtype name without "torch.", e.g. "bfloat16"

    def __post_init__(self) -> None:
        if min(self.n_layers, self.n_kv_heads, self.head_dim, self.block_size) < 1:
            raise ValueError(f"a block layout needs positive sizes, got {self}")

    @classmethod
    def of(cls, manager: BlockManager) -> BlockLayout:
        return cls(manager.n_layers, manager.n_kv_heads, manager.head_dim, manager.block_size,
                   str(manager.dtype).removeprefix("torch."))

    @property
    def itemsize(self) -> int:
        if self.dtype in _ITEMSIZE:
            return _ITEMSIZE[self.dtype]
        return int(_torch_dtype(self.dtype).itemsize)

    @property
    def tensor_bytes(self) -> int:
        """Bytes of one layer's K (or V) for one block."""
        return self.n_kv_heads * self.block_size * self.head_dim * self.itemsize

    @property
    def payload_bytes(self) -> int:
        return 2 * self.n_layers * self.tensor_bytes


class DecodedBlock(NamedTuple):
    tokens: tuple[int, ...]
    kv: BlockKV


def _torch_dtype(name: str) -> torch.dtype:
    import torch

    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


def _header(key: str, tokens: Sequence[int], layout: BlockLayout) -> bytes:
    header = json.dumps({"key": key, **asdict(layout), "tokens": [int(t) for t in tokens]},
                        separators=(",", ":")).encode()
    # JSON may end in spaces: they align the payload, so tensors read in place are aligned too
    header += b" " * (-(_PREFIX.size + len(header)) % PAYLOAD_ALIGN)
    return _PREFIX.pack(MAGIC, VERSION, len(header)) + header


def copy_block_kv(kv: Sequence[tuple[torch.Tensor, torch.Tensor]], layout: BlockLayout,
                  n_tokens: int) -> BlockKV:
    """A private CPU copy of one block's K/V (the pool slot may be reused as soon as this
    returns), positions from n_tokens on zeroed: a partial block's unused slots hold whatever
    the pool had there, which must neither leak into a file nor make equal blocks differ."""
    import torch

    if len(kv) != layout.n_layers:
        raise ValueError(f"expected K/V for {layout.n_layers} layers, got {len(kv)}")
    if not 0 < n_tokens <= layout.block_size:
        raise ValueError(f"a block holds 1..{layout.block_size} tokens, not {n_tokens}")
    shape = (layout.n_kv_heads, layout.block_size, layout.head_dim)
    dtype = _torch_dtype(layout.dtype)
    out: BlockKV = []
    for k, v in kv:
        pair = []
        for t in (k, v):
            t = t[0] if t.dim() == 4 and t.shape[0] == 1 else t  # export_blocks' (1, H, bs, D)
            if tuple(t.shape) != shape or t.dtype != dtype:
                raise ValueError(f"block K/V must be {layout.dtype} {shape}, "
                                 f"got {str(t.dtype).removeprefix('torch.')} {tuple(t.shape)}")
            copy = torch.empty(shape, dtype=dtype)
            copy.copy_(t.detach())
            copy[:, n_tokens:] = 0
            pair.append(copy)
        out.append((pair[0], pair[1]))
    return out


def encode_block(key: str, tokens: Sequence[int], layout: BlockLayout,
                 kv: BlockKV) -> Iterator[bytes | memoryview]:
    """The file's bytes in pieces (no copy of the payload), ending with the checksum.
    `kv` is `copy_block_kv`'s result."""
    import torch

    digest = hashlib.blake2b(digest_size=CHECKSUM_BYTES)
    pieces: list[bytes | memoryview] = [_header(key, tokens, layout)]
    for k, v in kv:
        for t in (k, v):
            pieces.append(t.contiguous().view(-1).view(torch.uint8).numpy().data)
    for piece in pieces:
        digest.update(piece)
        yield piece
    yield digest.digest()


def _parse_header(data: bytes | bytearray) -> tuple[dict[str, Any], int]:
    """The header and where the payload starts; BlockFileError if they cannot be read."""
    if len(data) < _PREFIX.size:
        raise BlockFileError(f"truncated ({len(data)} bytes)")
    magic, version, size = _PREFIX.unpack_from(data)
    if magic != MAGIC or version != VERSION:
        raise BlockFileError(f"not a version {VERSION} block file")
    if size > _MAX_HEADER or _PREFIX.size + size > len(data):
        raise BlockFileError(f"truncated header ({len(data)} bytes)")
    try:
        header = json.loads(bytes(data[_PREFIX.size : _PREFIX.size + size]))
        if not isinstance(header, dict):
            raise TypeError("not an object")
    except (ValueError, TypeError) as exc:
        raise BlockFileError(f"unreadable header ({exc})") from exc
    return header, _PREFIX.size + size


def decode_block(data: bytearray, key: str, layout: BlockLayout) -> DecodedBlock:
    """The tokens and K/V of a block file's bytes, checked against the key and layout asked
    for; raises BlockFileError otherwise. The tensors are views of `data`."""
    import torch

    header, start = _parse_header(data)
    try:
        found = BlockLayout(**{f: header[f] for f in asdict(layout)})
        tokens = tuple(int(t) for t in header["tokens"])
        expected = start + found.payload_bytes + CHECKSUM_BYTES
    except (KeyError, TypeError, ValueError) as exc:
        raise BlockFileError(f"incomplete header ({exc})") from exc
    if len(data) != expected:
        what = "truncated" if len(data) < expected else "overlong"
        raise BlockFileError(f"{what} ({len(data)} of {expected} bytes)")
    body = memoryview(data)[:-CHECKSUM_BYTES]
    if hashlib.blake2b(body, digest_size=CHECKSUM_BYTES).digest() != data[-CHECKSUM_BYTES:]:
        raise BlockFileError("checksum mismatch")
    if header.get("key") != key:
        raise BlockFileError("the file holds another block")
    if found != layout:
        raise BlockFileError(f"layout {found} differs from the store's")
    if not 0 < len(tokens) <= layout.block_size:
        raise BlockFileError(f"holds {len(tokens)} tokens")
    dtype = _torch_dtype(layout.dtype)
    shape = (layout.n_kv_heads, layout.block_size, layout.head_dim)
    count = layout.tensor_bytes // layout.itemsize
    kv: BlockKV = []
    for layer in range(layout.n_layers):
        at = start + 2 * layer * layout.tensor_bytes
        k = torch.frombuffer(data, dtype=dtype, count=count, offset=at).view(shape)
        v = torch.frombuffer(data, dtype=dtype, count=count,
                             offset=at + layout.tensor_bytes).view(shape)
        kv.append((k, v))
    return DecodedBlock(tokens, kv)


def read_block_bytes(path: Path) -> bytearray:
    """The whole file, in a mutable buffer (torch.frombuffer warns on immutable bytes)."""
    with os.fdopen(os.open(path, os.O_RDONLY | os.O_NOFOLLOW), "rb", buffering=0) as fh:
        data = bytearray(os.fstat(fh.fileno()).st_size)
        view, got = memoryview(data), 0
        while got < len(data):
            n = fh.readinto(view[got:])
            if not n:  # the file shrank after fstat
                return data[:got]
            got += n
        return data
