"""The `kvchat` command line: parse options, call the library, render the result.

app.py holds the Typer app and how errors reach the user; options.py the option families
shared by commands; each command is a module of its own that registers itself on the app.
"""

from kvchat.cli import (  # noqa: F401 (register)
    batch,
    chat,
    detach,
    inspect_cmd,
    models,
    serve,
    verify,
)
from kvchat.cli.app import app, main
from kvchat.cli.options import reflow, reflow_help


def _add_bench() -> None:
    from kvchat.cli.bench import bench_app

    app.add_typer(bench_app, name="bench")


_add_bench()
reflow_help(app)

__all__ = ["app", "main", "reflow"]
