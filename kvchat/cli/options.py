"""Options shared by several commands, declared once: the model / cache / sessions family that
`@lazy_runtime_options()` adds to a command, `build_runtime_options` that turns their values into
one `RuntimeOptions`, and help text that reflows to the terminal."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from kvchat.config import H2O_COST_NOTE, POLICY_ENV_VAR, POLICY_NAMES

if TYPE_CHECKING:
    from kvchat.runtime import RuntimeOptions

# `--help` groups a command's options in these panels, the command's own first.
MODEL_PANEL = "Model"
CACHE_PANEL = "Cache"
STORE_PANEL = "Sessions and disk tier"
SAMPLING_PANEL = "Sampling"
WHERE_PANEL = "Where it runs"
DTYPES = ("float32", "bfloat16", "float16", "int8", "int4")


def choices(values: tuple[str, ...]) -> str:
    """A metavar that shows an option's fixed set of values: [a|b|c]."""
    return "[" + "|".join(values) + "]"


ModelOption = Annotated[
    str | None,
    typer.Option(
        "--model",
        "-m",
        help="Hugging Face Hub id, local model folder or .gguf file "
        "(default: the embedded SmolLM2-135M-Instruct).",
        show_default=False, rich_help_panel=MODEL_PANEL,
    ),
]
DtypeOption = Annotated[
    str | None,
    typer.Option(
        "--dtype",
        metavar=choices(DTYPES),
        help="int8 / int4: weight-only, computing in bfloat16 (CPU). Default: a GGUF keeps its "
        "own (Q4 -> int4, Q5-Q8 -> int8), anything else float32 on CPU, bfloat16 on a GPU.",
        show_default=False, rich_help_panel=MODEL_PANEL,
    ),
]
ChatTemplateOption = Annotated[
    str | None,
    typer.Option(
        "--chat-template",
        help="A Jinja file (or tokenizer_config.json), chatml, one of the model's named "
        "templates, or plain (kvchat's plain-text format). Default: the model's own, else plain.",
        show_default=False, rich_help_panel=MODEL_PANEL,
    ),
]
CompileOption = Annotated[
    bool,
    typer.Option("--compile", help="Batched decode steps through torch.compile (a minute or "
                 "two the first time); outputs then round like a batch's (docs/precision.md).",
                 rich_help_panel=MODEL_PANEL),
]
DeviceOption = Annotated[
    str,
    typer.Option("--device", metavar=choices(("auto", "cpu", "cuda", "cuda:N")),
                 help="auto: CUDA when available, else CPU.", rich_help_panel=MODEL_PANEL),
]
PolicyOption = Annotated[
    str | None,
    typer.Option(
        "--policy",
        metavar=choices(POLICY_NAMES),
        help=f"Eviction: sink-lru keeps each sequence's first block, h2o evicts the blocks that "
        f"received the least attention. Default: ${POLICY_ENV_VAR}, else lru. {H2O_COST_NOTE}",
        show_default=False, rich_help_panel=CACHE_PANEL,
    ),
]
BlockSizeOption = Annotated[
    int, typer.Option("--block-size", help="Tokens per cache block.", min=1, max=4096,
                      rich_help_panel=CACHE_PANEL)
]
CacheMbOption = Annotated[
    float,
    typer.Option("--cache-mb", help="K/V pool in MiB, all layers; allocated once.",
                 rich_help_panel=CACHE_PANEL),
]
MaxPinnedOption = Annotated[
    float,
    typer.Option("--max-pinned", help="Share of the pool pinned prefixes may hold.", min=0.0,
                 max=1.0, rich_help_panel=CACHE_PANEL),
]
PrefillChunkOption = Annotated[
    int, typer.Option("--prefill-chunk", help="Prompt tokens per prefill forward pass.", min=1,
                      rich_help_panel=CACHE_PANEL)
]
SessionsDirOption = Annotated[
    Path,
    typer.Option(
        "--sessions-dir",
        help="Session transcripts, input history and the cache snapshot.",
        file_okay=False, rich_help_panel=STORE_PANEL,
    ),
]
DiskCacheGbOption = Annotated[
    float,
    typer.Option("--disk-cache-gb", help="Disk tier in GiB: evicted blocks are kept and loaded "
                 "back on a hit, across runs. 0: off (nothing kept).", min=0,
                 rich_help_panel=STORE_PANEL),
]
StoreOption = Annotated[
    str | None,
    typer.Option("--store", help="The disk tier's blocks: a folder (default: "
                 "<sessions-dir>/cache/store) or redis://HOST:PORT/DB (shared by every "
                 "instance naming it).", show_default=False, rich_help_panel=STORE_PANEL),
]
SharedStoreOption = Annotated[
    bool,
    typer.Option("--shared-store", help="Other instances use the --store folder too: write "
                 "blocks at once, read theirs (always on for redis://).",
                 rich_help_panel=STORE_PANEL),
]
MaxTokensOption = Annotated[
    int, typer.Option("--max-tokens", help="Most tokens to generate per reply.", min=1,
                      rich_help_panel=SAMPLING_PANEL)
]

Command = Callable[..., None]


def _option(name: str, annotation: Any, default: Any) -> inspect.Parameter:
    return inspect.Parameter(
        name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=annotation
    )


_MODEL_FAMILY = (
    _option("model", ModelOption, None),
    _option("dtype", DtypeOption, None),
    _option("device", DeviceOption, "auto"),
    _option("compile", CompileOption, False),
    _option("chat_template", ChatTemplateOption, None),
)
_CACHE_FAMILY = (
    _option("policy", PolicyOption, None),
    _option("block_size", BlockSizeOption, 16),
    _option("cache_mb", CacheMbOption, 1024.0),
    _option("max_pinned", MaxPinnedOption, 0.5),
    _option("prefill_chunk", PrefillChunkOption, 512),
)
_SESSIONS_FAMILY = (
    _option("sessions_dir", SessionsDirOption, Path("sessions")),
    _option("disk_cache_gb", DiskCacheGbOption, 10.0),
    _option("store", StoreOption, None),
    _option("shared_store", SharedStoreOption, False),
)


def build_runtime_options(
    *,
    model: str | None,
    dtype: str | None,
    device: str,
    compile: bool,
    chat_template: str | None,
    policy: str | None,
    block_size: int,
    cache_mb: float,
    max_pinned: float,
    prefill_chunk: int,
    sessions_dir: Path = Path("sessions"),
    disk_cache_gb: float = 10.0,
    store: str | None = None,
    shared_store: bool = False,
    persist: bool,
) -> RuntimeOptions:
    """The one place these options become a RuntimeOptions. A bad value (an unknown policy, a
    zero budget) raises a KvchatError naming the option, before anything is loaded."""
    from kvchat.cache.redis_store import is_store_url
    from kvchat.config import CacheConfig
    from kvchat.runtime import RuntimeOptions

    cache = CacheConfig(block_size=block_size, cache_mb=cache_mb, policy=policy,
                        max_pinned=max_pinned)
    return RuntimeOptions(model=model, dtype=dtype, device=device, cache=cache,
                          prefill_chunk=prefill_chunk, sessions_dir=sessions_dir,
                          persist=persist, disk_cache_gb=disk_cache_gb,
                          store_dir=None if store is None or is_store_url(store) else Path(store),
                          store_url=store if store is not None and is_store_url(store) else None,
                          shared_store=shared_store, chat_template=chat_template,
                          compile=compile)


def _option_family(
    target: str, family: tuple[inspect.Parameter, ...], build: Callable[..., Any]
) -> Callable[[Command], Command]:
    """A decorator adding `family`'s options to a command's signature, where Typer reads them;
    the command is called with one argument `target`, built from their values by `build`."""
    names = [p.name for p in family]

    def decorate(command: Command) -> Command:
        own = [p for p in inspect.signature(command).parameters.values() if p.name != target]

        @functools.wraps(command)
        def with_family(**values: Any) -> None:
            built = build(**{name: values.pop(name) for name in names})
            command(**values, **{target: built})

        signature = inspect.Signature([*(_evaluated(p, command) for p in own), *family])
        with_family.__signature__ = signature  # type: ignore[attr-defined]
        # Typer resolves annotations from here too: the target's type must not appear in them.
        with_family.__annotations__ = {p.name: p.annotation for p in signature.parameters.values()}
        return with_family

    return decorate


def _evaluated(parameter: inspect.Parameter, command: Command) -> inspect.Parameter:
    """`parameter` with its annotation evaluated, as Typer needs it: this module's `from
    __future__ import annotations` leaves annotations as strings."""
    if not isinstance(parameter.annotation, str):
        return parameter
    namespace = getattr(command, "__globals__", {})
    return parameter.replace(annotation=eval(parameter.annotation, namespace))  # noqa: S307



def reflow(text: str) -> str:
    """Each paragraph of a docstring on one line, for Rich to wrap to the terminal's width;
    blank lines stay paragraph breaks. (Typer's rich mode keeps a docstring's hard breaks.)"""
    paragraphs = inspect.cleandoc(text).split("\n\n")
    return "\n\n".join(" ".join(paragraph.split()) for paragraph in paragraphs)


def reflow_help(commands: typer.Typer) -> None:
    for info in commands.registered_commands:
        info.help = reflow(info.help or inspect.getdoc(info.callback) or "")
    for group in commands.registered_groups:
        if group.typer_instance is not None:
            reflow_help(group.typer_instance)


