"""Content keys of cached blocks: a chain of SHA-256 digests over the token prefix.

    root    = sha256(TAG || len || fingerprint json || len || namespace)
    key_0   = sha256(root    || n_0 || tokens of block 0)
    key_i   = sha256(key_i-1 || n_i || tokens of block i)

A block's key therefore names everything its K/V depends on: the model (its fingerprint: weights'
config, tokenizer, dtype, block size, the weights' bytes, the numerics and the forward), the
namespace (a tenant's salt; "" by default) and every token up to the end of the block, since
K/V at position p depends on tokens <= p. Every field is
length-prefixed or fixed-width, so two different inputs never share an encoding: a collision
would be a SHA-256 collision. A trailing partial block hashes its length like any other, so its
key differs from the key of any full block and of any other partial length.

Plain Python (hashlib, struct): the radix tree and `kvchat inspect` use it without torch.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

_TAG = b"kvchat-block-key-v1\0"
KEY_HEX_LEN = 64  # a key is the hex form of a SHA-256 digest


class KeyChain(NamedTuple):
    """Keys of a token sequence's blocks: one per full block, in order, and the key of the
    trailing partial block when the sequence does not end on a block boundary."""

    full: tuple[str, ...]
    partial: str | None


def _field(data: bytes) -> bytes:
    return struct.pack("<Q", len(data)) + data


def root_key(fingerprint: Mapping[str, Any], namespace: str = "") -> str:
    """The chain's start: what must match for any stored block to be reusable."""
    fp = json.dumps(dict(fingerprint), sort_keys=True, separators=(",", ":"), default=str)
    digest = hashlib.sha256(_TAG + _field(fp.encode()) + _field(namespace.encode()))
    return digest.hexdigest()


def next_key(parent: str, tokens: Sequence[int]) -> str:
    """The key of the block holding `tokens`, following the block (or root) keyed `parent`.
    Token ids are packed as signed 64-bit little-endian integers, after their count."""
    if len(parent) != KEY_HEX_LEN:
        raise ValueError(f"not a block key: {parent!r}")
    payload = struct.pack(f"<Q{len(tokens)}q", len(tokens), *tokens)
    return hashlib.sha256(bytes.fromhex(parent) + payload).hexdigest()


def chain_keys(tokens: Sequence[int], block_size: int, root: str) -> KeyChain:
    """Keys of every block of `tokens` (block i holds tokens[i*bs:(i+1)*bs]), chained from
    `root` (see `root_key`)."""
    if block_size < 1:
        raise ValueError("block_size must be positive")
    full: list[str] = []
    key = root
    n_full = len(tokens) // block_size
    for i in range(n_full):
        key = next_key(key, tokens[i * block_size : (i + 1) * block_size])
        full.append(key)
    tail = tokens[n_full * block_size :]
    return KeyChain(tuple(full), next_key(key, tail) if tail else None)


def block_keys(tokens: Sequence[int], block_size: int, root: str) -> list[str]:
    """Keys of the full blocks of `tokens` only (what a prefix cache shares)."""
    return list(chain_keys(tokens, block_size, root).full)


def is_key(text: str) -> bool:
    """A well-formed key (64 lower-case hex digits): file names in a store are checked with it."""
    return len(text) == KEY_HEX_LEN and all(c in "0123456789abcdef" for c in text)
