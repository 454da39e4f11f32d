"""The package's import structure: the library never imports its command line, and no two
modules import each other (directly or around a loop), at module level or inside functions."""

import ast
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "lightrft"


def module_files() -> dict[str, Path]:
    files = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return files


def imports_of(path: Path, known: dict[str, Path]) -> set[str]:
    """The lightrft modules `path` imports anywhere in its body (lazy imports included)."""
    def owner(name: str) -> str:
        while name and name not in known:
            name = name.rpartition(".")[0]
        return name

    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {owner(alias.name) for alias in node.names if alias.name.startswith("lightrft")}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("lightrft"):
            found.add(owner(node.module))
            found |= {f"{node.module}.{alias.name}" for alias in node.names if f"{node.module}.{alias.name}" in known}
    return found - {"", "lightrft"}


def import_graph() -> dict[str, set[str]]:
    known = module_files()
    return {name: imports_of(path, known) - {name} for name, path in known.items()}


def test_no_library_module_imports_the_command_line():
    graph = import_graph()
    offenders = {name: sorted(d for d in deps if d == "lightrft.cli" or d.startswith("lightrft.cli."))
                 for name, deps in graph.items() if not name.startswith("lightrft.cli")}
    assert {name: deps for name, deps in offenders.items() if deps} == {}
    # The walk sees the imports it should: the command line does import the builders.
    assert "lightrft.builders.ppo_run" in graph["lightrft.cli.train_ppo"]


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every loop a depth-first walk of `graph` closes, as the path around it."""
    cycles = []
    state: dict[str, int] = {}          # 1: on the current path, 2: done
    path: list[str] = []

    def visit(name: str) -> None:
        state[name] = 1
        path.append(name)
        for dep in sorted(graph.get(name, ())):
            if state.get(dep) == 1:
                cycles.append(path[path.index(dep):] + [dep])
            elif dep in graph and dep not in state:
                visit(dep)
        path.pop()
        state[name] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name)
    return cycles


def test_no_import_cycles():
    assert find_cycles(import_graph()) == []


def test_a_planted_cycle_is_found(tmp_path, monkeypatch):
    """The walk itself: two modules importing each other inside functions form a cycle."""
    (tmp_path / "lightrft").mkdir()
    (tmp_path / "lightrft" / "__init__.py").write_text("")
    (tmp_path / "lightrft" / "a.py").write_text("def f():\n    from lightrft.b import g\n")
    (tmp_path / "lightrft" / "b.py").write_text("def g():\n    import lightrft.a\n")
    (tmp_path / "lightrft" / "c.py").write_text("from lightrft import a\n")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", tmp_path / "lightrft")
    graph = import_graph()
    assert graph == {"lightrft": set(), "lightrft.a": {"lightrft.b"}, "lightrft.b": {"lightrft.a"},
                     "lightrft.c": {"lightrft.a"}}
    assert find_cycles(graph) == [["lightrft.a", "lightrft.b", "lightrft.a"]]
