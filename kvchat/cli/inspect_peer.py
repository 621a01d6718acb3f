"""`kvchat inspect --connect URL` and `--explain` on a server: for a kvchat server, its live
tree (POST /cache/explain answers from it); for any other engine, what its API says of itself
and this client's record of what it sent (`kvchat.client.ledger`), labelled as such."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

from kvchat.cli.app import stdout
from kvchat.errors import KvchatError

if TYPE_CHECKING:
    from kvchat.client import Attachment
    from kvchat.client.ledger import Ledger
    from kvchat.inspect.explain import PromptSpec
    from kvchat.targets import Peer

Specs = list[tuple[int | None, "PromptSpec"]]


def explain_on_server(server: Attachment, sessions_dir: Path, specs: Specs,
                      as_json: bool) -> None:
    """--explain with a server: from this client's record for a remote engine (read without
    asking it, when there is one), from the live tree for a kvchat server."""
    from kvchat.client.ledger import Ledger, ledger_path
    from kvchat.client.peers import KVCHAT
    from kvchat.targets import detect_peer

    saved = Ledger.read(ledger_path(sessions_dir, server.url)) if server.connect else None
    if saved is not None and saved.engine != KVCHAT:
        _explain_sent(saved, specs, as_json)
        return
    found = detect_peer(server)
    if found is not None:
        client, engine = found
        client.close()
        _explain_sent(Ledger.open(sessions_dir, engine.url, engine.kind), specs, as_json)
        return
    _explain_live(server, specs, as_json)


def _explain_live(server: Attachment, specs: Specs, as_json: bool) -> None:
    from kvchat.cache.explain import Explanation, MissReason
    from kvchat.client import Client
    from kvchat.inspect.explain import PromptExplanation
    from kvchat.ui.explain_view import explain_panel

    with Client(server.url, server.token) as client:
        docs = [(line, client.explain({"prompt": spec.raw} if spec.raw is not None
                                      else {"messages": list(spec.messages)}))
                for line, spec in specs]
    for line, doc in docs:
        if as_json:
            typer.echo(json.dumps({**({} if line is None else {"line": line}), **doc},
                                  ensure_ascii=False))
            continue
        detail = doc.get("detail", {})
        why = Explanation(MissReason(doc["miss_reason"]), int(doc["cached_tokens"]),
                          int(doc["prompt_tokens"]), doc.get("diverged_at"),
                          tuple(detail.get("cached_ids", ())), doc.get("evicted_through"),
                          doc.get("evicted_at"), doc.get("evicted_by"))
        where = f"live cache of the server at {server.url}" + (
            "" if line is None else f" · line {line}")
        stdout().print(explain_panel(PromptExplanation(why, (), str(doc["line"]), detail),
                                     where))


def _explain_sent(ledger: Ledger, specs: Specs, as_json: bool) -> None:
    from kvchat.client.peers import CACHE_NOTE, GENERIC
    from kvchat.ui.peer_view import explain_line, sent_explain_panel

    note = CACHE_NOTE.get(ledger.engine, CACHE_NOTE[GENERIC])
    for line, spec in specs:
        if spec.raw is not None:
            raise KvchatError(f"--raw explains an exact prompt text, but {ledger.engine} "
                              "templates prompts itself and this client's record keeps the "
                              "messages it sent: explain without --raw.")
        match = ledger.closest(spec.messages)
        if as_json:
            doc: dict[str, Any] = {
                **({} if line is None else {"line": line}), "source": "this client's record",
                "engine": ledger.engine, "url": ledger.url, "line_text":
                explain_line(match, ledger.engine), **match._asdict(),
                "report": match.report._asdict() if match.report is not None else None}
            typer.echo(json.dumps(doc, ensure_ascii=False))
            continue
        source = f"this client's record of {ledger.url}" + ("" if line is None
                                                             else f" · line {line}")
        stdout().print(sent_explain_panel(match, ledger.engine, source, note))


def inspect_peer(peer: Peer, as_json: bool, depth: int | None) -> None:
    """What the peer says of itself, and what this client sent it."""
    from kvchat.chat.peer import facts_of
    from kvchat.client.ledger import Ledger
    from kvchat.ui.peer_view import peer_panel, sent_tree

    peer.client.close()
    engine = peer.info
    ledger = Ledger.open(peer.sessions_dir, engine.url, engine.kind)
    if as_json:
        typer.echo(json.dumps({"engine": engine.to_json(), "sent": ledger.to_json()},
                              ensure_ascii=False))
        return
    stdout().print(peer_panel(facts_of(engine)))
    stdout().print(sent_tree(ledger.roots, engine.kind, depth=depth or 6, max_children=8))
