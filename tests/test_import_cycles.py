"""No runtime import circle in `kvchat/`: every module is parsed (never imported), the imports
it makes at module level are followed (those under `if TYPE_CHECKING:` are left aside: they
never run), and any loop among them fails the test with the modules that form it.

Function-local imports are how torch-free commands defer heavy imports, so the first test does
not follow them; the second holds them to that: with them followed too, the graph still has no
loop (a function-local import that closes one is an import dodging a circle).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "kvchat"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _module_level(body: list[ast.stmt]) -> Iterator[ast.stmt]:
    """Statements that run when the module is imported (not inside functions or classes'
    methods, not under TYPE_CHECKING)."""
    for stmt in body:
        if isinstance(stmt, ast.If):
            if not _is_type_checking(stmt.test):
                yield from _module_level(stmt.body)
            yield from _module_level(stmt.orelse)
        elif isinstance(stmt, ast.Try):
            for part in (stmt.body, stmt.orelse, stmt.finalbody,
                         *(h.body for h in stmt.handlers)):
                yield from _module_level(part)
        elif isinstance(stmt, (ast.With, ast.ClassDef)):
            yield from _module_level(stmt.body)
        else:
            yield stmt


def _function_level(tree: ast.Module) -> Iterator[ast.stmt]:
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for inner in ast.walk(node):
                if isinstance(inner, (ast.Import, ast.ImportFrom)):
                    yield inner


def _targets(stmt: ast.stmt, name: str, known: dict[str, Path]) -> Iterator[str]:
    """The kvchat modules an import statement of module `name` loads."""
    if isinstance(stmt, ast.Import):
        for alias in stmt.names:
            if alias.name in known:
                yield from _with_packages(alias.name, name, known)
    elif isinstance(stmt, ast.ImportFrom):
        if stmt.level:
            package = name if known[name].name == "__init__.py" else name.rpartition(".")[0]
            for _ in range(stmt.level - 1):
                package = package.rpartition(".")[0]
            base = f"{package}.{stmt.module}" if stmt.module else package
        else:
            base = stmt.module or ""
        if base not in known:
            return
        for alias in stmt.names:
            sub = f"{base}.{alias.name}"
            yield from _with_packages(sub if sub in known else base, name, known)


def _with_packages(target: str, importer: str, known: dict[str, Path]) -> Iterator[str]:
    """`target` and the packages above it that importing it runs first (their __init__),
    except those the importer lives in: they are being imported already."""
    yield target
    package = target.rpartition(".")[0]
    while package:
        if package in known and not (importer + ".").startswith(package + "."):
            yield package
        package = package.rpartition(".")[0]


def import_graph(function_level: bool = False) -> dict[str, set[str]]:
    known = modules()
    graph: dict[str, set[str]] = {}
    for name, path in known.items():
        tree = ast.parse(path.read_text(), str(path))
        stmts = _function_level(tree) if function_level else _module_level(tree.body)
        graph[name] = {t for s in stmts for t in _targets(s, name, known) if t != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            nxt = next(edges, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = counter
                    counter += 1
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph.get(nxt, ())))))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                part = []
                while True:
                    top = stack.pop()
                    on_stack.discard(top)
                    part.append(top)
                    if top == node:
                        break
                if len(part) > 1:
                    found.append(sorted(part))
    return found


def test_the_walk_sees_the_package() -> None:
    graph = import_graph()
    assert "kvchat.cache.kvcache" in graph and "kvchat.cli.app" in graph
    assert "kvchat.cache.blocks" in graph["kvchat.cache.kvcache"]


def test_cycles_finds_a_loop() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_runtime_import_cycle() -> None:
    found = cycles(import_graph())
    assert not found, "import circles: " + "; ".join(" <-> ".join(c) for c in found)


def test_no_function_local_import_dodges_a_cycle() -> None:
    graph = import_graph()
    for name, local in import_graph(function_level=True).items():
        graph[name] |= local
    found = cycles(graph)
    assert not found, ("circles closed by function-local imports: "
                       + "; ".join(" <-> ".join(c) for c in found))
