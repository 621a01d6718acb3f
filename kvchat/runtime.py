"""The long-lived pieces every command shares: model + backend + shared cache + sessions dir.

`Runtime.open` loads the model, sizes the pool, and restores the cache snapshot when its
fingerprint (model, config, tokenizer, dtype, block size) matches; `save` writes it back.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvchat.config import CacheConfig, SamplingParams
from kvchat.engine.backend import Backend, Generation, Request
from kvchat.sessions import Session, SessionStore, load_snapshot, save_snapshot
from kvchat.turns import next_prompt


@dataclass(frozen=True)
class RuntimeOptions:
    model: str | None = None
    dtype: str | None = None
    device: str | None = "auto"
    cache: CacheConfig = field(default_factory=CacheConfig)
    prefill_chunk: int = 512
    sessions_dir: Path = Path("sessions")
    persist: bool = True  # load and save the snapshot under sessions_dir/cache


def _digest(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


def fingerprint(backend: Backend, model_label: str) -> dict[str, Any]:
    """What must be equal for stored K/V to be valid: same weights' architecture and config,
    same tokenizer, same dtype, same block size."""
    config = backend.model.config.to_dict()
    for volatile in ("transformers_version", "_name_or_path", "_attn_implementation_autoset",
                     "_attn_implementation", "torch_dtype", "dtype", "use_cache"):
        config.pop(volatile, None)
    tok = backend.tokenizer
    assert backend.cache is not None
    return {
        "model": model_label,
        "config": _digest(config),
        "tokenizer": _digest([sorted(tok.get_vocab().items()), getattr(tok, "chat_template", "")]),
        "dtype": str(next(backend.model.parameters()).dtype).replace("torch.", ""),
        "block_size": backend.cache.block_size,
    }


def tokenizer_file(tokenizer: Any) -> str | None:
    """tokenizer.json of a local model folder, for `kvchat inspect` to decode previews."""
    folder = getattr(tokenizer, "name_or_path", "") or ""
    path = Path(folder) / "tokenizer.json"
    return str(path.resolve()) if path.exists() else None


class Runtime:
    def __init__(self, backend: Backend, options: RuntimeOptions, model_label: str) -> None:
        self.backend = backend
        self.options = options
        self.model_label = model_label
        self.store = SessionStore(options.sessions_dir)
        self.notice: str | None = None  # set when a snapshot was set aside
        self.restored_tokens = 0
        self.last_save: float | None = None
        self._fingerprint = fingerprint(backend, model_label) if backend.cache else {}

    @classmethod
    def open(cls, options: RuntimeOptions) -> Runtime:
        from kvchat.models import load_model

        loaded = load_model(options.model, dtype=options.dtype, device=options.device)
        backend = Backend.create(
            loaded.model, loaded.tokenizer, options.cache, prefill_chunk=options.prefill_chunk
        )
        runtime = cls(backend, options, loaded.source.description)
        runtime.restore()
        return runtime

    @property
    def cache(self) -> Any:
        return self.backend.cache

    def restore(self) -> None:
        if not self.options.persist or self.cache is None:
            return
        outcome = load_snapshot(self.options.sessions_dir, self.cache, self._fingerprint)
        self.notice = outcome.notice
        self.restored_tokens = outcome.cached_tokens

    def save(self) -> Path | None:
        if not self.options.persist or self.cache is None:
            return None
        pool = self.cache.manager.stats()
        extra = {"tokenizer_file": tokenizer_file(self.backend.tokenizer),
                 "model_label": self.model_label,
                 # the pool's size is not in the blocks list; `kvchat inspect` shows occupancy
                 "pool": {"total_blocks": pool.total_blocks,
                          "bytes_per_block": pool.bytes_per_block}}
        path = save_snapshot(self.options.sessions_dir, self.cache, self._fingerprint, extra)
        self.last_save = time.time()
        return path

    def start_turn(
        self,
        session: Session,
        user_text: str,
        params: SamplingParams,
        cancel: threading.Event | None = None,
    ) -> tuple[list[int], Generation]:
        """Admit the next chat turn of a session; iterate the generation to run it."""
        prompt = next_prompt(self.backend, session, user_text)
        request = Request(prompt, params, sid=session.name)
        return prompt, self.backend.start(request, cancel)
