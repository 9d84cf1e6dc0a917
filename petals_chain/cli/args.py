"""What every command-line tool shares: one-line errors, argument types, the top-level guard.

The rule (README "Command-line tools"): bad input gets one clear line on stderr and exit code 2.
`CliParser` makes argparse's own errors one line (no usage block); the value types below refuse a
bad value while arguments are parsed, before anything starts; `run_main` turns what escapes a
command (a typed `PetalsChainError`, a closed pipe, Ctrl-C) into one line and an exit code, so no
traceback reaches a user for something the user caused. A bug still shows its traceback.

Light on purpose: no torch, no hivemind at import (every CLI imports this before parsing).
"""

from __future__ import annotations

import argparse
import math
import os
import re
import sys
from typing import Callable

SIZE_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")  # `--log-level` (type=str.upper)
# `--dtype` of every CLI: the names of runtime/block_range.DTYPES (kept here, torch-free, so parsing a
# command line imports no torch; tests/test_cli_errors.py checks the two agree)
DTYPE_CHOICES = ("float32", "bfloat16", "float16")
EXIT_BAD_INPUT = 2
EXIT_INTERRUPTED = 130  # 128 + SIGINT, what shells report for a Ctrl-C'd command
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE, what `yes | head` reports for `yes`


class CliParser(argparse.ArgumentParser):
    """argparse whose errors are one line on stderr, `PROG: MESSAGE (see PROG --help)`, exit code 2.

    argparse's default prints the whole usage block first (30 lines for launch-server), which
    buries the one line that says what is wrong. Subparsers inherit the class."""

    def error(self, message: str):  # type: ignore[override]
        self.exit(EXIT_BAD_INPUT, f"{self.prog}: {message} (see {self.prog} --help)\n")


def one_line(error: BaseException) -> str:
    """An error's message on one line (some carry a child process's multi-line output)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return " | ".join(lines) if lines else type(error).__name__


def run_main(prog: str, main: Callable[[list[str]], int | None], argv: list[str], *, exit_process: bool = False) -> int:
    """Run a command's `main(argv)`; what the user caused becomes one line on stderr and an exit code.

    `exit_process` (the command runs as its own program, not called from Python): once `main` is
    done, and so every child it started is stopped, leave without the interpreter's teardown. With
    torch loaded that teardown alone took 1.7-6 s on a loaded 2-core machine (C++ destructors, no
    Python frame), and a Ctrl-C'd command must be gone within seconds. DHT children need no atexit
    hook: they end with their parent (`process_signals.ParentBoundDHT`)."""
    code = _run(prog, main, argv)
    if exit_process:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (BrokenPipeError, ValueError):
                pass
        os._exit(code)
    return code


def _run(prog: str, main: Callable[[list[str]], int | None], argv: list[str]) -> int:
    from petals_chain.errors import PetalsChainError  # light: no torch

    try:
        return int(main(argv) or 0)
    except PetalsChainError as e:
        _say(f"{prog}: {one_line(e)}")
        return EXIT_BAD_INPUT
    except BrokenPipeError:
        # `petals-chain plan ... | head`: the reader left; the rest of the output has nowhere to go.
        # Point stdout at /dev/null so the interpreter's final flush does not raise a second time.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_BROKEN_PIPE
    except KeyboardInterrupt:
        _say(f"{prog}: interrupted")
        return EXIT_INTERRUPTED
    except SystemExit as e:  # argparse (--help, bad arguments) and signal handlers that end a command
        if e.code is None or isinstance(e.code, int):
            return e.code or 0
        _say(str(e.code))
        return 1


def _say(line: str) -> None:
    try:
        print(line, file=sys.stderr, flush=True)
    except (BrokenPipeError, ValueError):  # stderr closed too: nothing left to tell
        pass


# -- value types (argparse `type=`): each refuses with a message that says what to pass -------------
def parse_size(text: str) -> int:
    """'2GiB' -> 2147483648; '500MB' -> 500000000; '1048576' -> 1048576."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in SIZE_UNITS:
        raise argparse.ArgumentTypeError(f"bad size {text!r}: use e.g. 2GiB, 512MiB, 1.5GB or a byte count")
    value = int(float(m.group(1)) * SIZE_UNITS[m.group(2).lower()])
    if value <= 0:
        raise argparse.ArgumentTypeError(f"size must be positive, got {text!r}")
    return value


def positive_int(text: str) -> int:
    return _whole_number(text, 1)


def non_negative_int(text: str) -> int:
    return _whole_number(text, 0)


def _whole_number(text: str, least: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < least:
        raise argparse.ArgumentTypeError(f"must be >= {least}, got {value}")
    return value


def positive_float(text: str) -> float:
    return _checked_float(text, lambda v: v > 0, "must be a positive number")


def non_negative_float(text: str) -> float:
    return _checked_float(text, lambda v: v >= 0, "must be >= 0")


def probability(text: str) -> float:
    """A probability mass such as top-p: in (0, 1]."""
    return _checked_float(text, lambda v: 0 < v <= 1, "must lie in (0, 1]")


def unit_interval(text: str) -> float:
    """A chance or share in [0, 1] (0: never)."""
    return _checked_float(text, lambda v: 0 <= v <= 1, "must lie in [0, 1]")


def _checked_float(text: str, ok: Callable[[float], bool], requirement: str) -> float:
    value = _finite_float(text)
    if not ok(value):
        raise argparse.ArgumentTypeError(f"{requirement}, got {text!r}")
    return value


def _finite_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


def _multiaddr_class():
    """hivemind's vendored multiaddr parser, loaded on its own: `import hivemind.utils.multiaddr` runs
    hivemind's package __init__, which imports torch and everything else (3-4 s of CPU), and a
    bad-address error should come back at once. The vendored package imports only itself and small
    libraries (base58, varint, netaddr, idna, cid), so it loads standalone under a private name."""
    import importlib.util

    name = "_petals_chain_multiaddr"
    if name not in sys.modules:
        spec = importlib.util.find_spec("hivemind")
        folder = os.path.join(os.path.dirname(spec.origin), "utils", "multiaddr")
        spec = importlib.util.spec_from_file_location(
            name, os.path.join(folder, "__init__.py"), submodule_search_locations=[folder]
        )
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name].Multiaddr


def listen_maddr(text: str) -> str:
    """A multiaddr to listen on, e.g. /ip4/0.0.0.0/tcp/31337 (checked here, not by the p2p daemon's 30 lines)."""
    Multiaddr = _multiaddr_class()
    try:
        Multiaddr(text)
    except Exception as e:
        raise argparse.ArgumentTypeError(f"bad multiaddr {text!r} ({e}); use e.g. /ip4/0.0.0.0/tcp/31337") from None
    return text


def peer_maddr(text: str) -> str:
    """A DHT peer's full multiaddr, ending in /p2p/PEERID (what `petals-chain dht` prints)."""
    Multiaddr = _multiaddr_class()

    try:
        if "/p2p/" not in str(Multiaddr(text)):
            raise ValueError("no /p2p/PEERID part")
    except Exception as e:
        raise argparse.ArgumentTypeError(
            f"bad peer address {text!r} ({e}); pass the full multiaddr printed by `petals-chain dht`, "
            "e.g. /ip4/127.0.0.1/tcp/31337/p2p/QmXXXX..."
        ) from None
    return text


def identity_path(text: str) -> str:
    """`--identity-path F`: an existing identity file, or a new one in an existing, writable folder
    (checked before anything loads; the file itself is read or made by `SwarmIdentity`)."""
    path = os.path.abspath(os.path.expanduser(text))
    if os.path.isdir(path):
        raise argparse.ArgumentTypeError(f"{text!r} is a folder; pass a file, e.g. {os.path.join(text, 'peer.id')}")
    if os.path.exists(path):
        return text
    folder = os.path.dirname(path)
    if not os.path.isdir(folder):
        raise argparse.ArgumentTypeError(
            f"no folder {folder!r} to make the identity file {text!r} in; create the folder or pick another path"
        )
    if not os.access(folder, os.W_OK):
        raise argparse.ArgumentTypeError(f"cannot write the identity file {text!r}: folder {folder!r} is not writable")
    return text
