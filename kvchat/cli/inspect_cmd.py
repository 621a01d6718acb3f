"""`kvchat inspect`: the saved cache without loading the model (and without torch)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.markup import escape

from kvchat.cli.app import app, stderr, stdout
from kvchat.cli.attach_options import ApiKeyOption, ConnectOption, TokenOption
from kvchat.cli.options import SessionsDirOption
from kvchat.errors import KvchatError

if TYPE_CHECKING:
    from kvchat.client import Attachment
    from kvchat.inspect.explain import PromptSpec


ExplainOption = Annotated[
    str | None,
    typer.Option("--explain", help="Say why this user message, as a new conversation's first "
                 "turn, would miss the cache (cold, evicted or diverged): the saved snapshot, "
                 "a kvchat server's live cache, or for another engine this client's record of "
                 "what it sent.", show_default=False),
]
ExplainFileOption = Annotated[
    Path | None,
    typer.Option("--explain-file", help="--explain with the file's text, its one batch row "
                 "(\"messages\" or \"prompt\"), or each line of a JSONL request file (one "
                 "answer per line).", show_default=False, dir_okay=False),
]
SystemOption = Annotated[
    str | None,
    typer.Option("--system", help="With --explain: the conversation's system prompt.",
                 show_default=False),
]
StandaloneOption = Annotated[
    bool,
    typer.Option("--standalone", help="Read the saved snapshot in the sessions dir even while "
                 "a kvchat server holds it (the server's live cache may have moved on since its "
                 "last save); inspect never loads a model."),
]
RawOption = Annotated[
    bool, typer.Option("--raw", help="With --explain: the text is the exact prompt (no chat "
                       "template)."),
]


@app.command("inspect")
def inspect_snapshot(
    sessions_dir: SessionsDirOption = Path("sessions"),
    as_json: Annotated[
        bool, typer.Option("--json", help="Print JSON (schema in docs/inspect.md) instead of text.")
    ] = False,
    depth: Annotated[
        int | None,
        typer.Option("--depth", help="Tree levels to show (text default: 6; JSON: all).",
                     min=1, show_default=False),
    ] = None,
    session: Annotated[
        str | None,
        typer.Option("--session", "-s", help="Only the branches this session's turns went "
                     "through.", show_default=False),
    ] = None,
    explain_text: ExplainOption = None,
    explain_file: ExplainFileOption = None,
    system: SystemOption = None,
    raw: RawOption = False,
    connect: ConnectOption = None,
    token: TokenOption = None,
    api_key: ApiKeyOption = None,
    standalone: StandaloneOption = False,
) -> None:
    """Show the saved cache (radix tree, exact index, stats) without loading the model; while
    a kvchat server holds the sessions dir (or with --connect), its live cache. --explain says
    why a prompt would miss the cache.

    --connect to a peer (another OpenAI-compatible engine) shows what its API says of itself
    and this client's record of what it sent (the peer's cache is its own); --explain answers
    from that record."""
    from kvchat.targets import Peer, Server, Where, choose, find_server

    where = Where(connect, token, api_key, standalone)
    specs = _explain_spec(explain_text, explain_file, system, raw)
    if specs is not None:
        server = find_server(sessions_dir, where, stderr())
        if server is None:
            _explain(sessions_dir, specs, as_json)
        else:
            from kvchat.cli.inspect_peer import explain_on_server

            explain_on_server(server, sessions_dir, specs, as_json)
        return
    from kvchat.sessions import validate_name

    if session is not None:
        validate_name(session)
    target = choose(sessions_dir, where, stderr())
    if isinstance(target, Peer):
        from kvchat.cli.inspect_peer import inspect_peer

        inspect_peer(target, as_json, depth)
    elif isinstance(target, Server):
        _inspect_server(target.server, as_json, depth, session)
    else:  # this process: the snapshot, read without the model
        _inspect_saved(sessions_dir, as_json, depth, session)


def _inspect_saved(sessions_dir: Path, as_json: bool, depth: int | None,
                   session: str | None) -> None:
    """The snapshot saved in the sessions dir, read without the model."""
    from kvchat.inspect import documents as cv
    from kvchat.sessions import cache_dir
    from kvchat.snapshots import TREE_INDEX, read_snapshot_meta
    from kvchat.ui.inspect_view import SnapshotFacts, inspect_view

    index = cache_dir(sessions_dir) / TREE_INDEX
    try:
        info = read_snapshot_meta(sessions_dir)
        if info is None:
            stderr().print(
                f"No cache snapshot in {escape(str(index.parent))}: `kvchat chat` or `kvchat "
                "batch` writes one there."
            )
            raise typer.Exit(1)
        meta = info.meta
        nodes = cv.nodes_from_meta(meta)
        exact = cv.exact_from_meta(meta)
        stats = cv.stats_from_meta(meta, nodes)
    except (OSError, ValueError) as exc:
        raise KvchatError(
            f"The cache snapshot {index} cannot be read ({exc}). The next `kvchat chat` sets "
            "it aside and starts with an empty cache."
        ) from None
    decode = _snapshot_decoder(meta.get("tokenizer_file"))
    fingerprint = meta.get("fingerprint", {})
    if as_json:
        where = {"path": str(index), "saved_at": meta.get("saved_at"),
                 "model_label": meta.get("model_label"),
                 "tokenizer_file": meta.get("tokenizer_file")}
        doc = cv.inspect_document(fingerprint, where, stats, nodes, exact, decode, depth, session,
                                  _disk_tier(meta, sessions_dir))
        # one line: token lists make an indented dump thousands of lines long
        typer.echo(json.dumps(doc, ensure_ascii=False))
        return
    nodes, exact = cv.for_session(nodes, exact, session)
    facts = SnapshotFacts(
        path=str(index),
        model=str(meta.get("model_label") or fingerprint.get("model", "?")),
        dtype=str(fingerprint.get("dtype", "?")),
        saved_at=meta.get("saved_at"),
    )
    stdout().print(inspect_view(facts, stats, nodes, exact, decode, depth or 6, 8, session,
                                _disk_tier(meta, sessions_dir)))


def _explain_spec(text: str | None, file: Path | None, system: str | None, raw: bool
                  ) -> list[tuple[int | None, PromptSpec]] | None:
    """The prompts --explain asks about (with their line in a JSONL file); None when inspect
    shows the cache instead."""
    if text is None and file is None and system is None and not raw:
        return None
    from kvchat.inspect.explain import PromptSpec

    if (text is None) == (file is None):
        raise KvchatError("--system and --raw go with one of --explain TEXT or --explain-file "
                          "FILE." if text is None else
                          "Give --explain TEXT or --explain-file FILE, not both.")
    if text is not None:
        return [(None, PromptSpec.of_text(text, system, raw))]
    assert file is not None
    return PromptSpec.all_of_file(file, system, raw)


def _explain(sessions_dir: Path, specs: list[tuple[int | None, PromptSpec]],
             as_json: bool) -> None:
    """Why each prompt would miss, from index.json alone (no model, no torch); one panel (or
    JSON line, with its "line") per line of a JSONL file."""
    from kvchat.inspect.explain import explain_snapshot
    from kvchat.sessions import cache_dir
    from kvchat.snapshots import TREE_INDEX, read_snapshot_meta
    from kvchat.ui.explain_view import explain_panel

    index = cache_dir(sessions_dir) / TREE_INDEX
    try:
        info = read_snapshot_meta(sessions_dir)
        if info is None:
            stderr().print(f"No cache snapshot in {escape(str(index.parent))}: `kvchat chat` "
                           "or `kvchat batch` writes one there.")
            raise typer.Exit(1)
        results = [(line, explain_snapshot(info.meta, spec)) for line, spec in specs]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise KvchatError(f"The cache snapshot {index} cannot be read ({exc}).") from None
    for line, result in results:
        if as_json:
            where = {} if line is None else {"line": line}
            typer.echo(json.dumps({**where, **result.to_json()}, ensure_ascii=False))
        else:
            stdout().print(explain_panel(result, str(index) + ("" if line is None
                                                               else f" · line {line}")))


def _inspect_server(server: Attachment, as_json: bool, depth: int | None,
                    session: str | None) -> None:
    """The live cache of a running server: /cache/tree, the document --json prints."""
    from kvchat.client import documents as docs
    from kvchat.ui.inspect_view import SnapshotFacts, inspect_view

    with server.client() as client:
        doc = client.cache_tree(depth if as_json else None, session)
    if as_json:
        typer.echo(json.dumps(doc, ensure_ascii=False))
        return
    snapshot, fingerprint = doc.get("snapshot", {}), doc.get("fingerprint", {})
    facts = SnapshotFacts(
        path=f"live cache of the server at {server.url}",
        model=str(snapshot.get("model_label") or fingerprint.get("model", "?")),
        dtype=str(fingerprint.get("dtype", "?")),
        saved_at=snapshot.get("saved_at"),
    )
    stdout().print(inspect_view(facts, docs.stats_from_document(doc["stats"]),
                                docs.nodes_from_document(doc["tree"]),
                                docs.exact_from_document(doc["exact"]),
                                _snapshot_decoder(snapshot.get("tokenizer_file")),
                                depth or 6, 8, session, doc.get("tiers", {}).get("disk")))


def _disk_tier(meta: dict[str, Any], sessions_dir: Path) -> dict[str, Any]:
    """The disk tier's files from its own index (torch-free: no block file is opened)."""
    from kvchat.cache.block_index import read_disk_tier
    from kvchat.cache.redis_store import is_store_url

    where = str(meta.get("store_dir") or "")
    if is_store_url(where):  # its blocks are the server's to count: none read here
        return {"blocks": 0, "bytes": 0, "budget_bytes": 0, "path": where}
    store = Path(where or sessions_dir / "cache" / "store")
    return {**read_disk_tier(store).to_json(), "path": str(store)}


def _snapshot_decoder(tokenizer_file: str | None) -> Any:
    """Decode edge previews with the tokenizer file alone (no transformers, no torch); None
    when it is not recorded or no longer there (previews then show token ids)."""
    from kvchat.client.documents import tokenizer_decoder

    return tokenizer_decoder(tokenizer_file)
