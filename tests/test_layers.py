"""No import in `kvchat/` points up a layer. The layers are those `docs/ARCHITECTURE.md` draws,
top to bottom; a module may import its own package and any layer below its own, never one above
nor a neighbour in its own layer. Every import counts: module level, inside functions (how
torch-free commands defer heavy imports) and under `if TYPE_CHECKING:` (a type is a
dependency too)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "kvchat"

LAYERS: tuple[frozenset[str], ...] = tuple(frozenset(names) for names in (
    {"__main__"},               # python -m kvchat
    {"cli"},                    # options and one call per command
    {"targets"},                # where a command runs: this process, a kvchat server, a peer
    {"chat", "server"},         # the REPL and its backends; the HTTP server
    {"ui"},                     # Rich views, pure
    {"batch"},                  # request files through a runner
    {"client", "bench"},        # HTTP clients of servers and peers; the benchmarks
    {"turns", "runtime", "responses", "inspect"},
    {"snapshots", "session_lock", "request_file"},
    {"sessions"},
    {"engine"},                 # scheduler, model runner, decode
    {"models"},                 # loading, families, kernels
    {"cache"},                  # the block pool, radix tree, exact index, eviction
    {"config", "files", "text_input"},
    {"errors", "__init__"},
))


def package_of(module: str) -> str:
    """`kvchat.ui.batch_view` -> "ui"; `kvchat` itself -> "__init__"."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def layer_of(package: str) -> int:
    for depth, names in enumerate(LAYERS):
        if package in names:
            return depth
    raise AssertionError(f"kvchat/{package} is in no layer: place it in LAYERS (and in "
                         "docs/ARCHITECTURE.md)")


def imports() -> list[tuple[str, int, str, str]]:
    """(file, line, importing package, imported package) for every kvchat import."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE.parent)
        own = package_of(".".join(rel.with_suffix("").parts).removesuffix(".__init__"))
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            else:
                continue
            for name in names:
                if name == "kvchat" or name.startswith("kvchat."):
                    found.append((str(rel), node.lineno, own, package_of(name)))
    return found


def test_every_package_has_a_layer_and_the_scan_sees_the_imports():
    packages = {package_of(".".join(p.relative_to(PACKAGE.parent).with_suffix("").parts))
                for p in PACKAGE.rglob("*.py")}
    for package in packages:
        layer_of(package)
    crossing = {(a, b) for _, _, a, b in imports() if a != b}
    # the scan is real: the CLI reaches the targets, the targets the batch runners
    assert ("cli", "targets") in crossing and ("targets", "batch") in crossing
    assert len(crossing) > 50


def test_no_import_points_up_a_layer_or_sideways():
    wrong = [f"{file}:{line}: {own} imports {other}"
             for file, line, own, other in imports()
             if own != other and layer_of(other) <= layer_of(own)]
    assert not wrong, "imports against the layers:\n" + "\n".join(wrong)


@pytest.mark.parametrize("own, other", [("ui", "chat"), ("cache", "engine"),
                                         ("chat", "server"), ("bench", "cli")])
def test_the_rule_refuses_upward_and_sideways_imports(own, other):
    assert layer_of(other) <= layer_of(own)
