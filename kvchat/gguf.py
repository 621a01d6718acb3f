"""GGUF files converted once into safetensors folders in the kvchat cache dir.

transformers needs ~15 s to de-quantize SmolLM2's GGUF and well under a second to load the
converted folder. A conversion writes to a temporary folder and renames it into place, so an
interrupted first run leaves nothing half-written behind.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import platformdirs

from kvchat.errors import ModelError

CACHE_ENV_VAR = "KVCHAT_CACHE_DIR"
SOURCE_RECORD = "kvchat-source.json"

# Temp conversion folders are named "<prefix><final name>.<pid>.<random>" so that a later run can
# tell a dead run's leftovers from a conversion another live process is doing right now.
_TMP_PREFIX = ".tmp-"

Converter = Callable[[Path, Path], None]


def cache_dir() -> Path:
    """$KVCHAT_CACHE_DIR if set, else the platform's user cache dir for kvchat."""
    override = os.environ.get(CACHE_ENV_VAR)
    return Path(override).expanduser() if override else Path(platformdirs.user_cache_dir("kvchat"))


def converted_dir_for(gguf: Path) -> Path:
    """The folder a GGUF converts into; a new or touched file converts afresh."""
    gguf = gguf.resolve()
    stat = gguf.stat()
    key = f"{stat.st_size}:{stat.st_mtime_ns}:{gguf}".encode()
    return cache_dir() / "models" / f"{gguf.stem}-{hashlib.sha256(key).hexdigest()[:10]}"


def ensure_converted(
    gguf: Path, converter: Converter | None = None, label: str | None = None
) -> Path:
    """Return the safetensors folder for `gguf`, converting it first if needed.

    The conversion writes into a temp folder beside the final one and renames it into place, so an
    interrupted run leaves no final folder, only a temp folder that the next run removes.
    """
    final = converted_dir_for(gguf)
    if _is_complete(final):
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temp_dirs(final.parent)
    if final.exists():
        # Not written by a completed rename (that always carries config.json): never usable.
        shutil.rmtree(final)
    convert = converter if converter is not None else convert_gguf
    prefix = f"{_TMP_PREFIX}{final.name}.{os.getpid()}."
    tmp = Path(tempfile.mkdtemp(prefix=prefix, dir=final.parent))
    try:
        name = label or gguf.stem
        with _status(f"Converting {name} GGUF to safetensors (first run only, ~15 s)…"):
            convert(gguf, tmp)
        _write_source_record(tmp, gguf)
        try:
            os.replace(tmp, final)
        except OSError:
            # Another process finished the same conversion first; its folder is as good as ours.
            if not _is_complete(final):
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def convert_gguf(gguf: Path, out_dir: Path) -> None:
    """De-quantize `gguf` into a float32 safetensors folder with its tokenizer and chat template."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs: dict[str, Any] = {}
    try:
        from transformers import GgufConfig

        # Dense weights are what save_pretrained can write; without this, transformers keeps them
        # packed whenever a GGUF matmul kernel happens to be installed.
        kwargs["quantization_config"] = GgufConfig(dequantize=True)
    except ImportError:
        pass
    # Some of transformers' GGUF and saving progress bars bypass its logging switches.
    with quiet_transformers(), contextlib.redirect_stderr(io.StringIO()):
        model = AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, dtype=torch.float32, local_files_only=True, **kwargs
        )
        tokenizer = AutoTokenizer.from_pretrained(
            gguf.parent, gguf_file=gguf.name, local_files_only=True
        )
        quantizer = getattr(model, "hf_quantizer", None)
        if quantizer is not None:
            quantizer.remove_quantization_config(model)
        model.save_pretrained(out_dir)
        tokenizer.save_pretrained(out_dir)
    template = getattr(tokenizer, "chat_template", None)
    if template:
        with quiet_transformers():
            saved = AutoTokenizer.from_pretrained(out_dir, local_files_only=True)
        if saved.chat_template != template:
            raise ModelError(
                f"Converting {gguf.name} lost its chat template: the saved tokenizer in {out_dir} "
                "does not reload it. Please report this with your transformers version."
            )


def remove_stale_temp_dirs(folder: Path) -> list[Path]:
    """Delete temp conversion folders whose process is gone; return what was removed."""
    removed = []
    for entry in folder.glob(f"{_TMP_PREFIX}*"):
        parts = entry.name.rsplit(".", 2)
        pid = int(parts[1]) if len(parts) == 3 and parts[1].isdigit() else 0
        if entry.is_dir() and not _pid_alive(pid):
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry)
    return removed


def _pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        # PermissionError: alive but someone else's. Anything else: do not delete on a guess.
        return True
    return True


def _is_complete(folder: Path) -> bool:
    return (folder / "config.json").is_file()


def _write_source_record(folder: Path, gguf: Path) -> None:
    stat = gguf.stat()
    record = {"gguf": str(gguf.resolve()), "bytes": stat.st_size, "mtime_ns": stat.st_mtime_ns}
    (folder / SOURCE_RECORD).write_text(json.dumps(record, indent=2) + "\n")


@contextlib.contextmanager
def _status(message: str) -> Iterator[None]:
    from rich.console import Console

    with Console(stderr=True).status(message):
        yield


@contextlib.contextmanager
def quiet_transformers() -> Iterator[None]:
    """No progress bars or info chatter from transformers while kvchat owns the terminal."""
    from transformers.utils import logging as hf_logging

    bars = hf_logging.is_progress_bar_enabled()
    verbosity = hf_logging.get_verbosity()
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()


# --- dtype and device -----------------------------------------------------------------------
