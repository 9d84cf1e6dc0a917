"""Bad input on every command: one line on stderr, exit code 2, no traceback, nothing started.

Each case runs the real entry point as a user would (a subprocess: what reaches the terminal is
what is checked, hivemind's and torch's own output included). Most cases are refused while the
arguments are parsed, before torch or hivemind load; the few that need the model's config say so.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from petals_chain.cli.main import SUBCOMMANDS

REPO = Path(__file__).resolve().parents[1]
# a well-formed peer address nobody listens on (the peer id is a real one's format: Qm...)
PEER = "/ip4/127.0.0.1/tcp/1/p2p/QmW91aaAN3fKnU9CDMMrWLyRmaiaBFqwKKgqDTm6LaWpUc"
NO_DIR_ID = "/nonexistent-petals-chain-dir/x.id"
PC = [sys.executable, "-m", "petals_chain.cli"]
LS = [sys.executable, "-m", "server.cli"]

# (argv, a phrase the one line must contain). The cases and their siblings, per command.
CASES = [
    # generate
    (PC + ["generate", "--local-ranges", "0:10,12:30"], "should start at 10"),
    (PC + ["generate", "--local-ranges", "0:10,x"], "bad block range"),
    (PC + ["generate", "--sample", "--temperature", "-1"], "--temperature: must be a positive number"),
    (PC + ["generate", "--sample", "--temperature", "0"], "--temperature: must be a positive number"),
    (PC + ["generate", "--repetition-penalty", "0"], "--repetition-penalty: must be a positive number"),
    (PC + ["generate", "--top-p", "5"], "--top-p: must lie in (0, 1]"),
    (PC + ["generate", "--top-p", "nan"], "--top-p: expected a finite number"),
    (PC + ["generate", "--max-new-tokens", "0"], "--max-new-tokens: must be >= 1"),
    (PC + ["generate", "--initial-peers", "garbage"], "bad peer address 'garbage'"),
    (PC + ["generate", "--identity-path", NO_DIR_ID], "no folder"),
    (PC + ["generate", "--dtype", "float8"], "invalid choice"),
    # chat
    (PC + ["chat", "--top-p", "5"], "--top-p: must lie in (0, 1]"),
    (PC + ["chat", "--max-length", "0"], "--max-length: must be >= 1"),
    (PC + ["chat", "--identity-path", NO_DIR_ID], "no folder"),
    # convert
    (PC + ["convert", "--mdoel", "x"], "unrecognized arguments: --mdoel"),
    # dht
    (PC + ["dht", "--host-maddrs", "garbage"], "bad multiaddr 'garbage'"),
    (PC + ["dht", "--initial-peers", "garbage"], "bad peer address"),
    (PC + ["dht", "--initial-peers", "/ip4/127.0.0.1/tcp/5"], "no /p2p/PEERID part"),
    (PC + ["dht", "--identity-path", NO_DIR_ID], "no folder"),
    # launch-server
    (LS, "the following arguments are required: --initial-peers"),
    (LS + ["--initial-peers", "garbage"], "bad peer address"),
    (LS + ["--initial-peers", PEER, "--host-maddrs", "garbage"], "bad multiaddr"),
    (LS + ["--initial-peers", PEER, "--host-maddrs", "/ip4/1.2.3.4/tcp/99999"], "bad multiaddr"),
    (LS + ["--initial-peers", PEER, "--memory-budget", "abc"], "bad size 'abc'"),
    (LS + ["--initial-peers", PEER, "--blocks", "5:3"], "bad --blocks"),
    (LS + ["--initial-peers", PEER, "--max-length", "0"], "--max-length: must be >= 1"),
    (LS + ["--initial-peers", PEER, "--num-threads", "0"], "--num-threads: must be >= 1"),
    (LS + ["--initial-peers", PEER, "--identity-path", NO_DIR_ID], "no folder"),
    (LS + ["--initial-peers", PEER, "--no-orchestrator"], "--no-orchestrator needs --blocks"),
    (LS + ["--initial-peers", PEER, "--num-blocks", "0"], "--num-blocks: must be >= 1"),
    (LS + ["--initial-peers", PEER, "--num-blocks", "3", "--blocks", "0:3"], "not both"),
    (LS + ["--initial-peers", PEER, "--num-blocks", "3", "--balance-quality", "0"], "--balance-quality: must lie in"),
    (LS + ["--initial-peers", PEER, "--log-level", "chatty"], "--log-level: invalid choice: 'CHATTY'"),
    # orchestrator
    (PC + ["orchestrator", "--initial-peers", "garbage"], "bad peer address"),
    (PC + ["orchestrator", "--initial-peers", PEER, "--host-maddrs", "garbage"], "bad multiaddr"),
    (PC + ["orchestrator", "--initial-peers", PEER, "--rho", "2"], "--rho must lie in (0, 1)"),
    (PC + ["orchestrator", "--initial-peers", PEER, "--expected-servers", "-1"], "must be >= 0"),
    (PC + ["orchestrator", "--initial-peers", PEER, "--http-port", "70000"], "--http-port must be in"),
    (
        PC + ["orchestrator", "--initial-peers", PEER, "--chain-quantum-sessions", "0"],
        "--chain-quantum-sessions: must be a positive number",
    ),
    # plan, simulate
    (PC + ["plan", "--cluster", "/nonexistent.json"], "cannot read /nonexistent.json"),
    (PC + ["plan", "--cluster", "examples/cluster.json", "--c", "0"], "--c: must be >= 1"),
    (PC + ["simulate", "--cluster", "examples/cluster.json", "--jobs", "0"], "--jobs"),
    # demo: refused before anything starts
    (PC + ["demo", "--budgets", "abc"], "bad size 'abc'"),
    (PC + ["demo", "--budgets", ","], "no budget"),
    (PC + ["demo", "--servers", "0"], "--servers: must be >= 1"),
    (PC + ["demo", "--sessions", "-1"], "--sessions: must be >= 0"),
    # api
    # (api: a bad --initial-peers is tests/test_api_units.py's, in-process)
    (PC + ["api", "--initial-peers", PEER, "--port", "70000"], "--port must be in 0..65535"),
    # identity, experiment, netem, the umbrella
    (PC + ["identity", "show", "/nonexistent.id"], "no file /nonexistent.id"),
    (PC + ["identity", "new"], "the following arguments are required: path"),
    (PC + ["identity", "new", NO_DIR_ID], "no folder"),
    (PC + ["experiment", "table1", "--requests", "0"], "need --requests >= 1"),
    (PC + ["experiment", "table9"], "unknown experiment 'table9'"),
    (PC + ["netem", "sideways"], "invalid choice"),
    (PC + ["bogus"], "unknown subcommand 'bogus'"),
]


def run_cli(argv: list[str], timeout_s: float = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, cwd=REPO, env=env)


def assert_one_line(proc: subprocess.CompletedProcess, phrase: str) -> None:
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    assert len(lines) == 1, proc.stderr
    assert phrase in lines[0] and "Traceback" not in proc.stderr, proc.stderr


@pytest.mark.parametrize(
    "argv, phrase", CASES, ids=[" ".join(a[3 if a[:3] == PC else 2 :]) or "launch-server" for a, _ in CASES]
)
def test_bad_input_is_one_line_and_exit_2(argv, phrase):
    proc = run_cli(argv)
    assert_one_line(proc, phrase)
    assert "starting a local swarm" not in proc.stdout  # demo: refused before anything started


def test_umbrella_lists_the_cli_cases():
    """Every subcommand of `petals-chain` has at least one bad-input case above (new ones too)."""
    covered = {argv[3] for argv, _ in CASES if argv[:3] == PC}
    assert set(SUBCOMMANDS) <= covered, set(SUBCOMMANDS) - covered


def test_plan_into_a_closed_pipe_is_quiet():
    """`petals-chain plan ... | head -1`: the reader leaves early; no BrokenPipeError traceback."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        f"{sys.executable} -m petals_chain.cli plan --cluster examples/cluster.json --table | head -1",
        shell=True,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
        env=env,
    )
    assert proc.stdout.strip() == "{" and proc.stderr == "", proc.stderr


@pytest.mark.model
def test_model_dependent_refusals_are_one_line():
    """Checks that need the model (torch, its config): a model that is not there, ranges past its
    last block, budgets that cannot hold it."""
    assert_one_line(run_cli(PC + ["convert", "--model", "/nonexistent"]), "neither an embedded model")
    assert_one_line(
        run_cli(PC + ["generate", "--local-ranges", "0:10,10:40"]), "do not tile the model's blocks [0, 30)"
    )
    proc = run_cli(PC + ["demo", "--budgets", "10MiB,10MiB"])
    assert_one_line(proc, "cannot hold one block")
    assert "starting a local swarm" not in proc.stdout
    assert_one_line(run_cli(PC + ["demo", "--budgets", "20MiB"]), "hold 1 of the model's 30 blocks")


# every parser a user reaches by `--help`: the umbrella's subcommands, their own subcommands, launch-server
HELP_PATHS = [[name] for name in SUBCOMMANDS if name != "experiment"] + [  # experiment: a list, no options
    ["experiment", "table1"],
    ["netem", "up"],
    ["netem", "exec"],
    ["netem", "status"],
    ["netem", "down"],
    ["identity", "new"],
    ["identity", "show"],
    ["launch-server"],
]


def _parser(path: list[str], monkeypatch):
    """The argparse parser `--help` of `petals-chain PATH...` (or `launch-server`) would print: caught
    as the command parses its arguments, before anything runs."""
    import argparse
    import importlib

    class Caught(Exception):
        pass

    def catch(parser, args=None, namespace=None):
        raise Caught(parser)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_known_args", catch)
    target = "server.cli:main" if path[0] == "launch-server" else SUBCOMMANDS[path[0]][0]
    module, func = target.split(":")
    with pytest.raises(Caught) as caught:
        getattr(importlib.import_module(module), func)([*path[1:], "--help"] if path[0] == "experiment" else ["--help"])
    monkeypatch.undo()
    parser = caught.value.args[0]
    for name in path[1:]:
        if path[0] != "experiment":  # experiment dispatches by itself; the others use subparsers
            (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
            parser = sub.choices[name]
    return parser


@pytest.mark.parametrize("path", HELP_PATHS, ids=" ".join)
def test_every_option_has_help_text(path, monkeypatch):
    """`--help` explains every option (a bare `--dtype {float32,bfloat16}` line leaves the user guessing)."""
    parser = _parser(path, monkeypatch)
    bare = [a.option_strings[-1] for a in parser._actions if a.option_strings and not a.help]
    assert not bare, f"petals-chain {' '.join(path)}: options without help text: {bare}"


def _readme_command_rows() -> dict[tuple[str, ...], str]:
    """{command path: its usage cell} of the command tables of docs/reference.md, where every command's
    full usage lives (`| `petals-chain plan --cluster ...` | ...`); the README's table links there."""
    import re

    rows = {}
    for line in (REPO / "docs" / "reference.md").read_text(encoding="utf-8").splitlines():
        m = re.match(r"\| `(petals-chain [a-z0-9]+(?: (?:up|exec|status|down|table1))?|launch-server)(?=[ `])", line)
        if m:
            cell = re.split(r"(?<!\\)\|", line)[1]
            path = tuple(m.group(1).split()[1:]) or ("launch-server",)
            rows.setdefault(path, cell)  # the Command-line tools table comes first
    return rows


def test_readme_command_rows_list_exactly_the_options_of_help(monkeypatch):
    """Each command's row in docs/reference.md names every option its `--help` has, and no other."""
    import re

    rows = _readme_command_rows()
    assert {("launch-server",), ("generate",), ("experiment", "table1"), ("netem", "up")} <= set(rows), set(rows)
    problems = []
    for path, cell in sorted(rows.items()):
        parser = _parser(list(path), monkeypatch)
        actions = [
            a
            for a in parser._actions
            if any(o.startswith("--") for o in a.option_strings) and "--help" not in a.option_strings
        ]
        named = set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", cell))
        known = {o for a in actions for o in a.option_strings}
        missing = [a.option_strings[-1] for a in actions if not named & set(a.option_strings)]
        unknown = sorted(named - known)
        if missing or unknown:
            problems.append(f"{' '.join(path)}: not in the README row {missing}, not in --help {unknown}")
    assert not problems, "\n".join(problems)


def test_dtype_choices_are_the_runtime_dtypes():
    """Every CLI's `--dtype` offers exactly what the block runtime and the wire carry (the choices live
    torch-free in cli_args, so a command line parses without importing torch)."""
    from petals_chain.cli.args import DTYPE_CHOICES
    from petals_chain.runtime.block_range import DTYPES
    from petals_chain.wire.parts import RAW_DTYPES

    assert set(DTYPE_CHOICES) == set(DTYPES)
    assert set(DTYPE_CHOICES) <= set(RAW_DTYPES)
