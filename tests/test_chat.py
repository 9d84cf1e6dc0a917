"""`petals-chain chat` under a pseudo-terminal, as a person types into it (stdlib `pty`, no pexpect):
streaming replies, history in one inference session (each turn sends only its new tokens), /clear,
multi-line input, /exit. In-process blocks of a tiny Llama with SmolLM2's tokenizer and chat template,
and the conversation logic checked token for token against transformers."""

from __future__ import annotations

import os
import re
import select
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
import torch

from petals_chain.cli.chat import Conversation, read_message
from petals_chain.swarm.local import REPO_ROOT


class Terminal:
    """A command on a pseudo-terminal: `expect` reads until a pattern shows, `send` types a line."""

    def __init__(self, argv: list[str]):
        self.master, slave = os.openpty()
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])),
            "TERM": "dumb",
        }
        self.proc = subprocess.Popen(
            argv,
            stdin=slave,
            stdout=slave,
            stderr=slave,
            env=env,
            cwd=REPO_ROOT,
            start_new_session=True,
            close_fds=True,
        )
        os.close(slave)
        self.text = ""
        self.consumed = 0  # what earlier expects matched up to; the next one looks after it

    def expect(self, pattern: str, timeout_s: float = 240.0) -> re.Match:
        deadline = time.monotonic() + timeout_s
        while True:
            match = re.compile(pattern).search(self.text, self.consumed)
            if match:
                self.consumed = match.end()
                return match
            left = deadline - time.monotonic()
            ready, _, _ = select.select([self.master], [], [], max(0.0, min(left, 1.0)))
            if ready:
                try:
                    chunk = os.read(self.master, 4096)
                except OSError:  # the command ended and closed the terminal
                    chunk = b""
                if not chunk:
                    raise AssertionError(f"ended before {pattern!r}:\n{self.text[-3000:]}")
                self.text += chunk.decode(errors="replace").replace("\r\n", "\n")
            elif left <= 0:
                raise AssertionError(f"no {pattern!r} within {timeout_s:.0f} s:\n{self.text[-3000:]}")

    def send(self, line: str) -> None:
        os.write(self.master, (line + "\n").encode())

    def close(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=30)
        os.close(self.master)


@pytest.mark.model
def test_chat_in_a_terminal(tiny_chat_path):
    term = Terminal(
        [
            sys.executable,
            "-m",
            "petals_chain.cli",
            "chat",
            "--model",
            str(tiny_chat_path),
            "--max-new-tokens",
            "6",
            "--max-length",
            "512",
        ]
    )
    try:
        term.expect(r"/exit leaves")
        term.expect(r">>> ")
        term.send("Hello there")
        first = term.expect(r"\((\d+) tokens in [\d.]+ s; (\d+) of 512 tokens in this conversation\)")
        assert int(first.group(1)) >= 1
        held_after_first = int(first.group(2))
        term.expect(r">>> ")
        term.send('"""')  # a message of several lines
        term.expect(r"\.\.\. ")
        term.send("line one")
        term.expect(r"\.\.\. ")
        term.send("line two")
        term.expect(r"\.\.\. ")
        term.send('"""')
        second = term.expect(r"\((\d+) tokens in [\d.]+ s; (\d+) of 512 tokens in this conversation\)")
        assert int(second.group(2)) > held_after_first  # the same session holds both turns
        term.expect(r">>> ")
        term.send("/clear")
        term.expect(r"\(conversation cleared\)")
        term.expect(r">>> ")
        term.send("Hello there")
        third = term.expect(r"\((\d+) tokens in [\d.]+ s; (\d+) of 512 tokens in this conversation\)")
        assert third.groups() == first.groups()  # greedy: a fresh conversation replies as the first did
        term.expect(r">>> ")
        term.send("/exit")
        term.proc.wait(timeout=60)
        assert term.proc.returncode == 0
        assert "Traceback" not in term.text
    finally:
        term.close()


def test_read_message_lines_blocks_and_continuations():
    def reader(lines):
        it = iter(lines)

        def read(prompt):
            try:
                return next(it)
            except StopIteration:
                raise EOFError from None

        return read

    assert read_message(reader(["hi"])) == "hi"
    assert read_message(reader(['"""', "a", "", "b", '"""'])) == "a\n\nb"
    assert read_message(reader(["one \\", "two"])) == "one \ntwo"
    assert read_message(reader([])) is None


@pytest.mark.model
def test_each_turn_sends_only_its_new_tokens_and_matches_transformers(tiny_chat_path):
    """Two turns in one session give exactly transformers' greedy tokens for the whole conversation,
    and the second turn's input is only what the first left out."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from petals_chain.client.model import DistributedModelForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(tiny_chat_path)
    hf = AutoModelForCausalLM.from_pretrained(tiny_chat_path, dtype=torch.float32).eval()
    model = DistributedModelForCausalLM.from_local_ranges(tiny_chat_path, [(0, 2), (2, 4)])
    args = SimpleNamespace(
        system="Be brief.", max_new_tokens=5, max_length=256, sample=False, temperature=1.0, top_p=1.0
    )
    chat = Conversation(model, tokenizer, args)
    chat.clear()
    chat.turn("Hi", streamer=None)
    held = list(chat.session.token_ids)
    new = chat.new_tokens("And then?")
    assert (
        0
        < len(new)
        < len(
            tokenizer(
                chat._render([*chat.messages, {"role": "user", "content": "And then?"}]), add_special_tokens=False
            ).input_ids
        )
    )
    chat.turn("And then?", streamer=None)
    full = torch.tensor([held + new])
    expected = hf.generate(
        full,
        attention_mask=torch.ones_like(full),
        max_new_tokens=5,
        do_sample=False,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    assert chat.session.token_ids == expected[0].tolist()
    chat.clear()
