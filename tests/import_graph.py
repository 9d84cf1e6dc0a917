"""The module import graph of the repository, read from the source (ast, no import runs)."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OURS = ("petals_chain", "server", "orchestrator", "netem", "experiments", "scripts", "tests")


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def all_modules() -> dict[str, Path]:
    return {module_name(p): p for top in OURS for p in sorted((REPO / top).rglob("*.py"))}


def imported_modules(path: Path, modules: dict[str, Path]) -> set[str]:
    """Every module of ours that `path` imports, at module level or inside a function (a function-local
    import that closes a cycle is still a cycle). `from pkg import name` counts `pkg.name` when that is
    a module, else `pkg`; a package counts as its `__init__`."""
    out: set[str] = set()
    me = module_name(path)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name in modules}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                mod = f"{base}.{node.module}" if node.module else base
            else:
                mod = node.module or ""
            for a in node.names:
                if f"{mod}.{a.name}" in modules:
                    out.add(f"{mod}.{a.name}")
                elif mod in modules:
                    out.add(mod)
    out.discard(me)
    return out


def graph() -> dict[str, set[str]]:
    modules = all_modules()
    return {name: imported_modules(path, modules) for name, path in modules.items()}


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:  # iterative would be longer; the graph is ~400 modules deep at most
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in g.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(g):
        if v not in index:
            visit(v)
    return sorted(out)
