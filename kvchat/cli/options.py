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

from kvchat.config import H2O_COST_NOTE, POLICY_ENV_VAR

if TYPE_CHECKING:
    from kvchat.runtime import RuntimeOptions

ModelOption = Annotated[
    str | None,
    typer.Option(
        "--model",
        "-m",
        help="Hugging Face Hub id, local model folder or .gguf file "
        "(default: the embedded SmolLM2-135M-Instruct).",
        show_default=False,
    ),
]
DtypeOption = Annotated[
    str | None,
    typer.Option(
        "--dtype",
        help="float32, bfloat16, float16, or weight-only int8 / int4 (computing in bfloat16; "
        "CPU). Default: a GGUF keeps its own class (Q4 -> int4, Q5-Q8 -> int8, F16 -> float16), "
        "anything else float32 on CPU, bfloat16 on a GPU.",
        show_default=False,
    ),
]
ChatTemplateOption = Annotated[
    str | None,
    typer.Option(
        "--chat-template",
        help="Chat template to write conversations with: a Jinja file (or a "
        "tokenizer_config.json), a name (chatml, or one of the model's named templates), or "
        "plain for kvchat's plain-text format. Default: the model's own; a model without one "
        "(a base model) gets the plain-text format.",
        show_default=False,
    ),
]
CompileOption = Annotated[
    bool,
    typer.Option("--compile", help="Run batched decode steps through torch.compile: fewer "
                 "small-op launches per step, after a one-time compile of a minute or two; "
                 "outputs then round like a batch's (see Precision in the README). A lone "
                 "sequence of an int4/int8 Llama-family model keeps the fused eager step, "
                 "which is faster."),
]
DeviceOption = Annotated[
    str,
    typer.Option("--device", help="auto (CUDA when available, else CPU), cpu, cuda or cuda:N."),
]
PolicyOption = Annotated[
    str | None,
    typer.Option(
        "--policy",
        help=f"Eviction policy: lru, sink-lru (never evicts a sequence's first block) or h2o "
        f"(evicts the blocks that received the least attention). Default: ${POLICY_ENV_VAR}, "
        f"else lru. Cost of h2o: {H2O_COST_NOTE}",
        show_default=False,
    ),
]
BlockSizeOption = Annotated[
    int, typer.Option("--block-size", help="Tokens per cache block.", min=1, max=4096)
]
CacheMbOption = Annotated[
    float,
    typer.Option("--cache-mb", help="K/V pool budget in MiB, all layers together; allocated once."),
]
MaxPinnedOption = Annotated[
    float,
    typer.Option("--max-pinned", help="The most of the pool pinned prefixes may hold, as a "
                 "fraction (0.5: half); a pin beyond it is refused.", min=0.0, max=1.0),
]
PrefillChunkOption = Annotated[
    int, typer.Option("--prefill-chunk", help="Prompt tokens per prefill forward pass.", min=1)
]
SessionsDirOption = Annotated[
    Path,
    typer.Option(
        "--sessions-dir",
        help="Folder for session transcripts, input history and the cache snapshot.",
        file_okay=False,
    ),
]
DiskCacheGbOption = Annotated[
    float,
    typer.Option("--disk-cache-gb", help="Disk tier budget in GiB: blocks evicted from the pool "
                 "are kept on disk and loaded back on a hit, and the cache persists across "
                 "runs. 0 turns it off (evicted blocks are dropped, nothing is saved).", min=0),
]
StoreOption = Annotated[
    str | None,
    typer.Option("--store", help="Where the disk tier keeps blocks: a folder (default: "
                 "<sessions-dir>/cache/store), or redis://HOST:PORT/DB (Redis or Valkey, shared "
                 "by every instance that names it; needs the redis package).",
                 show_default=False),
]
SharedStoreOption = Annotated[
    bool,
    typer.Option("--shared-store", help="Other kvchat instances use the --store folder too (a "
                 "shared file system): write every computed block to it at once and look there "
                 "for blocks this instance never computed. Always on for redis://."),
]
MaxTokensOption = Annotated[
    int, typer.Option("--max-tokens", help="Most tokens to generate per reply.", min=1)
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


