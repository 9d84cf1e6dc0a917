"""DESIGN.md's map of who may import whom, checked on the source (ast, no import runs)."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.import_graph import cycles, graph

REPO = Path(__file__).resolve().parents[1]
OURS = {"petals_chain", "server", "orchestrator", "netem", "experiments", "scripts", "tests"}


def imports(path: Path, full: bool = False) -> list[tuple[str, int, bool]]:
    """(top-level package, or with `full` the module, line, at module level) of every absolute import of ours
    in `path`."""
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
        out += [(m if full else m.split(".")[0], n.lineno, id(n) in top) for m in names if m.split(".")[0] in OURS]
    return out


def violations(
    package: str,
    allowed: set[str],
    *,
    skip=lambda p: False,
    lazy_ok=lambda p: False,
    allowed_modules: frozenset[str] = frozenset(),
) -> list[str]:
    bad = []
    for path in sorted((REPO / package).rglob("*.py")):
        rel = path.relative_to(REPO)
        if skip(rel):
            continue
        for module, line, module_level in imports(path, full=True):
            pkg = module.split(".")[0]
            if pkg == package or pkg in allowed or module in allowed_modules or (not module_level and lazy_ok(rel)):
                continue
            bad.append(f"{rel}:{line} imports {pkg}")
    return bad


def test_netem_imports_nothing_of_the_others():
    assert violations("netem", set()) == []


def test_server_imports_only_petals_chain_and_netems_cpu_share_reader():
    # server/ may import petals_chain (and netem's CPU-share reader, which is below everything)
    assert violations("server", {"petals_chain", "netem"}) == []


def test_petals_chain_imports_server_or_orchestrator_only_lazily_in_cli_and_never_netem():
    # the CLI names subcommands as "module:function" strings; a CLI module may import the one it runs;
    # `petals-chain netem` is such a string too, so petals_chain never imports netem (DESIGN.md)
    assert [v for v in violations("petals_chain", set(), lazy_ok=lambda p: False) if v.endswith("imports netem")] == []
    assert violations("petals_chain", {"netem"}, lazy_ok=lambda p: p.parts[:2] == ("petals_chain", "cli")) == []


def test_the_orchestrators_algorithms_import_no_server_and_only_the_cli_helpers_of_petals_chain():
    # algorithms and sim/: numpy, scipy, networkx, netem; its CLI modules share petals_chain/cli/args.py
    # as every CLI does; service/ (the online orchestrator) may use petals_chain's wire and loop helpers
    # and the prefix keys both sides share (pure: the chunk size and a chain's usable prefix)
    assert (
        violations(
            "orchestrator",
            {"netem"},
            skip=lambda p: "service" in p.parts or p.name.endswith("cli_args.py") or p.name.endswith("_cli.py"),
            allowed_modules=frozenset({"petals_chain.wire.prefix_keys"}),
        )
        == []
    )
    assert violations("orchestrator", {"netem", "petals_chain"}) == []


# DESIGN.md's layers inside petals_chain, bottom up: a subpackage may import only those listed (and
# itself). `cli/` is every command's entry point and may import anything.
PETALS_CHAIN_LAYERS = {
    "errors": set(),
    "wire": {"errors"},
    "algorithms": {"errors"},
    "process": {"errors"},
    "models": {"errors"},
    "transport": {"errors", "wire"},
    "swarm": {"errors", "wire", "transport", "process"},
    "runtime": {"errors", "models"},
    "client": {"errors", "wire", "transport", "swarm", "process", "models", "runtime", "algorithms"},
    "api": {"errors", "wire", "client", "models", "runtime", "algorithms", "process"},
}


def _layer(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if parts[0] == "petals_chain" and len(parts) > 1 else None


def test_petals_chain_subpackages_import_only_the_layers_below_them():
    g = graph()
    known = set(PETALS_CHAIN_LAYERS) | {"cli"}
    bad = []
    for module, deps in sorted(g.items()):
        layer = _layer(module)
        if layer is None or layer == "cli":
            continue
        assert layer in known, f"{module}: a new petals_chain subpackage; add it to PETALS_CHAIN_LAYERS and DESIGN.md"
        for dep in sorted(deps):
            dep_layer = _layer(dep)
            if dep.split(".")[0] != "petals_chain":
                continue
            if dep_layer is None or (dep_layer != layer and dep_layer not in PETALS_CHAIN_LAYERS[layer]):
                bad.append(f"{module} imports {dep}")
    assert bad == []


def test_no_module_outside_cli_sits_at_the_top_of_petals_chain():
    # the flat grab bag is gone: only the package's own __init__ and errors.py live at the top
    top = sorted(p.name for p in (REPO / "petals_chain").glob("*.py"))
    assert top == ["__init__.py", "errors.py"]


def test_the_module_import_graph_has_no_cycles():
    assert cycles(graph()) == []


def test_the_cycle_finder_finds_a_cycle_closed_by_a_function_local_import():
    g = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(g) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []
