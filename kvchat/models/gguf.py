"""A GGUF's config, tokenizer and chat template, written once into a folder in the kvchat cache
dir; its weights stay in the GGUF and load from it (`kvchat.models.gguf_weights`).

A conversion reads the file's metadata only (transformers' GGUF reader: the architectures it
knows, any quantization gguf-py reads), shows a spinner with the time it has taken, writes to a
temporary folder and renames it into place, so an interrupted first run leaves nothing
half-written behind; one that fails is one paragraph.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import io
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import platformdirs

from kvchat.errors import KvchatError, ModelError

CACHE_ENV_VAR = "KVCHAT_CACHE_DIR"
SOURCE_RECORD = "kvchat-source.json"
# What a converted folder holds: 2, the config and tokenizer only (the weights stay in the GGUF)
FOLDER_FORMAT = 2

# Reading a GGUF's metadata and writing its tokenizer: importing transformers and building the
# tokenizer from its vocabulary are most of it, the file's size little. On a 2-core Xeon, in a
# fresh process: SmolLM2's 98 MB 3.4 s, a Llama 1B-shaped 803 MB 4.2 s, a Qwen2.5 3B-shaped
# 1.9 GB 3.3 s, Gemma 3 270M's 253 MB (a 262k-token vocabulary) 6.6 s. A range goes around it.
BASE_SECONDS, SECONDS_PER_MB = 3.0, 0.002

# Temp conversion folders are named "<prefix><final name>.<pid>.<random>" so that a later run can
# tell a dead run's leftovers from a conversion another live process is doing right now.
_TMP_PREFIX = ".tmp-"

Converter = Callable[[Path, Path], None]


def cache_dir() -> Path:
    """$KVCHAT_CACHE_DIR if set, else the platform's user cache dir for kvchat."""
    override = os.environ.get(CACHE_ENV_VAR)
    return Path(override).expanduser() if override else Path(platformdirs.user_cache_dir("kvchat"))


# `gguf_sample`: the header's bytes (1.7-6.2 MiB in the files tried, a 262k-token vocabulary
# the largest), then windows spread over the rest
SAMPLE_HEAD, SAMPLE_WINDOWS, SAMPLE_BYTES = 16 << 20, 64, 4096


def gguf_sample(path: Path, head: int = SAMPLE_HEAD) -> str:
    """A digest of a GGUF's first `SAMPLE_HEAD` bytes (its whole header in every file tried:
    the metadata, the tokenizer's vocabulary among it, and the tensor table) and of
    `SAMPLE_WINDOWS` windows of `SAMPLE_BYTES` at evenly spaced offsets: 16 MiB read at most,
    where a whole 2 GB file would take seconds to hash. A same-size rewrite changes it unless
    it keeps the header and every sampled byte as they were. Computed once per version of the
    file in a process (its ctime moves with any write, and with a set mtime). `head`: the
    leading bytes read whole, for a file whose header is shorter (a safetensors shard's)."""
    stat = path.stat()
    return _sample(str(path.resolve()), stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns,
                   stat.st_ino, head)


@functools.lru_cache(maxsize=64)
def _sample(path: str, size: int, mtime_ns: int, ctime_ns: int, inode: int, head: int) -> str:
    digest = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as fh:
        digest.update(fh.read(head))
        for i in range(SAMPLE_WINDOWS):
            fh.seek(size * i // SAMPLE_WINDOWS)
            digest.update(fh.read(SAMPLE_BYTES))
    return digest.hexdigest()


def converted_dir_for(gguf: Path) -> Path:
    """The folder a GGUF converts into; a new or touched file converts afresh (a rewritten one
    into the same folder: `_is_complete`)."""
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
    if _is_complete(final, gguf):
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
        with spinner(f"Reading {name} GGUF's config and tokenizer, first run only "
                     f"({estimate(gguf.stat().st_size)} on a laptop CPU)…"):
            _converting(convert, gguf, tmp)
        _write_source_record(tmp, gguf)
        try:
            os.replace(tmp, final)
        except OSError:
            # Another process finished the same conversion first; its folder is as good as ours.
            if not _is_complete(final, gguf):
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def estimate(n_bytes: int) -> str:
    """How long a conversion of a GGUF this size takes, as a range: it depends on the CPU, the
    quantization and the vocabulary as much as on the size."""
    seconds = BASE_SECONDS + n_bytes / 1e6 * SECONDS_PER_MB
    low, high = seconds * 0.6, seconds * 1.6
    if high <= 10:
        span = "a few seconds"
    elif high < 180:
        span = f"about {max(5, round(low / 5) * 5)}–{round(high / 5) * 5} s"
    else:
        span = f"about {max(1, round(low / 60))}–{round(high / 60)} min"
    mb = n_bytes / 1e6
    return f"{mb:,.1f} MB: {span}" if mb < 10 else f"{mb:,.0f} MB: {span}"


def _converting(convert: Converter, gguf: Path, out_dir: Path) -> None:
    """Run the conversion; what transformers or gguf-py raise becomes one paragraph."""
    try:
        convert(gguf, out_dir)
    except (KvchatError, KeyboardInterrupt):
        raise
    except Exception as exc:
        detail = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ModelError(
            f"Could not convert {gguf.name} into a model folder: transformers could not read it "
            f"({type(exc).__name__}: {detail}). kvchat converts the GGUF files transformers "
            "reads: the architectures it supports (Llama, Mistral, Qwen2/3, Gemma 2/3, Phi-3, "
            "GPT-2, Falcon, StableLM, ...) in any quantization gguf-py decodes (F32, F16, BF16, "
            "Q8_0, Q4_0/1, Q5_0/1, Q2_K-Q6_K, IQ*). A file from another tool may need a newer "
            "transformers; a Hugging Face model folder works too (--model FOLDER)."
        ) from exc


def convert_gguf(gguf: Path, out_dir: Path) -> None:
    """Write `gguf`'s config, tokenizer and chat template as a model folder, from the file's
    metadata alone: the weights stay in the GGUF and are loaded from it, one tensor at a time
    (`kvchat.models.gguf_weights`)."""
    from transformers import AutoConfig, AutoTokenizer

    from kvchat.models.gguf_metadata import fast_config_reads

    # Some of transformers' GGUF progress bars bypass its logging switches.
    with quiet_transformers(), contextlib.redirect_stderr(io.StringIO()), fast_config_reads():
        config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                            local_files_only=True)
        tokenizer = AutoTokenizer.from_pretrained(
            gguf.parent, gguf_file=gguf.name, local_files_only=True
        )
        config.save_pretrained(out_dir)
        tokenizer.save_pretrained(out_dir)
    template = getattr(tokenizer, "chat_template", None)
    if template:
        with quiet_transformers():
            saved = load_tokenizer(out_dir)
        if saved.chat_template != template:
            raise ModelError(
                f"Converting {gguf.name} lost its chat template: the saved tokenizer in {out_dir} "
                "does not reload it. Please report this with your transformers version."
            )


def load_tokenizer(folder: Path) -> Any:
    """The tokenizer `convert_gguf` saved in `folder`, read as the file it is.

    AutoTokenizer would build the class the config names (GemmaTokenizer), which parses the
    vocabulary and merges in Python, rebuilds the backend from them and keeps both: Gemma 3's
    262,144 tokens and 514,906 merges held 260 MiB more after the load, 460 MiB at its peak.
    Where the saved tokenizer.json is that class's whole pipeline (`_READ_AS_SAVED`), the
    generic class reading it in Rust encodes and decodes the same. Where the class puts its own
    normalizer, pre-tokenizer and decoder on the file's vocabulary and merges
    (`_PIPELINE_OF_CLASS`: Qwen2's adds NFC and its own split pattern), those three are taken
    from the class built on its default one-token vocabulary and set on the file read in Rust,
    where the class's BPE model is the file's in all but its vocabulary and merges (on the
    Qwen2.5 0.5B shape's 151,936 tokens and 48,900 merges: 46 MiB held instead of 65, 0.3 s
    instead of 0.8).
    Other classes load as transformers builds them. The added tokens are passed in, read from
    the file's head (`_added_tokens`), so transformers does not parse the whole file in Python
    to find them."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    name = _named_class(folder)
    if name not in _READ_AS_SAVED and name not in _PIPELINE_OF_CLASS:
        return AutoTokenizer.from_pretrained(folder, local_files_only=True)
    added = _added_tokens(folder / "tokenizer.json")
    extra: dict[str, Any] = {} if added is None else {"added_tokens_decoder": added}
    side = _padding_side(folder)
    if side is not None:  # GemmaTokenizer pads on the left: the class's own default kept
        extra["padding_side"] = side
    tokenizer = PreTrainedTokenizerFast.from_pretrained(folder, local_files_only=True, **extra)
    if name in _PIPELINE_OF_CLASS and not _set_class_pipeline(tokenizer.backend_tokenizer, name,
                                                              folder):
        return AutoTokenizer.from_pretrained(folder, local_files_only=True)
    return tokenizer


# the classes whose own pipeline is the saved tokenizer.json's (compared on GGUFs of each)
_READ_AS_SAVED = frozenset({"TokenizersBackend", "PreTrainedTokenizerFast", "GemmaTokenizer",
                            "GPT2Tokenizer"})
# the classes that build their normalizer, pre-tokenizer and decoder in __init__ whatever the
# file says, from nothing but these tokenizer_config.json options (compared on GGUFs of each)
_PIPELINE_OF_CLASS: dict[str, tuple[str, ...]] = {"Qwen2Tokenizer": ("add_prefix_space",)}


def _set_class_pipeline(backend: Any, name: str, folder: Path) -> bool:
    """Give `backend` (the file's vocabulary and merges, read in Rust) the normalizer,
    pre-tokenizer and decoder that class `name` builds with the options `folder`'s
    tokenizer_config.json gives it; False, `backend` untouched, where the class's model would
    not be the file's in all but its vocabulary and merges (another type, or other options)."""
    from transformers.models.auto.tokenization_auto import tokenizer_class_from_name

    config = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
    named = tokenizer_class_from_name(name)
    if named is None:
        raise ModelError(f"transformers has no tokenizer class {name}, which {folder} names")
    chosen = {key: config[key] for key in _PIPELINE_OF_CLASS[name]
              if config.get(key) is not None}
    own = named(**chosen).backend_tokenizer  # on its default vocabulary of one token
    if type(own.model) is not type(backend.model) or any(
            getattr(own.model, option, None) != getattr(backend.model, option, None)
            for option in _MODEL_OPTIONS):
        return False
    backend.normalizer, backend.pre_tokenizer, backend.decoder = \
        own.normalizer, own.pre_tokenizer, own.decoder
    return True


# a BPE model's options besides its vocabulary and merges (`tokenizers.models.BPE`'s)
_MODEL_OPTIONS = ("dropout", "unk_token", "continuing_subword_prefix", "end_of_word_suffix",
                  "fuse_unk", "byte_fallback", "ignore_merges")


def _named_class(folder: Path) -> str | None:
    try:
        name = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8")) \
            .get("tokenizer_class")
    except (OSError, ValueError, AttributeError):
        return None
    return name if isinstance(name, str) else None


def _padding_side(folder: Path) -> str | None:
    """The padding side of the tokenizer class `folder`'s config names, if it sets one."""
    from transformers.models.auto.tokenization_auto import tokenizer_class_from_name

    try:
        name = _named_class(folder)
        named = tokenizer_class_from_name(name) if name is not None else None
    except (OSError, ValueError, ImportError):
        return None
    side = getattr(named, "padding_side", None)
    return side if isinstance(side, str) else None


# tokenizer.json's added tokens are read from its first bytes: this many, then twice as many
# each time the list runs on past them, up to the most
_ADDED_TOKENS_FIRST_READ = 1 << 20
_ADDED_TOKENS_READ_MAX = 64 << 20


def _added_tokens(path: Path) -> dict[int, dict[str, Any]] | None:
    """tokenizer.json's "added_tokens" (the `tokenizers` library writes them fourth, after
    "version", "truncation" and "padding"), as `added_tokens_decoder` takes them; None where
    the file does not begin so, or the list is not of {"id", "content", ...} entries."""
    head, size = b"", _ADDED_TOKENS_FIRST_READ
    try:
        with open(path, "rb") as fh:
            while True:
                chunk = fh.read(size - len(head))
                head += chunk
                entries = _added_tokens_list(head.decode("utf-8", errors="replace"))
                if entries is not _CUT_SHORT:
                    break
                if not chunk or size >= _ADDED_TOKENS_READ_MAX:
                    return None
                size *= 2
    except OSError:
        return None
    if not isinstance(entries, list):
        return None
    added: dict[int, dict[str, Any]] = {}
    for entry in entries:
        if not (isinstance(entry, dict) and isinstance(entry.get("id"), int)
                and isinstance(entry.get("content"), str)):
            return None
        added[entry["id"]] = {key: value for key, value in entry.items() if key != "id"}
    return added


_CUT_SHORT = object()  # the head read so far ends before the answer


def _added_tokens_list(text: str) -> Any:
    """The "added_tokens" value in a tokenizer.json's head, if the object's members begin
    "version", "truncation", "padding", "added_tokens" (the `tokenizers` library's order);
    None if they do not; `_CUT_SHORT` where `text` ends before that is known."""
    decoder, at = json.JSONDecoder(), _skip_space(text, 0)
    if not text.startswith("{", at):
        return _CUT_SHORT if at == len(text) else None
    at += 1
    for name in ("version", "truncation", "padding", "added_tokens"):
        at = _skip_space(text, at)
        key = f'"{name}"'
        if not text.startswith(key, at):
            return _CUT_SHORT if key.startswith(text[at:]) else None
        at = _skip_space(text, at + len(key))
        if not text.startswith(":", at):
            return _CUT_SHORT if at == len(text) else None
        try:
            value, at = decoder.raw_decode(text, _skip_space(text, at + 1))
        except ValueError:  # cut inside the value, or not JSON: the next read tells
            return _CUT_SHORT
        if name == "added_tokens":
            return value
        at = _skip_space(text, at)
        if not text.startswith(",", at):
            return _CUT_SHORT if at == len(text) else None
        at += 1
    return None


def _skip_space(text: str, at: int) -> int:
    while at < len(text) and text[at] in " \t\r\n":
        at += 1
    return at


def remove_stale_temp_dirs(folder: Path) -> list[Path]:
    """Delete temp conversion folders whose process is gone; return what was removed."""
    removed = []
    for entry in folder.glob(f"{_TMP_PREFIX}*"):
        parts = entry.name.rsplit(".", 2)
        pid = int(parts[1]) if len(parts) == 3 and parts[1].isdigit() else 0
        if entry.is_dir() and not pid_alive(pid):
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry)
    return removed


def pid_alive(pid: int) -> bool:
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


def _is_complete(folder: Path, gguf: Path) -> bool:
    """A folder a completed conversion of this kvchat's kind renamed into place, made from the
    bytes `gguf` holds now (`gguf_sample`: a file rewritten at the same size and mtime, or a
    folder from a kvchat that did not record the sample, is made again, its packed weights
    with it); one from a kvchat that stored float32 weights there (no "format" in its record)
    is made again too, which frees their space."""
    if not (folder / "config.json").is_file():
        return False
    try:
        record = json.loads((folder / SOURCE_RECORD).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(record, dict) and record.get("format") == FOLDER_FORMAT \
        and record.get("sample") == gguf_sample(gguf)


def _write_source_record(folder: Path, gguf: Path) -> None:
    stat = gguf.stat()
    record = {"gguf": str(gguf.resolve()), "bytes": stat.st_size, "mtime_ns": stat.st_mtime_ns,
              "format": FOLDER_FORMAT, "sample": gguf_sample(gguf)}
    (folder / SOURCE_RECORD).write_text(json.dumps(record, indent=2) + "\n")


@contextlib.contextmanager
def spinner(message: str) -> Iterator[None]:
    """A spinner with the time taken so far, on the terminal's stderr: bound to the stream
    now, so that convert_gguf's muting of transformers' progress bars (a redirect of
    sys.stderr) does not mute it too. Nothing where stderr is not a terminal (a log, a pipe)."""
    from rich.console import Console
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
    from rich.table import Column

    console = Console(file=sys.stderr)
    if not console.is_terminal:
        yield
        return
    text = TextColumn("{task.description}", table_column=Column(overflow="fold"))
    with Progress(SpinnerColumn(), TimeElapsedColumn(), text, console=console,
                  transient=True) as progress:
        progress.add_task(message, total=None)
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
