"""The long-lived pieces every command shares: the engine (model + shared cache) + sessions dir.

`Runtime.open` loads the model, sizes the pool, opens the disk tier (a BlockStore in
<sessions>/cache/store, or --store) and rebuilds the cache's tree from its index when the
fingerprint (model, config, tokenizer, dtype, block size, the weights' bytes, the code that
computes with them and the forward) matches: blocks stay on disk until first hit. `save`
writes the new blocks and the index; `close` flushes and stops the tier.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import time
from collections.abc import Callable
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
    persist: bool = True  # load and save the cache under sessions_dir/cache
    disk_cache_gb: float = 10.0  # the disk tier's budget; 0: evicted blocks are dropped
    store_dir: Path | None = None  # the disk tier's folder (default: sessions_dir/cache/store)
    store_url: str | None = None  # redis://host:port/db: the tier on Redis/Valkey instead
    shared_store: bool = False  # other instances use the store folder too (`shared_tier`)
    chat_template: str | None = None  # --chat-template (None: the model's own, if any)
    compile: bool = False  # --compile: decode steps through torch.compile

    def __post_init__(self) -> None:
        import math

        if not (math.isfinite(self.disk_cache_gb) and self.disk_cache_gb >= 0):
            raise KvchatError(f"--disk-cache-gb must be 0 (off) or more, got "
                              f"{self.disk_cache_gb}.")

    @property
    def disk_budget_bytes(self) -> int:
        return int(self.disk_cache_gb * (1 << 30)) if self.persist else 0

    @property
    def store_path(self) -> Path:
        return self.store_dir or self.sessions_dir / "cache" / "store"


def _digest(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


def numerics() -> str:
    """A digest of what decides the bits a forward computes, beside the model and its
    precision: kvchat's model and engine code (Python and C), the native library's build (its
    name holds the digest of its sources, compiler and flags) and the torch and transformers
    versions, and the CPU capability torch's own kernels dispatch on. K/V and logits stored
    under other numerics would not be what this process computes for the same prompt, so a hit
    on them could change an answer."""
    import torch
    import transformers

    from kvchat.models import native

    root = Path(__file__).resolve().parent
    digest = hashlib.sha256()
    for path in sorted([*(root / "models").iterdir(), *(root / "engine").iterdir()]):
        # sources only: not an editor's lock or backup file beside them
        if path.suffix in (".py", ".c", ".h") and not path.name.startswith(".") \
                and path.is_file():
            digest.update(path.name.encode() + b"\0" + path.read_bytes())
    lib = native.library()
    built = Path(lib._name).name if lib is not None else "no native library"
    digest.update(f"{built}|{torch.__version__}|{transformers.__version__}|"
                  f"{torch.backends.cpu.get_cpu_capability()}".encode())
    return digest.hexdigest()[:16]


def weights_digest(loaded: Any) -> str:
    """A digest of the weights' bytes, as `gguf_sample` reads a file (its head and spaced
    windows): the GGUF, or each weight file of a folder; a hub model's commit. The same name
    and config with other weights (a re-quantized or fine-tuned file written over the old
    one) must not hit the K/V the old weights made."""
    from kvchat.models.gguf import gguf_sample

    source = loaded.source
    if source.is_gguf:
        return gguf_sample(Path(source.location))
    folder = loaded.folder
    if folder is None:
        return str(getattr(loaded.model.config, "_commit_hash", "") or "")
    files = sorted(p for p in Path(folder).iterdir() if p.is_file()
                   and p.suffix in (".safetensors", ".bin", ".pt", ".pth", ".gguf"))
    return _digest([[p.name, gguf_sample(p, _head_of(p))] for p in files])


def _head_of(path: Path) -> int:
    """How many leading bytes of a weight file to hash whole: a safetensors file's header (its
    tensor table), 1 MiB of a pickled one, the default (16 MiB) of a GGUF. A folder of 30
    shards then reads a few MiB, not half a gigabyte."""
    from kvchat.models.gguf import SAMPLE_HEAD

    if path.suffix == ".gguf":
        return SAMPLE_HEAD
    if path.suffix == ".safetensors":
        try:
            with open(path, "rb") as fh:
                size = int.from_bytes(fh.read(8), "little")
        except OSError:
            return SAMPLE_HEAD
        return min(8 + size, SAMPLE_HEAD)
    return 1 << 20


def fingerprint(engine: Engine, model_label: str, weights: str = "") -> dict[str, Any]:
    """What must be equal for stored K/V to be valid: same weights' architecture and config,
    same tokenizer, same precision (int4 K/V differ from bfloat16 ones), same block size, the
    same weights (`weights_digest`), the same numerics (`numerics`) and the same forward (its
    device, attention, residual stream and whether steps are compiled: K/V an H2O, compiled or
    GPU forward wrote are not what a batch-invariant CPU forward computes)."""
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
        "tokenizer": _tokenizer_digest(tok),
        "dtype": engine.runner.precision,
        "block_size": engine.cache.block_size,
        "weights": weights,
        "numerics": numerics(),
        "forward": _forward_of(engine),
    }


def _tokenizer_digest(tokenizer: Any) -> str:
    """A digest of the vocabulary (every id's token, read in chunks: `vocabulary`) and the
    chat template."""
    from kvchat.engine.codec import vocabulary

    digest = hashlib.sha256()
    for chunk in vocabulary(tokenizer):
        digest.update(json.dumps(chunk).encode())
    digest.update(json.dumps(getattr(tokenizer, "chat_template", ""), sort_keys=True,
                             default=str).encode())
    return digest.hexdigest()[:16]


def _forward_of(engine: Engine) -> str:
    plan = engine.runner.plan
    return (f"{plan.device}|{plan.family}|{plan.compute}|{plan.residual}|{plan.attention}|"
            f"{'compiled' if plan.compiled else 'eager'}")


def tokenizer_file(tokenizer: Any) -> str | None:
    """tokenizer.json of a local model folder, for `kvchat inspect` to decode previews."""
    folder = getattr(tokenizer, "name_or_path", "") or ""
    path = Path(folder) / "tokenizer.json"
    return str(path.resolve()) if path.exists() else None


def template_fields(codec: Any) -> dict[str, Any]:
    """The chat template in use (None: kvchat's plain-text format, with the text the tokenizer
    starts a prompt with) and the special tokens it may read (bos_token, eos_token...), for
    `kvchat inspect --explain` to render a prompt as `kvchat chat` would, without transformers."""
    tokens = getattr(codec.tokenizer, "special_tokens_map", None) or {}
    return {"chat_template": codec.template, "plain_start": codec.start_text,
            "special_tokens": {k: v for k, v in tokens.items() if isinstance(v, str)}}


def compile_decode(engine: Engine) -> None:
    """--compile: compile the engine's decode step now (torch keeps what it compiled on disk,
    so a later start with the same model and shapes is faster)."""
    engine.runner.compile_decode()
    engine.warm_up()


Stage = Callable[[str, str], None]  # (the stage's name, what it does), as each stage begins


def _no_stage(name: str, what: str) -> None:
    return None


class Runtime:
    def __init__(self, engine: Engine, options: RuntimeOptions, model_label: str,
                 weights: str = "") -> None:
        self.engine = engine
        self.options = options
        self.model_label = model_label
        self.store = SessionStore(options.sessions_dir)
        self.notice: str | None = None  # set when a snapshot was set aside
        self.restored_tokens = 0
        self.last_save: float | None = None
        # once per process: it digests the whole vocabulary
        self._fingerprint = fingerprint(engine, model_label, weights) if engine.cache else {}
        self.disk = self._open_disk_tier()

    @property
    def fingerprint(self) -> dict[str, Any]:
        """The model's `fingerprint` (empty without a cache), computed once when the runtime
        opened: what the snapshot, the server's /cache documents and the batch-size key use."""
        return dict(self._fingerprint)

    def _open_disk_tier(self) -> Any:
        """The BlockBackend evicted blocks spill to (None: no tier), given to the cache: a
        BlockStore folder, or a RedisStore."""
        if self.cache is None or not self.options.disk_budget_bytes:
            return None
        from kvchat.cache.block_file import BlockLayout
        from kvchat.cache.block_store import BlockStore
        from kvchat.cache.redis_store import RedisStore
        from kvchat.sessions import SessionWriteError

        layout, budget = BlockLayout.of(self.cache.manager), self.options.disk_budget_bytes
        try:
            store: Any = (RedisStore(self.options.store_url, layout, budget)
                          if self.options.store_url else
                          BlockStore(self.options.store_path, layout, budget,
                                     shared=self.options.shared_store))
        except (OSError, SessionWriteError) as exc:
            self.notice = f"Disk cache tier off: {exc}"
            return None
        self.cache.use_store(store, self._fingerprint)
        atexit.register(store.close)  # queued blocks reach the disk even without close()
        return store

    def take_notices(self) -> list[str]:
        """One-line notices of the disk tier (blocks found damaged or missing), each once."""
        return self.cache.take_notices() if self.cache is not None else []

    def close(self) -> None:
        """Write what the disk tier still has queued and stop its thread (idempotent)."""
        if self.disk is not None:
            self.disk.close()

    @classmethod
    def open(cls, options: RuntimeOptions, on_stage: Stage = _no_stage) -> Runtime:
        """The runtime of `options`; `on_stage` hears each stage as it begins (load, compile,
        restore), so that a command can say what its start waits on."""
        from kvchat.models.loading import load_model

        on_stage("load", f"loading {options.model or 'the default model'}")
        loaded = load_model(options.model, dtype=options.dtype, device=options.device,
                            cache=options.cache)
        engine = Engine.create(loaded.model, loaded.tokenizer, options.cache,
                               batch_size=options.batch_size, prefill_chunk=options.prefill_chunk)
        if options.chat_template is not None:
            from kvchat.models.chat_template import resolve

            # the tokenizer is left as it is: the fingerprint (and the cache) stay the model's
            engine.codec.use_template(resolve(options.chat_template, loaded.tokenizer))
        if options.compile:
            on_stage("compile", "compiling the decode step (--compile; a minute or two the "
                     "first time, less once torch has it on disk)")
            compile_decode(engine)
        if options.persist:
            on_stage("restore", "restoring the cache snapshot")
        runtime = cls(engine, options, loaded.source.description, weights_digest(loaded))
        runtime.restore()
        return runtime

    @property
    def cache(self) -> Any:
        return self.engine.cache

    def restore(self) -> None:
        if not self.options.persist or self.cache is None or self.disk is None:
            return
        try:
            outcome = load_snapshot(self.options.sessions_dir, self.cache, self._fingerprint)
        except KvchatError as exc:  # e.g. a damaged snapshot that a read-only dir cannot move
            self.notice = f"Cache snapshot not loaded, starting empty: {exc}"
            return
        self.notice = outcome.notice
        self.restored_tokens = outcome.cached_tokens

    def save(self) -> Path | None:
        if not self.options.persist or self.cache is None or self.disk is None:
            return None
        pool = self.cache.manager.stats()
        extra = {"tokenizer_file": tokenizer_file(self.engine.codec.tokenizer),
                 "model_label": self.model_label,
                 **template_fields(self.engine.codec),
                 "store_dir": self.options.store_url and self.disk.describe()
                 or str(self.options.store_path.resolve()),
                 # the pool's size is not in the blocks list; `kvchat inspect` shows occupancy
                 "pool": {"total_blocks": pool.total_blocks,
                          "bytes_per_block": pool.bytes_per_block}}
        path = save_snapshot(self.options.sessions_dir, self.cache, self._fingerprint, extra)
        self.last_save = time.time()
        return path
