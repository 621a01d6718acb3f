"""The options that say where a command runs (--connect, --token, --api-key, --standalone and
the bounds on how long it waits on a server: `@where_options()`), and the runtime
options such a command builds only when it runs in-process:
building them imports the runtime (torch, transformers), which an attached command never
needs."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from kvchat.cli import options as shared
from kvchat.config import CONNECT_S, IDLE_S, TOTAL_S, Bounds
from kvchat.targets import Where

if TYPE_CHECKING:
    from kvchat.runtime import RuntimeOptions
    from kvchat.targets import Target

ConnectOption = Annotated[
    str | None,
    typer.Option("--connect", help="Run on the server at this URL: kvchat serve or a peer "
                 "(llama-server, vLLM, SGLang). Default: the kvchat server holding "
                 "--sessions-dir, if one does.", show_default=False,
                 rich_help_panel=shared.WHERE_PANEL),
]
ApiKeyOption = Annotated[
    str | None,
    typer.Option("--api-key", show_default=False, rich_help_panel=shared.WHERE_PANEL,
                 help="API key for --connect (default: --token, else $OPENAI_API_KEY)."),
]
TokenOption = Annotated[
    str | None,
    typer.Option("--token", envvar="KVCHAT_TOKEN", show_default=False,
                 rich_help_panel=shared.WHERE_PANEL,
                 help="Access token for --connect (default: the sessions dir's server's)."),
]
StandaloneOption = Annotated[
    bool,
    typer.Option("--standalone", rich_help_panel=shared.WHERE_PANEL,
                 help="Load the model here, never attach (refused while a server holds the "
                 "sessions dir)."),
]


ConnectTimeoutOption = Annotated[
    float, typer.Option("--connect-timeout", min=0.0, metavar="SECONDS",
                        rich_help_panel=shared.WHERE_PANEL,
                        help="On a server: the longest wait for a connection.")
]
IdleTimeoutOption = Annotated[
    float, typer.Option("--idle-timeout", min=0.0, metavar="SECONDS",
                        rich_help_panel=shared.WHERE_PANEL,
                        help="On a server: the longest a streamed reply may send nothing (0: "
                        "no bound).")
]
RequestTimeoutOption = Annotated[
    float, typer.Option("--request-timeout", min=0.0, metavar="SECONDS",
                        rich_help_panel=shared.WHERE_PANEL,
                        help="On a server: the longest one request may take in all (0: no "
                        "bound). A line or turn past a bound fails alone.")
]
_BOUNDS_FAMILY = (
    shared._option("connect_timeout", ConnectTimeoutOption, CONNECT_S),
    shared._option("idle_timeout", IdleTimeoutOption, IDLE_S),
    shared._option("request_timeout", RequestTimeoutOption, TOTAL_S),
)


def _bounds(connect_timeout: float, idle_timeout: float, request_timeout: float) -> Bounds:
    return Bounds.of_options(connect_timeout, idle_timeout, request_timeout)


class LazyRuntimeOptions:
    """The runtime options' values; `build()` makes the RuntimeOptions (and checks them) only
    for a command that runs in-process."""

    def __init__(self, values: dict[str, Any], persist: bool = True) -> None:
        from kvchat.config import CacheConfig  # torch-free: a bad value fails before anything

        CacheConfig(block_size=values["block_size"], cache_mb=values["cache_mb"],
                    policy=values["policy"])
        self.values = values
        self.persist = persist

    @property
    def sessions_dir(self) -> Path:
        return Path(self.values.get("sessions_dir", Path("sessions")))

    def ignored_when_attached(self) -> list[str]:
        """The model and cache options given on the command line: a server keeps its own."""
        family = shared._MODEL_FAMILY + shared._CACHE_FAMILY + shared._SESSIONS_FAMILY
        return ["--" + p.name.replace("_", "-") for p in family
                if p.name != "sessions_dir" and self.values.get(p.name, p.default) != p.default]

    def build(self) -> RuntimeOptions:
        return shared.build_runtime_options(**self.values, persist=self.persist)


def lazy_runtime_options(persist: bool = True) -> Any:
    """Add --model, --dtype, --device, --chat-template, --policy, --block-size, --cache-mb,
    --max-pinned, --prefill-chunk and, when the command loads and saves the cache (`persist`),
    --sessions-dir, --disk-cache-gb and --store, received as one `options: LazyRuntimeOptions`:
    built into a RuntimeOptions only once the command says what its start waits on, so that
    importing torch is shown from the first moment."""
    family = shared._MODEL_FAMILY + shared._CACHE_FAMILY + (
        shared._SESSIONS_FAMILY if persist else ())
    return shared._option_family("options", family,
                                 lambda **values: LazyRuntimeOptions(values, persist))


_WHERE_FAMILY = (
    shared._option("connect", ConnectOption, None),
    shared._option("token", TokenOption, None),
    shared._option("api_key", ApiKeyOption, None),
    shared._option("standalone", StandaloneOption, False),
)


def where_options(bounds: bool = True) -> Any:
    """--connect, --token, --api-key and --standalone (with `bounds`, the timeouts too),
    received as one `where: Where`: what `kvchat.targets.choose` reads to pick where the
    command runs."""
    family = _WHERE_FAMILY + (_BOUNDS_FAMILY if bounds else ())
    return shared._option_family("where", family, _where)


def _where(connect: str | None, token: str | None, api_key: str | None, standalone: bool,
           **timeouts: float) -> Where:
    return Where(connect, token, api_key, standalone, _bounds(**timeouts) if timeouts else None)


def choose_target(options: LazyRuntimeOptions, where: Where) -> Target:
    """Where a command that may load a model runs (see `kvchat.targets.choose`)."""
    from kvchat.cli.app import stderr
    from kvchat.targets import choose

    return choose(options.sessions_dir, where, stderr(), options.build,
                  options.ignored_when_attached())
