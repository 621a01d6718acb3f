"""`kvchat batch`: JSONL request files through the shared cache and the engine.

requests.py parses lines (prompt / messages / OpenAI batch lines), run.py runs them (independent
lines together, session lines in turn), output.py writes one row per line as each finishes, to
the -o file, which output_file.py locks for one run.
"""

from kvchat.batch.output import (
    OutputClosed,
    OutputError,
    OutputFile,
    RowWriter,
    bad_line_row,
    is_complete,
    previous_rows,
    result_row,
)
from kvchat.batch.requests import (
    BadLine,
    BatchItem,
    LineError,
    duplicate_ids,
    parse_line,
    read_batch,
)
from kvchat.batch.run import BatchProgress, BatchRun, ItemResult, SaveFailure

__all__ = [
    "BadLine", "BatchItem", "BatchProgress", "BatchRun", "ItemResult", "LineError",
    "OutputClosed", "OutputError", "OutputFile", "RowWriter", "SaveFailure", "bad_line_row",
    "duplicate_ids", "is_complete", "parse_line", "previous_rows", "read_batch", "result_row",
]
