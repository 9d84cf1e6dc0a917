"""The README's code blocks, run as written.

Every ```bash / ```python block a user would run carries a marker line `<!-- readme-test: NAME -->`
just above it (invisible on GitHub), in the README and in the docs its text moved to (DOCS:
docs/reference.md, docs/benchmarks.md). `test_every_runnable_block_is_accounted_for` keeps this file
in step with them: a new or renamed block fails it until it is run here (RUN) or named with the
test that covers it and why it is not run verbatim (COVERED_ELSEWHERE: root, hours, the suite
itself). The blocks in RUN are read from the files at test time, so what runs is what they say.

Run as written, with two substitutions a shared test machine needs, nothing else: the fixed ports
(31337, 8000) become free ones, and the commands run in a scratch folder whose `.venv` is this
interpreter's environment (so `.venv/bin/...` are the entry points of the code under test).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
DOCS = (README, REPO / "docs" / "reference.md", REPO / "docs" / "benchmarks.md")  # files with marked blocks
FENCE = re.compile(r"<!-- readme-(test|output): ([a-z0-9-]+) -->\n```(\w*)\n(.*?)\n```", re.S)
ANY_BLOCK = re.compile(r"^```(\w*)\n", re.M)

RUN = {  # executed by a test in this file
    "plan": "test_plan_block_prints_the_shown_output",
    "local-swarm": "test_readme_walkthrough",
    "api-gateway": "test_readme_walkthrough",
    "api-openai": "test_readme_walkthrough",
    "api-ollama": "test_readme_walkthrough",
    "api-ollama-python": "test_readme_walkthrough",
    "client-library": "test_readme_walkthrough",
    "private-swarm": "test_readme_walkthrough",
}
COVERED_ELSEWHERE = {  # not run verbatim here: where the same commands are tested, and why
    "quickstart": "make demo = `petals-chain demo` (tests/test_demo.py, fewer tokens); make test is this suite",
    "chat-local": "`chat` is interactive: tests/test_chat.py types into it on a pseudo-terminal; `generate` "
    "without peers (in-process blocks of SmolLM2): tests/test_speculative.py's CLI test",
    "gpu-host": "needs a CUDA GPU: tests/test_cuda.py (skips without one) runs servers and clients with --device cuda",
    "swarm-across-hosts": "a multi-host template (A.A.A.A); the same commands on one host: "
    "tests/test_online_orchestrator.py",
    "reproduce-paper": "minutes to 15 min; its --quick path: tests/test_sim_cli.py's smoke run of "
    "scripts/reproduce_paper.py",
    "netem-steps": "needs root (network namespaces): tests/test_netem_swarm.py runs the same swarm on emulated hosts",
    "netem-python": "needs root: tests/test_netem_emulation.py drives netem.Network the same way",
    "table1": "minutes to hours: tests/test_table1_quick.py runs `experiment table1 --quick`'s path on a small scale",
    "speculative": "continues the client-library snippet (its model, ids; a draft model): tests/test_speculative.py "
    "and tests/test_speculative_live.py run these calls",
    "table1-gpu": "needs a CUDA GPU and hours; the same driver on CPU: tests/test_table1_quick.py",
    "adapters-server": "a template over the user's checkpoint and LoRA folders: tests/test_lora_live.py serves "
    "tiny checkpoints with LoRA adapters through launch-server --adapters",
    "adapters-client": "the client side of the same: tests/test_lora_live.py",
    "bench-fairness": "a benchmark (15 min); not part of the suite",
    "bench-fairness-prefix": "a benchmark (6 min); not part of the suite",
}


def readme_blocks() -> dict[tuple[str, str], tuple[str, str]]:
    """{(kind, name): (language, text)} of the marked blocks of the README and DOCS (names unique across them)."""
    blocks = {}
    for path in DOCS:
        for kind, name, lang, text in FENCE.findall(path.read_text(encoding="utf-8")):
            assert (kind, name) not in blocks, f"two blocks are marked readme-{kind}: {name} (one in {path.name})"
            blocks[(kind, name)] = (lang, text)
    return blocks


def test_every_runnable_block_is_accounted_for():
    unmarked = []
    for path in DOCS:
        text = path.read_text(encoding="utf-8")
        runnable = [m for m in ANY_BLOCK.finditer(text) if m.group(1) in ("bash", "sh", "python", "console")]
        marked = {m.start() for m in FENCE.finditer(text)}
        unmarked += [
            f"{path.name}: {text[m.start() :].splitlines()[1]}"
            for m in runnable
            if not any(0 <= m.start() - start < 80 for start in marked)
        ]
    assert not unmarked, (
        "blocks without a `<!-- readme-test: NAME -->` line above them (add one, and run "
        f"the block in tests/test_readme.py or list it in COVERED_ELSEWHERE): {unmarked}"
    )
    names = {name for kind, name in readme_blocks() if kind == "test"}
    assert names == set(RUN) | set(COVERED_ELSEWHERE), names ^ (set(RUN) | set(COVERED_ELSEWHERE))
    assert not set(RUN) & set(COVERED_ELSEWHERE)


def test_the_readme_is_a_guide_not_a_notebook():
    """Measurement history lives in docs/benchmarks.md and docs/results.md: the README shows each
    figure once, without dates or the load average it was measured at."""
    text = README.read_text(encoding="utf-8")
    dated = [line for line in text.splitlines() if re.search(r"\b20\d\d-\d\d-\d\d\b", line)]
    assert not dated, f"dated lines in the README (move them to docs/benchmarks.md): {dated}"
    loads = [line for line in text.splitlines() if re.search(r"\bload (average )?~?\d", line, re.I)]
    assert not loads, f"load averages in the README (move them to docs/benchmarks.md): {loads}"


def test_plan_block_prints_the_shown_output(tmp_path):
    blocks = readme_blocks()
    _, command = blocks[("test", "plan")]
    _, shown = blocks[("output", "plan")]
    proc = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", command],
        cwd=_scratch(tmp_path),
        env=_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == json.loads(shown)


def _scratch(tmp_path: Path) -> Path:
    """A folder laid out like a checkout after `make`: examples/ and .venv/ (this interpreter's env)."""
    work = tmp_path / "repo"
    work.mkdir(exist_ok=True)
    if not (work / "examples").exists():
        shutil.copytree(REPO / "examples", work / "examples")
        (work / ".venv").symlink_to(Path(sys.prefix))
    return work


def _env() -> dict[str, str]:
    # PYTHONPATH first: the entry points of .venv/bin import the code under test (this checkout)
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
        "PYTHONUNBUFFERED": "1",
    }


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.integration
@pytest.mark.model
def test_readme_walkthrough(tmp_path, smollm2_path):
    """One shell for the README's swarm blocks, in the order a reader meets them: the local swarm
    (DHT peer, a server of all blocks), the private swarm (a member-only server and a
    client that uses only members), the client-library snippet, the gateway (two curl calls) and the
    `openai` client, then the README's `kill $(jobs -p)`; nothing may be left running or untracked."""
    blocks = readme_blocks()
    dht_port, api_port = _free_port(), _free_port()
    local = blocks[("test", "local-swarm")][1].replace("/tcp/31337", f"/tcp/{dht_port}")
    private = blocks[("test", "private-swarm")][1]
    client_py = blocks[("test", "client-library")][1]
    gateway = (
        blocks[("test", "api-gateway")][1]
        .replace("--port 8000", f"--port {api_port}")
        .replace("127.0.0.1:8000", f"127.0.0.1:{api_port}")
    )
    openai_py = blocks[("test", "api-openai")][1].replace("127.0.0.1:8000", f"127.0.0.1:{api_port}")
    ollama_sh = blocks[("test", "api-ollama")][1].replace("127.0.0.1:8000", f"127.0.0.1:{api_port}")
    ollama_py = blocks[("test", "api-ollama-python")][1].replace("127.0.0.1:8000", f"127.0.0.1:{api_port}")
    work = _scratch(tmp_path)
    (work / "openai_example.py").write_text(openai_py)
    (work / "client_example.py").write_text(client_py)
    (work / "ollama_example.py").write_text(ollama_py)
    script = "\n".join(
        [
            "set -eu",
            local,
            "echo '=== private swarm'",
            private,
            "echo '=== client library'",
            ".venv/bin/python client_example.py",
            "echo '=== gateway'",
            gateway,
            "echo '=== openai'",
            ".venv/bin/python openai_example.py",
            "echo; echo '=== ollama'",
            ollama_sh,
            "echo; echo '=== ollama python'",
            ".venv/bin/python ollama_example.py",
            "echo; echo '=== done'",
            "kill $(jobs -p)",
            "wait",
        ]
    )
    proc = subprocess.Popen(
        ["bash", "-c", script],
        cwd=work,
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=900)  # a bound: 600 s ran out at load average 15
        leftover = _running_in(work)  # after `kill $(jobs -p)`: nothing the examples started runs on
    finally:  # the blocks' background processes live in this process group
        _kill_group(proc.pid)
    assert proc.returncode == 0, out[-3000:] + err[-3000:]
    assert not leftover, leftover
    rest = out.split("=== private swarm", 1)[1]
    private_out, rest = rest.split("=== client library", 1)
    client_out, rest = rest.split("=== gateway", 1)
    gateway_out, rest = rest.split("=== openai", 1)
    openai_out, rest = rest.split("=== ollama\n", 1)
    ollama_out, rest = rest.split("=== ollama python", 1)
    ollama_py_out = rest.split("=== done", 1)[0]
    chat, end = json.JSONDecoder().raw_decode(gateway_out.strip())  # curl -s adds no newline after it
    stream = gateway_out.strip()[end:]
    assert "Paris" in chat["choices"][0]["message"]["content"], chat
    assert stream.rstrip().endswith("data: [DONE]")
    assert "CompletionUsage(" in openai_out and "Paris" in openai_out
    tags, end = json.JSONDecoder().raw_decode(ollama_out.strip())
    assert any(m["name"].startswith("smollm2-135m") for m in tags["models"]), tags
    ollama_chat = json.loads(ollama_out.strip()[end:].strip())
    assert "Paris" in ollama_chat["message"]["content"] and ollama_chat["done"], ollama_chat
    assert "Paris" in ollama_py_out and "tokens)" in ollama_py_out, ollama_py_out
    assert re.search(r"\[0:30\)", client_out), client_out  # s.chain.describe(): a one-server hop
    assert "tokens/s" in private_out and "[chain: " in private_out, private_out
    members = (work / "keys" / "members.txt").read_text().split()
    assert len(members) == 2 and all(m.startswith("Qm") for m in members)
    server_line = next(
        line for line in (work / "logs" / "private-server.log").read_text().splitlines() if line.startswith("serving")
    )
    assert members[0] in server_line  # the member-only server runs as the identity listed first
    assert f"{members[0][-6:]}[0:30)" in private_out  # ... and the member client's chain went through it
    assert "Traceback" not in err, err[-3000:]
    assert "No such file" not in err, err[-3000:]  # e.g. `until grep` polling a log its command has not created yet
    # what the examples wrote lies in folders git ignores (the scratch folder holds only what the test put there)
    written = {p.name for p in work.iterdir()} - {
        ".venv",
        "examples",
        "openai_example.py",
        "client_example.py",
        "ollama_example.py",
    }
    assert written <= {"logs", "keys"}, written
    ignored = (REPO / ".gitignore").read_text().split()
    assert {"logs/", "keys/"} <= set(ignored)


def _running_in(folder: Path) -> list[str]:
    """Command lines of live processes whose working folder is `folder` (every process the blocks
    start inherits it: servers, their DHT children, p2p daemons), polled until none is left (20 s)."""
    import psutil

    deadline = time.monotonic() + 20
    while True:
        alive = []
        for p in psutil.process_iter(["cmdline", "status"]):
            try:
                if p.info["status"] != psutil.STATUS_ZOMBIE and Path(p.cwd()) == folder:
                    alive.append(" ".join(p.info["cmdline"] or []))
            except (psutil.NoSuchProcess, psutil.AccessDenied, OSError):
                pass
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.5)


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            os.killpg(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.2)
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
