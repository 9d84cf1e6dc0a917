"""DESIGN.md's map of who may import whom, checked on the source (ast, no import runs)."""
from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OURS = {"petals_chain", "server", "orchestrator", "netem", "experiments", "scripts", "tests"}


def imports(path: Path) -> list[tuple[str, int, bool]]:
    """(top-level package, line, at module level) of every absolute import of ours in `path`."""
    tree = ast.parse(path.read_text(), str(path))
    top = {id(n) for n in tree.body}
    for n in tree.body:  # `if TYPE_CHECKING:` / try blocks at module level count as module level
        if isinstance(n, (ast.If, ast.Try)):
            top |= {id(m) for m in ast.walk(n)}
    out = []
    for n in ast.walk(tree):
        if isinstance(n, ast.Import):
            names = [a.name for a in n.names]
        elif isinstance(n, ast.ImportFrom) and n.level == 0 and n.module:
            names = [n.module]
        else:
            continue
        out += [(m.split(".")[0], n.lineno, id(n) in top) for m in names if m.split(".")[0] in OURS]
    return out


def violations(package: str, allowed: set[str], *, skip=lambda p: False,
               lazy_ok=lambda p: False) -> list[str]:
    bad = []
    for path in sorted((REPO / package).rglob("*.py")):
        rel = path.relative_to(REPO)
        if skip(rel):
            continue
        for pkg, line, module_level in imports(path):
            if pkg == package or pkg in allowed or (not module_level and lazy_ok(rel)):
                continue
            bad.append(f"{rel}:{line} imports {pkg}")
    return bad


def test_netem_imports_nothing_of_the_others():
    assert violations("netem", set()) == []


def test_server_imports_only_petals_chain_and_netems_cpu_share_reader():
    # server/ may import petals_chain (and netem's CPU-share reader, which is below everything)
    assert violations("server", {"petals_chain", "netem"}) == []


def test_petals_chain_imports_server_or_orchestrator_only_lazily_in_its_cli_modules_and_never_netem():
    # the CLI names subcommands as "module:function" strings; a CLI module may import the one it runs;
    # `petals-chain netem` is such a string too, so petals_chain never imports netem (DESIGN.md)
    assert [v for v in violations("petals_chain", set(), lazy_ok=lambda p: False) if v.endswith("imports netem")] == []
    assert violations("petals_chain", {"netem"}, lazy_ok=lambda p: p.name == "cli.py" or p.name.endswith("_cli.py")) == []


def test_the_orchestrators_algorithms_import_no_server_and_only_the_cli_helpers_of_petals_chain():
    # algorithms and sim/: numpy, scipy, networkx, netem; its CLI modules share petals_chain/cli_args.py
    # as every CLI does; service/ (the online orchestrator) may use petals_chain's wire and loop helpers
    assert violations("orchestrator", {"netem"}, skip=lambda p: "service" in p.parts or p.name.endswith("cli_args.py")
                      or p.name.endswith("_cli.py")) == []
    assert violations("orchestrator", {"netem", "petals_chain"}) == []
