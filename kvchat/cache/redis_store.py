"""RedisStore: the block tier on Redis or Valkey (`--store redis://host:port/db`), which every
kvchat instance of a fleet reaches, whatever machine it runs on (a `BlockBackend`, always shared).

Each block is one string value under `kvchat:block:<chained key>`: the bytes of its `.kvb` file
(`block_file`), so every read checks length, checksum, key and layout exactly as a file's, and a
value that fails is deleted and never served. Blocks are immutable: writes are `SET NX`, queued
and sent by one background thread, off the decode path.

The budget is Redis's own `maxmemory` with an LRU eviction policy, not kvchat's accounting: the
keys are every instance's, and only the server sees them all. When the server has no maxmemory
(0), the first instance to connect sets it to its --disk-cache-gb and `maxmemory-policy` to
allkeys-lru (CONFIG SET); a limit the operator set stays as it is, and a policy that never
evicts is one warning (writes are then refused when full: dropped, nothing else fails).

A store that is down or slow (every command waits at most `timeout_s`) is one warning, then not
asked for `retry_s` (gets miss, puts are dropped), then tried again; the engine goes on from
memory meanwhile, and "answering again" is a second line when it is back.
"""

from __future__ import annotations

import time
import urllib.parse
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from kvchat.cache.block_backend import ReadResult, ReadStatus, StoreStats
from kvchat.cache.block_file import BlockFileError, BlockLayout
from kvchat.cache.block_keys import is_key
from kvchat.cache.write_queue import Queued, WriteQueue
from kvchat.errors import KvchatError

if TYPE_CHECKING:
    import torch

PREFIX = "kvchat:block:"
SCHEMES = ("redis://", "rediss://", "unix://", "valkey://", "valkeys://")
_KNOWN = 1 << 16  # keys remembered as stored (written or read): their puts cost nothing
_EVICTING = ("allkeys-lru", "allkeys-lfu", "allkeys-random")
_DOWN: Any = object()  # what `_ask` returns when the store did not answer


def is_store_url(text: str) -> bool:
    return text.startswith(SCHEMES)


def public_url(url: str) -> str:
    """The URL without its password, for messages."""
    parts = urllib.parse.urlsplit(url)
    if parts.password is None:
        return url
    host = parts.hostname or ""
    netloc = f"{parts.username or ''}:***@{host}" + (f":{parts.port}" if parts.port else "")
    return urllib.parse.urlunsplit(parts._replace(netloc=netloc))


class RedisStore:
    """The block tier on a Redis/Valkey server (see the module docstring). Thread-safe."""

    shared = True

    def __init__(self, url: str, layout: BlockLayout, budget_bytes: int, *,
                 timeout_s: float = 0.25, retry_s: float = 5.0,
                 max_pending_bytes: int = 64 << 20) -> None:
        try:
            import redis
        except ImportError:
            raise KvchatError("--store redis://... needs the redis package: pip install "
                              "redis.") from None
        self.url, self.layout, self.budget_bytes = url, layout, budget_bytes
        self.retry_s, self.max_pending_bytes = retry_s, max_pending_bytes
        self._errors: tuple[type[BaseException], ...] = (redis.exceptions.ConnectionError,
                                                         redis.exceptions.TimeoutError, OSError)
        self._refused = redis.exceptions.ResponseError
        self._client = redis.Redis.from_url(
            url.replace("valkey", "redis", 1), socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s, retry=None, health_check_interval=0)
        self._queue = WriteQueue(self._write, max_bytes=max_pending_bytes,
                                 name="kvchat-redis-store")
        self._cond = self._queue.cond
        self._counts = self._queue.counts
        self._count = self._queue.count
        self._known: OrderedDict[str, None] = OrderedDict()
        self._notices: list[str] = []
        self._down_until = 0.0
        self._down = False
        self._configured = False
        if self.enabled:
            self._queue.start()

    @property
    def enabled(self) -> bool:
        return self.budget_bytes > 0

    def describe(self) -> str:
        return public_url(self.url)

    def __enter__(self) -> RedisStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- talking to the server -----------------------------------------------------------

    def _ask(self, op: Callable[[], Any]) -> Any:
        """op's answer, or _DOWN when the store is resting after a failure or fails now."""
        if time.monotonic() < self._down_until:
            return _DOWN
        try:
            out = op()
        except self._errors as exc:
            self._down_until = time.monotonic() + self.retry_s
            if not self._down:
                self._down = True
                self._notice(f"Shared block store {self.describe()} is not answering ({exc}); "
                             f"going on from memory, trying again every {self.retry_s:g} s.")
            return _DOWN
        if self._down:
            self._down = False
            self._notice(f"Shared block store {self.describe()} is answering again.")
        return out

    def _notice(self, line: str) -> None:
        with self._cond:
            self._notices.append(line)

    def _remember(self, key: str) -> None:
        with self._cond:
            self._known[key] = None
            self._known.move_to_end(key)
            if len(self._known) > _KNOWN:
                self._known.popitem(last=False)

    def _configure(self) -> bool:
        """Hold the server to the budget (see the module docstring); False when down."""
        try:
            config = self._ask(lambda: self._client.config_get("maxmemory*"))
            if config is _DOWN:
                return False
            limit, policy = int(config.get("maxmemory", 0)), config.get("maxmemory-policy", "")
            if limit == 0:
                self._ask(lambda: self._client.config_set("maxmemory", self.budget_bytes))
                self._ask(lambda: self._client.config_set("maxmemory-policy", "allkeys-lru"))
            elif policy not in _EVICTING:
                self._notice(f"Shared block store {self.describe()} has maxmemory-policy "
                             f"{policy}: it never evicts, so blocks are dropped once it is full "
                             "(set maxmemory-policy allkeys-lru).")
        except self._refused as exc:  # CONFIG disabled: a managed server
            self._notice(f"Shared block store {self.describe()}: its memory limit could not be "
                         f"read or set ({exc}); set maxmemory and maxmemory-policy allkeys-lru "
                         "on the server.")
        self._configured = True
        return True

    # ---- the caller's side ---------------------------------------------------------------

    def put(self, key: str, tokens: Sequence[int],
            kv: Sequence[tuple[torch.Tensor, torch.Tensor]], wait: bool = True) -> bool:
        if not is_key(key):
            raise ValueError(f"not a block key: {key!r}")
        if not self.enabled or self.layout.payload_bytes > self.budget_bytes \
                or time.monotonic() < self._down_until:
            return False
        with self._cond:
            if key in self._known or key in self._queue or self._queue.stopping:
                return False
        return self._queue.add(Queued.of(key, tokens, kv, self.layout), wait)

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def batch_exists(self, keys: Sequence[str]) -> int:
        if not self.enabled or not keys:
            return 0
        with self._cond:
            queued = [k in self._queue for k in keys]
        pipe = self._client.pipeline(transaction=False)
        for k in keys:
            pipe.exists(PREFIX + k)
        found = self._ask(pipe.execute)
        if found is _DOWN:
            found = [0] * len(keys)
        return next((i for i, (q, f) in enumerate(zip(queued, found, strict=True))
                     if not (q or f)), len(keys))

    def get(self, key: str) -> ReadResult:
        from kvchat.cache.block_file import decode_block

        if not self.enabled or not is_key(key):
            return ReadResult(None, ReadStatus.MISSING)
        queued = self._queue.read(key)
        if queued is not None:
            return queued
        data = self._ask(lambda: self._client.get(PREFIX + key))
        if data is _DOWN or data is None:
            return ReadResult(None, ReadStatus.MISSING)
        try:
            block = decode_block(bytearray(data), key, self.layout)
        except BlockFileError as exc:
            self._ask(lambda: self._client.delete(PREFIX + key))
            with self._cond:
                self._counts["read_failures"] += 1
            return ReadResult(None, ReadStatus.CORRUPT, notice=f"Shared block {key[:12]} "
                              f"not used ({exc}); deleted from {self.describe()}.")
        self._remember(key)
        with self._cond:
            self._counts["reads"] += 1
        return ReadResult(block.kv, ReadStatus.HIT, block.tokens)

    def flush(self) -> None:
        self._queue.flush()

    def close(self) -> None:
        if not self._queue.running:
            return
        self._queue.close()  # flushes first
        self._client.close()

    def take_notices(self) -> list[str]:
        with self._cond:
            out, self._notices = self._notices, []
        return out

    def stats(self) -> StoreStats:
        """Counts of this instance's reads and writes; blocks and bytes are the server's (its
        database's keys and used memory), 0 while it does not answer."""
        info = self._ask(lambda: (self._client.dbsize(), self._client.info("memory")))
        blocks, used = (0, 0) if info is _DOWN else (int(info[0]), int(info[1]["used_memory"]))
        with self._cond:
            c = self._counts
            return StoreStats(blocks=blocks, bytes=used, budget_bytes=self.budget_bytes,
                              writes=c["writes"], reads=c["reads"],
                              read_failures=c["read_failures"],
                              write_failures=c["write_failures"], evictions=0,
                              pending=len(self._queue))

    # ---- the writer thread ---------------------------------------------------------------

    def _write(self, item: Queued) -> None:
        from kvchat.cache.block_file import encode_block

        if not self._configured and not self._configure():
            self._count("write_failures")
            return
        data = b"".join(bytes(p) for p in encode_block(item.key, item.tokens, self.layout,
                                                       item.kv))
        try:
            done = self._ask(lambda: self._client.set(PREFIX + item.key, data, nx=True))
        except self._refused as exc:  # e.g. OOM under a policy that never evicts
            self._count("write_failures")
            if not self._counts["refused"]:
                self._notice(f"Shared block store {self.describe()} refused a block ({exc}).")
            self._count("refused")
            return
        if done is _DOWN:
            self._count("write_failures")
            return
        self._remember(item.key)
        if done:
            self._count("writes")
