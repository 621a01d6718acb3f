"""Frozen, validated configuration objects shared by the cache, the engine and the CLI."""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from kvchat.errors import KvchatError

POLICY_ENV_VAR = "EVICTION_POLICY"
POLICY_NAMES = ("lru", "sink-lru", "h2o")
_POLICY_ALIASES = {"sinklru": "sink-lru", "sink_lru": "sink-lru", "sink": "sink-lru"}
# Here rather than in engine/ so that `--help` can quote it without importing torch.
H2O_COST_NOTE = (
    "h2o reads attention weights through eager attention (no fused kernel): `kvchat bench "
    "overhead` measured 1.34x the time to first token of a 512-token miss on a 2-core CPU."
)


class ConfigError(KvchatError):
    """A configuration value a user gave is out of range or unknown."""


def normalise_policy(name: str | None) -> str:
    """Policy name from an explicit argument, else `$EVICTION_POLICY`, else "lru"."""
    raw = name if name else os.environ.get(POLICY_ENV_VAR) or "lru"
    key = raw.strip().lower()
    key = _POLICY_ALIASES.get(key, key)
    if key not in POLICY_NAMES:
        source = "--policy" if name else f"${POLICY_ENV_VAR}"
        raise ConfigError(
            f"Unknown eviction policy {raw!r} (from {source}). "
            f"Valid policies: {', '.join(POLICY_NAMES)}."
        )
    return key


@dataclass(frozen=True)
class CacheConfig:
    """Shape and budget of the paged KV cache.

    The pool is sized either by an explicit `num_blocks` or by `cache_mb` (the K/V byte budget
    for all layers together); it is allocated once and never grows.
    """

    block_size: int = 16
    cache_mb: float = 1024.0
    num_blocks: int | None = None
    policy: str | None = None  # None: $EVICTION_POLICY, else lru
    max_exact_entries: int = 256
    max_pinned: float = 0.5  # the most of the pool pinned prefixes may hold

    def __post_init__(self) -> None:
        if not 1 <= self.block_size <= 4096:
            raise ConfigError(f"--block-size must be between 1 and 4096, got {self.block_size}.")
        if self.num_blocks is None and not self.cache_mb > 0:
            raise ConfigError(f"--cache-mb must be positive, got {self.cache_mb}.")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ConfigError(f"The pool needs at least one block, got {self.num_blocks}.")
        if self.max_exact_entries < 0:
            raise ConfigError("max_exact_entries must be >= 0.")
        if not 0.0 <= self.max_pinned <= 1.0:
            raise ConfigError(f"--max-pinned must be between 0 and 1 (a fraction of the pool), "
                              f"got {self.max_pinned}.")
        object.__setattr__(self, "policy", normalise_policy(self.policy))

    def blocks_for(self, bytes_per_token: int) -> int:
        """Number of blocks the budget buys, given the K/V bytes one token costs in all layers."""
        if self.num_blocks is not None:
            return self.num_blocks
        per_block = bytes_per_token * self.block_size
        return max(1, int(self.cache_mb * 1024 * 1024) // per_block)


# Below this a temperature overflows the softmax (logits / 1e-40 are inf); 0 means greedy.
MIN_TEMPERATURE = 1e-5
SEED_LIMIT = 2**64  # manual_seed overflows above 2**64 - 1 (and wraps negative seeds silently)


def _finite(name: str, value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ConfigError(f"{name} must be a finite number, got {value!r}.")
    return value


def _whole(name: str, value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{name} must be a whole number, got {value!r}.")
    return value


def check_fields(max_tokens: int | None = None, temperature: float | None = None,
                 top_p: float | None = None, top_k: int | None = None,
                 seed: int | None = None) -> None:
    """The rules for a request's sampling fields, the one set every entrance applies (CLI
    options, batch lines whether run here, on a kvchat server or on another engine, every HTTP
    route): None is "not given"; a value given is checked, and ConfigError names the field as a
    request spells it and, where it differs, the CLI option."""
    if max_tokens is not None and _whole("max_tokens / --max-tokens", max_tokens) < 1:
        raise ConfigError(f"max_tokens / --max-tokens must be at least 1, got {max_tokens}.")
    if temperature is not None:
        value = _finite("temperature", temperature)
        if value != 0 and not value >= MIN_TEMPERATURE:
            raise ConfigError(f"temperature must be 0 (greedy) or at least {MIN_TEMPERATURE:g}, "
                              f"got {value}.")
    if top_p is not None and not 0 < _finite("top_p / --top-p", top_p) <= 1:
        raise ConfigError(f"top_p / --top-p must be in (0, 1], got {top_p}.")
    if top_k is not None and _whole("top_k / --top-k", top_k) < 0:
        raise ConfigError(f"top_k / --top-k must be 0 (off) or more, got {top_k}.")
    if seed is not None and not 0 <= _whole("seed", seed) < SEED_LIMIT:
        raise ConfigError(f"seed must be from 0 to 2**64 - 1, got {seed}.")


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens. temperature == 0 means greedy.

    Values come from CLI options, batch files and HTTP bodies alike, so each error names the
    field as a request spells it and, where it differs, the CLI option."""

    max_new_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)
    ignore_eos: bool = False  # benchmarks: always decode max_new_tokens

    def __post_init__(self) -> None:
        _whole("max_tokens / --max-tokens", self.max_new_tokens)  # None is no value here
        _finite("temperature", self.temperature)
        check_fields(self.max_new_tokens, self.temperature, self.top_p, self.top_k, self.seed)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


# The bounds on every call to another server (see kvchat.client.bounds for why these values).
CONNECT_S = 10.0
IDLE_S = 120.0
TOTAL_S = 600.0
BOUND_OPTIONS = {"connect": "--connect-timeout", "idle": "--idle-timeout",
                 "total": "--request-timeout"}


@dataclass(frozen=True)
class Bounds:
    """How long a client waits on another server (None: that bound is off): for the connection,
    for the next byte of a reply (idle), and for a whole call (total)."""

    connect_s: float = CONNECT_S
    idle_s: float | None = IDLE_S
    total_s: float | None = TOTAL_S

    def __post_init__(self) -> None:
        for bound, value in (("connect", self.connect_s), ("idle", self.idle_s),
                             ("total", self.total_s)):
            if value is None and bound != "connect":
                continue
            if value is None or not (math.isfinite(value) and value > 0):
                off = "" if bound == "connect" else " (0 turns it off)"
                raise ConfigError(f"{BOUND_OPTIONS[bound]} takes a number of seconds above "
                                  f"0{off}, got {value}.")

    @classmethod
    def of_options(cls, connect_s: float, idle_s: float, total_s: float) -> Bounds:
        """From the command line, where 0 turns the idle or the overall bound off."""
        return cls(connect_s, idle_s or None, total_s or None)


def merge_params(
    defaults: SamplingParams,
    max_tokens: int | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    seed: int | None = None,
    stop: str | Sequence[str] | None = None,
) -> SamplingParams:
    """The defaults with what a request set (None: not set). Validated on creation."""
    given: dict[str, Any] = {
        "max_new_tokens": max_tokens, "temperature": temperature, "top_p": top_p,
        "top_k": top_k, "seed": seed,
    }
    if stop is not None:
        given["stop"] = (stop,) if isinstance(stop, str) else tuple(s for s in stop if s)
    return replace(defaults, **{k: v for k, v in given.items() if v is not None})
