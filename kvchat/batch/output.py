"""Output rows of `kvchat batch`, written so that nothing finished is ever lost.

Every input line (blank lines aside) gets exactly one row, carrying its `line` number and the
`input_digest` of the line's text. To a file, each row is appended and flushed the moment its
request finishes, so a SIGKILL loses at most the row being written; when the run ends (finished,
interrupted, or stopped by SIGTERM) the file is rewritten atomically in input order. To stdout,
rows are printed in input order as soon as every earlier line has its row. `--resume` reads a
previous output, keeps the rows that finished (checking their lines are unchanged) and runs the
rest.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import IO, Any

from kvchat.batch.output_file import OutputClosed, OutputError, OutputFile
from kvchat.batch.recorder import COMPLETE, ItemResult
from kvchat.engine.result import GenerationResult
from kvchat.request_file import BadLine, BatchItem
from kvchat.responses import chat_completion, result_fields

__all__ = ["COMPLETE", "OutputClosed", "OutputError", "OutputFile", "RowWriter", "bad_line_row",
           "is_complete", "previous_rows", "result_row"]


def result_row(res: ItemResult) -> dict[str, Any]:
    item, r = res.item, res.result
    where = {"line": item.line, "input_digest": item.digest}
    if item.openai:
        return {**_openai_row(res), **where}
    if res.not_started:
        return {"id": item.id, **where, "status": "not_started", "error": res.error}
    if r is None:
        return {"id": item.id, **where, "error": res.error}
    # another engine's reply has only the fields its API reports (`PeerReply.row_fields`)
    fields = result_fields(r) if isinstance(r, GenerationResult) else r.row_fields()
    return {"id": item.id, **where, **fields,
            **({"session": item.session} if item.session else {})}


def _openai_row(res: ItemResult) -> dict[str, Any]:
    item, r = res.item, res.result
    request_id = f"kvchat-{item.line}"
    head = {"id": f"batch_req_{item.line}", "custom_id": item.custom_id}
    if r is None or r.finish_reason not in COMPLETE:
        # OpenAI's format has no "interrupted" reply: an unfinished one is an error row
        code = "not_started" if res.not_started else (
            "interrupted" if r is not None else "request_failed")
        message = res.error or "The reply was interrupted before it finished."
        return {**head, "response": None, "error": {"code": code, "message": message}}
    body = chat_completion(r, f"chatcmpl-{request_id}") if isinstance(r, GenerationResult) \
        else r.response_body()
    return {**head, "response": {"status_code": 200, "request_id": request_id, "body": body},
            "error": None}


def bad_line_row(bad: BadLine) -> dict[str, Any]:
    row: dict[str, Any] = {"id": bad.id or f"line-{bad.line}", "line": bad.line,
                           "input_digest": bad.digest, "error": bad.message}
    if bad.custom_id is not None:
        row = {"id": f"batch_req_{bad.line}", "custom_id": bad.custom_id, "line": bad.line,
               "input_digest": bad.digest, "response": None,
               "error": {"code": "invalid_request", "message": bad.message}}
    return row


def is_complete(row: dict[str, Any]) -> bool:
    """The row holds a finished reply (a resumed run keeps it instead of running its line)."""
    if "custom_id" in row and "response" in row:
        return row.get("error") is None and row.get("response") is not None
    return "error" not in row and row.get("finish_reason") in COMPLETE


def previous_rows(path: Path, items: list[BatchItem]) -> dict[int, dict[str, Any]]:
    """The finished rows of an earlier run's output, by line; refuses (OutputError) when a
    finished row's line has changed since. A torn last line (a SIGKILL) is ignored."""
    if not path.exists():
        return {}
    digests = {item.line: item.digest for item in items}
    kept: dict[int, dict[str, Any]] = {}
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError as exc:
        raise OutputError(f"Cannot read {path} to resume ({exc.strerror or exc}).") from None
    for raw in text.splitlines():
        try:
            row = json.loads(raw)
        except ValueError:
            continue
        if not isinstance(row, dict) or not isinstance(row.get("line"), int):
            continue
        line = row["line"]
        if not is_complete(row):
            kept.pop(line, None)  # a later attempt that did not finish replaces nothing
            continue
        if digests.get(line) != row.get("input_digest"):
            raise OutputError(
                f"{path} has a finished row for input line {line}, but that line is not the "
                "same any more: --resume only continues a run over the same input. Write to "
                "another -o file, or remove the old one, to start over.")
        kept[line] = row
    return kept


class RowWriter:
    """Writes rows as they finish: appended to a file (flushed), or in input order to a stream.
    A file is held for this run alone (`OutputFile`: pass one already held, or a path)."""

    def __init__(self, lines: Iterable[int], path: Path | OutputFile | None,
                 stream: IO[str] | None = None,
                 keep: dict[int, dict[str, Any]] | None = None) -> None:
        self.order = sorted(set(lines))
        self.file = OutputFile.hold(path) if isinstance(path, Path) else path
        self.path = self.file.path if self.file is not None else None
        self.stream = stream
        self.rows: dict[int, dict[str, Any]] = dict(keep or {})
        self._next = 0  # stream mode: index into order of the next row to print
        self._fh: IO[str] | None = self.file.start(bool(keep)) if self.file is not None else None

    def write(self, line: int, row: dict[str, Any]) -> None:
        self.rows[line] = row
        if self._fh is not None:
            self._append(self._fh, [row])
        elif self.stream is not None:
            ready = []
            while self._next < len(self.order) and self.order[self._next] in self.rows:
                ready.append(self.rows[self.order[self._next]])
                self._next += 1
            self._append(self.stream, ready)

    def _append(self, fh: IO[str], rows: list[dict[str, Any]]) -> None:
        try:
            for row in rows:
                fh.write(json.dumps(row, ensure_ascii=False) + "\n")
            fh.flush()
        except BrokenPipeError:
            if self.path is not None:
                raise OutputError(f"Writing {self.path} failed (broken pipe).") from None
            raise OutputClosed("The reader of the output went away.") from None
        except OSError as exc:
            if self.path is None:  # --resume reads a file: there is none to read here
                raise OutputError(
                    f"Writing the output failed ({exc.strerror or exc}) after "
                    f"{len(self.rows) - 1} row(s). Run the command again with -o FILE (every "
                    "line runs again, the finished ones as cache hits) to write the rows to a "
                    "file, which --resume can finish if the run is cut short again.") from None
            raise OutputError(
                f"Writing {self.path} failed ({exc.strerror or exc}) after {len(self.rows) - 1} "
                "row(s). Every row written before is complete: free some space and run the "
                "same command with --resume to finish the rest.") from None

    def close(self) -> None:
        """Rewrite a file in input order (atomically, still holding it) and let go of it, or
        print what the stream still holds."""
        if self.file is not None:
            self._fh = None
            try:
                self._rewrite_sorted(self.file)
            finally:
                self.file.close()
        elif self.stream is not None:
            rest = [self.rows[n] for n in self.order[self._next:] if n in self.rows]
            self._next = len(self.order)
            self._append(self.stream, rest)

    def _rewrite_sorted(self, file: OutputFile) -> None:
        lines = (json.dumps(self.rows[line], ensure_ascii=False) + "\n"
                 for line in sorted(self.rows))
        try:
            file.rewrite(lines)
        except OSError as exc:  # the appended file is still complete, only not in input order
            raise OutputError(
                f"All rows are in {file.path}, but putting them in input order failed "
                f"({exc.strerror or exc}); each row carries its input \"line\".") from None
