"""Rich views of a remote engine (llama.cpp, vLLM, SGLang or any OpenAI-compatible server): pure
functions of what its API reported and of this client's record of what it sent
(`kvchat.client.ledger`). Every number is labelled as the engine's report or the client's own
measurement; nothing here stands for the engine's cache itself, which a client cannot see.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

from rich.console import Group, RenderableType
from rich.panel import Panel
from rich.text import Text
from rich.tree import Tree

from kvchat.cache.stats import ratio
from kvchat.inspect.previews import distinct_offsets, preview
from kvchat.ui.views import TurnView, bar, ms, pct, plural

if TYPE_CHECKING:
    from kvchat.client.ledger import Report, SentMatch, SentNode

Message = dict[str, str]


class PeerFacts(NamedTuple):
    """What an engine says of itself (`kvchat.client.peers.PeerInfo`), for the panels."""

    kind: str  # "llama.cpp"
    name: str  # "llama.cpp b1-0c1e570"
    url: str
    model: str
    facts: tuple[tuple[str, str], ...] = ()
    hint: str = ""  # how the engine is told to report cached tokens


class ClientTotals(NamedTuple):
    """This client's requests to the engine so far, as the engine reported them."""

    requests: int
    prompt_tokens: int
    cached_tokens: int
    reported: int  # requests whose reply carried cached_tokens


def engine_hit_panel(turn: TurnView, engine: str, reported: bool, mode: str = "full"
                     ) -> RenderableType:
    """This turn's prompt: how much the engine said it had cached (its cached_tokens), and
    the times this client measured."""
    t = turn
    if mode == "compact":
        cached = (f"{t.hit_tokens:,}/{t.prompt_tokens:,} cached {pct(t.hit_rate)} "
                  f"({engine} reported)" if reported else "cached not reported")
        return Text(f"turn {t.number} · {cached} · TTFT {ms(t.ttft_ms)}")
    if reported:
        lines = [f"cached {t.hit_tokens:,} / {t.prompt_tokens:,} tok  {pct(t.hit_rate)}",
                 f"{bar(t.hit_rate)} as {engine} reported",
                 f"computed {t.computed_tokens:,} tok"
                 + (f" · prefill {ms(t.prefill_ms)} (its timings)" if t.prefill_ms else "")]
    else:
        lines = [f"prompt {t.prompt_tokens:,} tok" if t.prompt_tokens else "prompt ? tok",
                 f"cached: not reported by {engine}"]
    lines += [f"TTFT {ms(t.ttft_ms)} (first streamed text, here)",
              f"reply {t.completion_tokens:,} tok · {t.decode_tokens_per_s:,.0f} tok/s · "
              f"{t.finish_reason}"]
    return Panel(Text("\n".join(lines)), title=f"turn {t.number} · {engine}'s cache",
                 title_align="left", expand=False)


def peer_panel(engine: PeerFacts, totals: ClientTotals | None = None, mode: str = "full"
                 ) -> RenderableType:
    """The engine as it describes itself, and this client's requests as it reported them."""
    if totals is None:  # `kvchat inspect`: the engine alone
        lines = [f"model {engine.model}", f"at {engine.url}",
                 *(f"{k} {v}" for k, v in engine.facts)]
        return Panel(Text("\n".join(lines)), title=f"{engine.name} · as it reports",
                     title_align="left", expand=False)
    share = ratio(totals.cached_tokens, totals.prompt_tokens)
    mine = (f"cached {totals.cached_tokens:,} / {totals.prompt_tokens:,} prompt tok "
            f"{pct(share)}" if totals.reported else "cached tokens not reported")
    if mode == "compact":
        return Text(f"{engine.name} · this client: {plural(totals.requests, 'request')} · "
                    f"{mine}")
    lines = [f"model {preview(engine.model, 48)}",
             *(f"{k} {v}" for k, v in engine.facts),
             f"this client: {plural(totals.requests, 'request')}",
             mine]
    if totals.requests and totals.reported < totals.requests:
        lines.append(f"{totals.requests - totals.reported} repl(ies) without cached_tokens"
                     + (f": {engine.hint}" if engine.hint else ""))
    return Panel(Text("\n".join(lines)), title=f"{engine.name} · as it reports",
                 title_align="left", expand=False)


def _chain(node: SentNode) -> tuple[list[SentNode], SentNode]:
    """`node` and its single-child descendants (one conversation, until it branches)."""
    chain = [node]
    while len(chain[-1].children) == 1:
        chain.append(chain[-1].children[0])
    return chain, chain[-1]


def _message(node: SentNode, limit: int, shared: int = 0) -> str:
    """The message's role and text; after `shared` characters a sibling has too, so that
    siblings are told apart ("system: …about deserts.")."""
    if shared > 8 and shared < len(node.content):
        return f"{node.role}: …{preview(node.content[shared - 4:], limit - 1)}"
    return f"{node.role}: {preview(node.content, limit)}"


def _newest(chain: Sequence[SentNode]) -> Report | None:
    reports = [r for n in chain for r in n.reports]
    return max(reports, key=lambda r: r.at, default=None)


def report_text(report: Report | None) -> str:
    if report is None:
        return ""
    if report.cached_tokens is None or report.prompt_tokens is None:
        return "cached not reported"
    return f"cached {report.cached_tokens:,}/{report.prompt_tokens:,} tok"


def _label(chain: Sequence[SentNode], on_path: bool, shared: int = 0) -> Text:
    head, tail = chain[0], chain[-1]
    label = Text(f"{plural(len(chain), 'msg')} · sent {head.sent:,}× ")
    text = f'"{_message(head, 28, shared)}"'
    if len(chain) > 1:
        text += f' … "{_message(tail, 24)}"'
    label.append(text, style="bold cyan" if on_path else "cyan")
    newest = report_text(_newest(chain))
    if newest:
        label.append(f" · last reply {newest}", style="dim")
    return label


def _on_path(chain: Sequence[SentNode], path: Sequence[Message], depth: int) -> bool:
    return all(depth + i < len(path) and path[depth + i]["role"] == n.role
               and path[depth + i]["content"] == n.content for i, n in enumerate(chain))


def sent_tree(roots: Sequence[SentNode], engine: str, depth: int = 3, max_children: int = 3,
              highlight: Sequence[Message] = ()) -> Tree:
    """The prompts this client sent, as a tree of messages (a conversation until it branches
    is one line), with what the engine reported for the newest request through each; the
    `highlight` conversation is drawn first and in bold."""
    total = sum(1 for r in roots for _ in r.walk())
    root = Tree(Text(f"sent by this client to {engine} · {plural(total, 'message')} "
                     "(its reports, not its cache)"))
    if not roots:
        root.add(Text("(nothing sent yet)", style="dim"))
        return root
    stack: list[tuple[Tree, Sequence[SentNode], int, int]] = [(root, roots, 1, 0)]
    while stack:
        parent, group, level, at = stack.pop()
        chains = [_chain(n) for n in group]
        shared = distinct_offsets([[ord(ch) for ch in n.content] for n in group])
        marked = [(c, end, _on_path(c, highlight, at), cut)
                  for (c, end), cut in zip(chains, shared, strict=True)]
        marked.sort(key=lambda m: (not m[2], -m[0][0].last))
        for chain, end, on_path, cut in marked[:max_children]:
            branch = parent.add(_label(chain, on_path, cut))
            if not end.children:
                continue
            if level < depth:
                stack.append((branch, end.children, level + 1, at + len(chain)))
            else:
                below = sum(1 for c in end.children for _ in c.walk())
                branch.add(Text(f"… {below:,} more messages below", style="dim"))
        if len(marked) > max_children:
            parent.add(Text(f"… {len(marked) - max_children:,} more", style="dim"))
    return root


def peer_turn_panels(turn: TurnView, engine: PeerFacts, totals: ClientTotals,
                       reported: bool, roots: Sequence[SentNode], mode: str,
                       path: Sequence[Message]) -> RenderableType:
    """What the REPL prints after a reply on a remote engine."""
    from rich.columns import Columns

    if mode == "off":
        return Group()
    hit = engine_hit_panel(turn, engine.kind, reported, mode)
    facts = peer_panel(engine, totals, mode)
    if mode == "compact":
        total = sum(1 for r in roots for _ in r.walk())
        return Group(hit, facts, Text(f"sent by this client: {plural(total, 'message')}"))
    return Group(Columns([hit, facts]), sent_tree(roots, engine.kind, highlight=path))


def sent_explain_panel(match: SentMatch, engine: str, source: str, note: str
                       ) -> RenderableType:
    """`kvchat inspect --explain` on a remote engine: how much of the prompt this client sent
    before, and what the engine reported for the newest such request."""
    lines = [explain_line(match, engine)]
    if match.report is not None:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(match.report.at))
        lines.append(f"the newest of them, at {when}: {report_text(match.report) or '?'}")
    if match.chars or match.messages < match.total_messages:
        if match.sent_next:
            lines.append(f"sent then: {preview(match.sent_next, 60)!r}")
        if match.prompt_next:
            lines.append(f"this one:  {preview(match.prompt_next, 60)!r}")
    lines.append(note)
    return Panel(Text("\n".join(lines)), title=f"why · {source}", title_align="left",
                 expand=False)


def explain_line(match: SentMatch, engine: str) -> str:
    """One line for people: "this client sent 3 requests ... that began with ..."."""
    if not match.requests:
        return (f"this client sent {engine} nothing that begins like this prompt: it would be "
                "computed from the start, unless another client sent it")
    if match.messages == 0:
        shared = (f"the first {match.chars:,} of the {match.next_chars:,} characters of its "
                  "first message")
    elif match.messages == match.total_messages:
        shared = ("its one message, whole" if match.total_messages == 1
                  else f"all {match.total_messages} of its messages")
    else:
        shared = f"its first {match.messages} of {match.total_messages} messages" + (
            f", then {match.chars:,} of the next one's {match.next_chars:,} characters"
            if match.chars else "")
    return (f"this client sent {engine} {plural(match.requests, 'request')} that began as "
            f"this prompt does: {shared}")
