"""The long-lived pieces every command shares: the engine (model + shared cache) + sessions dir.

`Runtime.open` loads the model, sizes the pool, and restores the cache snapshot when its
fingerprint (model, config, tokenizer, dtype, block size) matches; `save` writes it back.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvchat.config import CacheConfig
from kvchat.engine.engine import Engine
from kvchat.errors import KvchatError
from kvchat.sessions import SessionStore
from kvchat.snapshots import load_snapshot, save_snapshot


@dataclass(frozen=True)
class RuntimeOptions:
    model: str | None = None
    dtype: str | None = None
    device: str | None = "auto"
    cache: CacheConfig = field(default_factory=CacheConfig)
    prefill_chunk: int = 512
    batch_size: int = 8  # sequences decoded together
    sessions_dir: Path = Path("sessions")
    persist: bool = True  # load and save the snapshot under sessions_dir/cache


def _digest(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


def fingerprint(engine: Engine, model_label: str) -> dict[str, Any]:
    """What must be equal for stored K/V to be valid: same weights' architecture and config,
    same tokenizer, same dtype, same block size."""
    model = engine.runner.model
    config = model.config.to_dict()
    for volatile in ("transformers_version", "_name_or_path", "_attn_implementation_autoset",
                     "_attn_implementation", "torch_dtype", "dtype", "use_cache"):
        config.pop(volatile, None)
    tok = engine.codec.tokenizer
    assert engine.cache is not None
    return {
        "model": model_label,
        "config": _digest(config),
        "tokenizer": _digest([sorted(tok.get_vocab().items()), getattr(tok, "chat_template", "")]),
        "dtype": str(engine.runner.dtype).replace("torch.", ""),
        "block_size": engine.cache.block_size,
    }


def tokenizer_file(tokenizer: Any) -> str | None:
    """tokenizer.json of a local model folder, for `kvchat inspect` to decode previews."""
    folder = getattr(tokenizer, "name_or_path", "") or ""
    path = Path(folder) / "tokenizer.json"
    return str(path.resolve()) if path.exists() else None


class Runtime:
    def __init__(self, engine: Engine, options: RuntimeOptions, model_label: str) -> None:
        self.engine = engine
        self.options = options
        self.model_label = model_label
        self.store = SessionStore(options.sessions_dir)
        self.notice: str | None = None  # set when a snapshot was set aside
        self.restored_tokens = 0
        self.last_save: float | None = None
        self._fingerprint = fingerprint(engine, model_label) if engine.cache else {}

    @classmethod
    def open(cls, options: RuntimeOptions) -> Runtime:
        from kvchat.models import load_model

        loaded = load_model(options.model, dtype=options.dtype, device=options.device)
        engine = Engine.create(loaded.model, loaded.tokenizer, options.cache,
                               batch_size=options.batch_size, prefill_chunk=options.prefill_chunk)
        runtime = cls(engine, options, loaded.source.description)
        runtime.restore()
        return runtime

    @property
    def cache(self) -> Any:
        return self.engine.cache

    def restore(self) -> None:
        if not self.options.persist or self.cache is None:
            return
        try:
            outcome = load_snapshot(self.options.sessions_dir, self.cache, self._fingerprint)
        except KvchatError as exc:  # e.g. a damaged snapshot that a read-only dir cannot move
            self.notice = f"Cache snapshot not loaded, starting empty: {exc}"
            return
        self.notice = outcome.notice
        self.restored_tokens = outcome.cached_tokens

    def save(self) -> Path | None:
        if not self.options.persist or self.cache is None:
            return None
        pool = self.cache.manager.stats()
        extra = {"tokenizer_file": tokenizer_file(self.engine.codec.tokenizer),
                 "model_label": self.model_label,
                 # the pool's size is not in the blocks list; `kvchat inspect` shows occupancy
                 "pool": {"total_blocks": pool.total_blocks,
                          "bytes_per_block": pool.bytes_per_block}}
        path = save_snapshot(self.options.sessions_dir, self.cache, self._fingerprint, extra)
        self.last_save = time.time()
        return path
