"""`petals-chain` umbrella CLI.

Subcommands live in the package that owns them; this table names them as "module:function"
strings and imports only the one that runs, so `petals_chain` never imports `orchestrator` or
`server` at module level (the layering of DESIGN.md) and `petals-chain --help` stays fast.
Each target is `main(argv: list[str]) -> int`.
"""

from __future__ import annotations

import importlib
import sys

from petals_chain.cli.args import run_main

SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("petals_chain.cli.demo:main", "start a local private swarm and generate through it"),
    "generate": ("petals_chain.cli.generate:main", "generate text locally through block ranges or through a swarm"),
    "chat": (
        "petals_chain.cli.chat:main",
        "chat in the terminal through a swarm (or in-process): history, streaming, /clear",
    ),
    "api": ("petals_chain.cli.api:main", "serve the OpenAI API (completions, chat, streaming) over a swarm"),
    "dht": ("petals_chain.cli.dht:main", "start a bootstrap DHT peer and print its multiaddr"),
    "identity": (
        "petals_chain.cli.identity:main",
        "make a peer identity file (stable peer id, signs DHT records) or show its peer id",
    ),
    "convert": ("petals_chain.cli.convert:main", "convert the embedded GGUF model into the local cache"),
    "plan": ("orchestrator.plan_cli:main", "plan block placement and chains for a cluster JSON (GBP-CR + GCA)"),
    "orchestrator": ("orchestrator.service.cli:main", "run the online orchestrator (GBP-CR + GCA + JFFC) for a swarm"),
    "simulate": ("orchestrator.sim.cli:main", "run the discrete-event simulator on a cluster"),
    "netem": ("netem.cli:main", "emulated WAN on this host: up | exec HOST -- CMD | status [--json] | down"),
    "experiment": ("experiments.cli:main", "run an experiment on a live swarm: table1 (the paper's Table 1)"),
}


def _usage() -> str:
    width = max(len(n) for n in SUBCOMMANDS)
    lines = [
        "usage: petals-chain SUBCOMMAND [options]   (petals-chain SUBCOMMAND --help for details)",
        "",
        "subcommands:",
    ]
    for name, (_, help_text) in SUBCOMMANDS.items():
        lines.append(f"  {name.ljust(width)}  {help_text}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """`argv=None`: run as the `petals-chain` program (exits the process when done, see `run_main`)."""
    as_program = argv is None
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in SUBCOMMANDS:
        print(f"petals-chain: unknown subcommand {name!r}; `petals-chain --help` lists them", file=sys.stderr)
        return 2
    module_name, func_name = SUBCOMMANDS[name][0].split(":")
    func = getattr(importlib.import_module(module_name), func_name)
    return run_main(f"petals-chain {name}", func, rest, exit_process=as_program)


if __name__ == "__main__":
    sys.exit(main())
