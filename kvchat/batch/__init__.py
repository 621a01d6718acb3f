"""`kvchat batch`: JSONL request files through the shared cache and the engine.

`kvchat.request_file` parses lines (prompt / messages / OpenAI batch lines); recorder.py is
what every runner shares (each line's result recorded once, in input order); run.py runs them
in this process (independent lines together, session lines in turn), attached.py on a kvchat
server, peer.py on a peer (another OpenAI-compatible engine); output.py writes one row per
line as each finishes, to the -o file, which output_file.py locks for one run. Which runner a
command gets is `kvchat.targets`' choice.
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
from kvchat.batch.recorder import BatchProgress, ItemResult, LineRun, SaveFailure
from kvchat.batch.run import BatchRun
from kvchat.request_file import (
    BadLine,
    BatchItem,
    LineError,
    duplicate_ids,
    parse_line,
    read_batch,
)

__all__ = [
    "BadLine", "BatchItem", "BatchProgress", "BatchRun", "ItemResult", "LineError", "LineRun",
    "OutputClosed", "OutputError", "OutputFile", "RowWriter", "SaveFailure", "bad_line_row",
    "duplicate_ids", "is_complete", "parse_line", "previous_rows", "read_batch", "result_row",
]
