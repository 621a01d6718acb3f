"""`kvchat batch --connect URL` on an engine other than kvchat serve (see
`kvchat.batch.peer`): its options, and the run under the sessions dir's lock (session
lines continue this dir's sessions; the record of sent prompts is written here)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape

from kvchat.batch.order import ORDERS
from kvchat.errors import KvchatError

if TYPE_CHECKING:
    from kvchat.batch import ItemResult, LineRun
    from kvchat.cli.batch import _Plan
    from kvchat.client.openai_http import OpenAIClient
    from kvchat.client.peers import PeerInfo

DEFAULT_CONCURRENCY = 4

OrderOption = Annotated[
    str, typer.Option("--order", help="With --connect to an engine other than kvchat serve: "
                      "cache-aware (each shared-prefix group's first line alone, the rest once "
                      "the engine has prefilled it) or input (file order).")
]
ConcurrencyOption = Annotated[
    int | None,
    typer.Option("--concurrency", min=1, show_default=False,
                 help="Lines in flight at once (default: llama-server's slots, 4 on vLLM or "
                 "SGLang, twice the batch size on a kvchat server: a line's wait in a "
                 "server's queue counts toward --request-timeout)."),
]


def check_order(order: str) -> str:
    if order not in ORDERS:
        raise KvchatError(f"--order must be one of {', '.join(ORDERS)}, got {order!r}.")
    return order


def run_on_engine(client: OpenAIClient, engine: PeerInfo, plan: _Plan, sessions_dir: Path,
                  defaults: tuple[int, float, int | None], out_path: Path | None,
                  flags: tuple[bool, bool], how: tuple[str, int | None], ui: Console,
                  run_plan: Any) -> tuple[LineRun, bool]:
    """The plan's lines through the engine; `flags` (--fail-fast, --pin-system), `how`
    (--order, --concurrency), `run_plan` the command's row-writing loop."""
    from kvchat.batch.peer import PeerRun
    from kvchat.client import ServerGone
    from kvchat.client.ledger import Ledger
    from kvchat.session_lock import sessions_lock
    from kvchat.sessions import SessionStore

    if flags[1]:
        raise KvchatError(f"--pin-system pins in kvchat's own cache; {engine.kind} keeps its "
                          "own, and its API has no way to pin a prefix.")
    order, concurrency = how
    ui.print(f"[dim]engine {escape(engine.describe())} · model {escape(engine.model)}[/dim]",
             soft_wrap=True)
    with client, sessions_lock(sessions_dir, f"kvchat batch --connect {engine.url}"):
        store = SessionStore(sessions_dir)
        ledger = Ledger.open(sessions_dir, engine.url, engine.kind)

        def start(update: Callable[[ItemResult], None]) -> PeerRun:
            return PeerRun(client, engine, plan.to_run, defaults, flags[0], update, store,
                             ledger, order,
                             concurrency or engine.slots or DEFAULT_CONCURRENCY)

        def save() -> None:
            try:
                ledger.save()
            except KvchatError as exc:  # every row is written; only the record is not
                ui.print(f"[yellow]{escape(str(exc))}[/yellow]")

        try:
            return run_plan(plan, ui, None, start, lambda: None, save)
        except ServerGone as exc:
            again = f" kvchat batch FILE -o {out_path} --resume" if out_path else " --resume"
            raise ServerGone(f"{exc} Every finished line has its row; once the server runs "
                             f"again, finish the others with{again}.") from None
