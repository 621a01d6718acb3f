"""Pinned prefixes: cached token sequences whose pool blocks eviction never takes (a system
prompt every conversation starts with, a few-shot header).

A pin names a prefix by its tokens and namespace and holds the ids of the resident blocks that
cover it; those blocks neither leave the pool nor spill to disk while pinned. Pins are capped at
a fraction of the pool (`max_fraction`, the CLI's --max-pinned), so pinning can never starve the
cache of room for the requests it serves: a pin over the cap is refused, never half made.
Pinning the same prefix twice is one pin; unpinning it ends it.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvchat.cache.kvcache import PagedKVCache

DEFAULT_MAX_PINNED = 0.5  # of the pool's blocks


class PinError(ValueError):
    """A pin that cannot be made: the prefix is not cached, or it would pass the cap."""


def pin_id(namespace: str, tokens: Sequence[int]) -> str:
    """A short stable name for the pin of `tokens` in `namespace`."""
    data = namespace.encode() + b"\0" + ",".join(map(str, tokens)).encode()
    return hashlib.sha256(data).hexdigest()[:12]


@dataclass(frozen=True)
class Pin:
    namespace: str
    tokens: tuple[int, ...]
    label: str  # what was pinned, for people: "system prompt", "conversation", ...
    block_ids: tuple[int, ...]

    @property
    def pin_id(self) -> str:
        return pin_id(self.namespace, self.tokens)

    def to_json(self) -> dict[str, Any]:
        """What a snapshot keeps (block ids are the pool's and do not survive a restart)."""
        return {"id": self.pin_id, "namespace": self.namespace, "tokens": list(self.tokens),
                "label": self.label}


class PinTable:
    """The cache's pins and the blocks they hold (a block may serve several pins)."""

    def __init__(self, num_blocks: int, max_fraction: float = DEFAULT_MAX_PINNED) -> None:
        if not 0.0 <= max_fraction <= 1.0:
            raise ValueError(f"max pinned fraction must be in [0, 1], got {max_fraction}")
        self.num_blocks = num_blocks
        self.max_fraction = max_fraction
        self._pins: dict[str, Pin] = {}
        self._count: Counter[int] = Counter()  # block id -> pins holding it

    @property
    def cap(self) -> int:
        """The most pool blocks pins may hold together."""
        return int(self.num_blocks * self.max_fraction)

    def __len__(self) -> int:
        return len(self._pins)

    def __iter__(self) -> Iterator[Pin]:
        return iter(list(self._pins.values()))

    def holds(self, block_id: int) -> bool:
        return block_id in self._count

    @property
    def block_ids(self) -> frozenset[int]:
        return frozenset(self._count)

    def get(self, pid: str) -> Pin | None:
        return self._pins.get(pid)

    def add(self, pin: Pin) -> Pin:
        """Hold the pin's blocks; raises PinError past the cap (nothing changes then)."""
        if pin.pin_id in self._pins:
            return self._pins[pin.pin_id]
        new = {b for b in pin.block_ids if b not in self._count}
        if len(self._count) + len(new) > self.cap:
            raise PinError(
                f"pinning these {len(pin.tokens)} tokens needs {len(new)} more pool blocks; "
                f"{len(self._count)} of the {self.cap} pinned blocks allowed "
                f"({self.max_fraction:.0%} of {self.num_blocks}, --max-pinned) are in use. "
                "Unpin something, or raise --max-pinned.")
        self._pins[pin.pin_id] = pin
        self._count.update(pin.block_ids)
        return pin

    def remove(self, pid: str) -> Pin | None:
        pin = self._pins.pop(pid, None)
        if pin is not None:
            self._count.subtract(pin.block_ids)
            for bid in pin.block_ids:
                if self._count[bid] <= 0:
                    del self._count[bid]
        return pin

    def clear(self) -> list[Pin]:
        gone = list(self._pins.values())
        self._pins.clear()
        self._count.clear()
        return gone

    def to_json(self) -> list[dict[str, Any]]:
        return [p.to_json() for p in self._pins.values()]


def saved_pins(rows: Iterable[Mapping[str, Any]]) -> list[tuple[str, tuple[int, ...], str]]:
    """(namespace, tokens, label) of the pins a snapshot kept (see `Pin.to_json`)."""
    return [(str(r.get("namespace", "")), tuple(int(t) for t in r["tokens"]),
             str(r.get("label", "prefix"))) for r in rows]


def pin_prefix(cache: PagedKVCache, tokens: Sequence[int], namespace: str, label: str) -> Pin:
    """Keep the blocks of the cached prefix `tokens` in the pool: eviction skips them and they
    never spill. Loads them from disk first if needed. Raises PinError when `tokens` are not all
    cached, or the pin would pass the cap."""
    if not tokens:
        raise PinError("nothing to pin: the prefix is empty")
    match = cache.load(cache.tree.find_prefix(tokens, namespace))
    if match.matched < len(tokens) or match.disk:
        raise PinError(f"only {match.matched} of the {len(tokens)} tokens to pin are in "
                       "the cache; run a request with them first")
    blocks = match.blocks[: -(-len(tokens) // cache.block_size)]
    return cache.pins.add(Pin(namespace, tuple(tokens), label,
                              tuple(b.block_id for b in blocks)))
