"""`petals-chain chat`: an interactive chat in the terminal, through a swarm or in-process blocks.

The conversation lives in one inference session: each turn sends the servers only its new tokens
(the user's message in the chat template, and the generation prompt); the earlier turns stay in
their KV caches. Replies stream as they are generated.

  /clear   forget the conversation (a new session)
  /exit    leave (also /bye or Ctrl-D)
  \"\"\"      start and end a message of several lines; a line ending in \\ continues on the next
"""

from __future__ import annotations

import argparse
import time

from petals_chain.cli.args import (
    DTYPE_CHOICES,
    CliParser,
    identity_path,
    peer_maddr,
    positive_float,
    positive_int,
    probability,
)

PROMPT, CONTINUATION = ">>> ", "... "


def build_parser() -> argparse.ArgumentParser:
    from petals_chain.cli.generate import parse_ranges

    p = CliParser(prog="petals-chain chat", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m", help="embedded model name or local checkpoint folder")
    p.add_argument(
        "--initial-peers",
        nargs="*",
        default=None,
        type=peer_maddr,
        help="multiaddrs of swarm DHT peers (without them the blocks run in this process)",
    )
    p.add_argument(
        "--identity-path",
        default=None,
        type=identity_path,
        help="this client's peer identity file: a stable peer id for a private swarm's --allowed-peers",
    )
    p.add_argument(
        "--allowed-peers",
        default=None,
        metavar="FILE",
        help="use only servers (and an orchestrator) whose peer ids FILE lists (private swarm)",
    )
    p.add_argument(
        "--local-ranges",
        type=parse_ranges,
        default=None,
        help="without --initial-peers: block ranges run in this process (default: all blocks in one)",
    )
    p.add_argument("--system", default=None, help="a system message at the start of the conversation")
    p.add_argument("--max-new-tokens", type=positive_int, default=256, help="longest reply (tokens, default 256)")
    p.add_argument(
        "--max-length",
        type=positive_int,
        default=2048,
        help="the conversation's room in tokens, reserved on the servers (default 2048); /clear frees it",
    )
    p.add_argument("--sample", action="store_true", help="sample instead of greedy decoding")
    p.add_argument("--temperature", type=positive_float, default=0.7, help="with --sample: > 0 (default 0.7)")
    p.add_argument("--top-p", type=probability, default=0.9, help="with --sample: nucleus mass in (0, 1] (default 0.9)")
    p.add_argument("--dtype", default="float32", choices=DTYPE_CHOICES, help="client-side dtype")
    return p


def read_message(read_line=input) -> str | None:
    """One user message from the terminal: a line; lines ending in a backslash continue; a line that
    is exactly \"\"\" opens a block closed by the next such line. None at end of input (Ctrl-D)."""
    try:
        first = read_line(PROMPT)
    except EOFError:
        return None
    if first.strip() == '"""':
        lines = []
        while True:
            try:
                line = read_line(CONTINUATION)
            except EOFError:
                break
            if line.strip() == '"""':
                break
            lines.append(line)
        return "\n".join(lines)
    lines = [first]
    while lines[-1].endswith("\\"):
        lines[-1] = lines[-1][:-1]
        try:
            lines.append(read_line(CONTINUATION))
        except EOFError:
            break
    return "\n".join(lines)


class Conversation:
    """The messages and the one inference session that holds them; `turn` sends only what is new."""

    def __init__(self, model, tokenizer, args):
        self.model, self.tokenizer, self.args = model, tokenizer, args
        self.messages: list[dict] = []
        self.session = None
        self._context = None

    def clear(self) -> None:
        if self._context is not None:
            self._context.__exit__(None, None, None)
        self._context = self.session = None
        self.messages = [{"role": "system", "content": self.args.system}] if self.args.system else []

    def _render(self, messages: list[dict]) -> str:
        if self.tokenizer.chat_template:
            return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"  # no template: plain

    def new_tokens(self, user_text: str) -> list[int]:
        """The tokens to send for this turn: the rendered conversation minus what the session holds.
        When the session's text is not a prefix of it (a reply cut at --max-new-tokens, a template
        that rewrites earlier turns), the conversation starts a new session with all of it."""
        target = self._render([*self.messages, {"role": "user", "content": user_text}])
        if self.session is not None and self.session.token_ids:
            seen = self.tokenizer.decode(self.session.token_ids, skip_special_tokens=False)
            if target.startswith(seen):
                return self.tokenizer(target[len(seen) :], add_special_tokens=False).input_ids
            messages = self.messages
            self.clear()
            self.messages = messages
        return self.tokenizer(target, add_special_tokens=False).input_ids

    def turn(self, user_text: str, streamer) -> tuple[str, int, float]:
        """Send one user message, stream the reply; (reply text, its tokens, seconds)."""
        import torch

        ids = self.new_tokens(user_text)
        held = len(self.session.token_ids) if self.session is not None else 0
        if held + len(ids) + 1 > self.args.max_length:
            raise ConversationFull(held, self.args.max_length)
        if self.session is None:
            self._context = self.model.inference_session(max_length=self.args.max_length)
            self.session = self._context.__enter__()
        max_new = min(self.args.max_new_tokens, self.args.max_length - held - len(ids))
        kwargs = dict(
            max_new_tokens=max_new,
            do_sample=self.args.sample,
            streamer=streamer,
            eos_token_id=self.tokenizer.eos_token_id,
        )
        if self.args.sample:
            kwargs.update(temperature=self.args.temperature, top_p=self.args.top_p)
        start_s = time.perf_counter()
        out = self.model.generate(torch.tensor([ids]), **kwargs)
        elapsed_s = time.perf_counter() - start_s
        reply_ids = out[0, held + len(ids) :].tolist()
        reply = self.tokenizer.decode(reply_ids, skip_special_tokens=True)
        self.messages += [{"role": "user", "content": user_text}, {"role": "assistant", "content": reply}]
        return reply, len(reply_ids), elapsed_s

    @property
    def tokens_held(self) -> int:
        return len(self.session.token_ids) if self.session is not None else 0


class ConversationFull(Exception):
    def __init__(self, held: int, max_length: int):
        super().__init__(
            f"the conversation holds {held} of its {max_length} tokens and this message does not fit: "
            "/clear starts a new one (or restart with a larger --max-length)"
        )


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    from transformers import AutoTokenizer, TextStreamer

    from petals_chain.client.model import DistributedModelForCausalLM
    from petals_chain.models.checkpoint import load_config, resolve_model_path
    from petals_chain.transport.membership import load_allowed_peers

    path = resolve_model_path(args.model)
    if args.initial_peers:
        model = DistributedModelForCausalLM.from_pretrained(
            args.model,
            initial_peers=args.initial_peers,
            dtype=args.dtype,
            identity_path=args.identity_path,
            allowed_servers=load_allowed_peers(args.allowed_peers),
        )
    else:
        ranges = args.local_ranges or [(0, load_config(path).num_hidden_layers)]
        model = DistributedModelForCausalLM.from_local_ranges(path, ranges, dtype=args.dtype)
    tokenizer = AutoTokenizer.from_pretrained(path)
    conversation = Conversation(model, tokenizer, args)
    conversation.clear()
    where = "through the swarm" if args.initial_peers else "in this process"
    print(
        f"chatting with {args.model} {where}; /clear forgets the conversation, /exit leaves, "
        '""" starts a message of several lines',
        flush=True,
    )
    try:
        while True:
            text = read_message()
            if text is None or text.strip() in ("/exit", "/bye"):
                break
            if text.strip() == "/clear":
                conversation.clear()
                print("(conversation cleared)", flush=True)
                continue
            if not text.strip():
                continue
            streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
            try:
                _, n_tokens, elapsed_s = conversation.turn(text, streamer)
            except ConversationFull as e:
                print(f"({e})", flush=True)
                continue
            print(
                f"({n_tokens} tokens in {elapsed_s:.1f} s; {conversation.tokens_held} of {args.max_length} "
                "tokens in this conversation)",
                flush=True,
            )
    finally:
        conversation.clear()
        model.backend.shutdown()
    return 0
