"""`petals-chain api`: serve the OpenAI API (completions, chat completions, models), the Ollama API
(/api/chat, /api/generate, /api/tags, /api/show, /api/version) and a chat page (/) over a swarm."""

from __future__ import annotations

import argparse
import logging
import signal
import socket
import sys

from petals_chain.api.admission import ADMISSION_POLICIES
from petals_chain.cli.args import DTYPE_CHOICES, CliParser, unit_interval
from petals_chain.process.heap import freeze_startup_heap

LISTEN_BACKLOG = 2048  # uvicorn's own default backlog


def build_parser() -> argparse.ArgumentParser:
    p = CliParser(prog="petals-chain api", description=__doc__)
    p.add_argument("--initial-peers", nargs="+", required=True, help="multiaddrs of swarm DHT peers")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on (0: any free port; default 8000)")
    p.add_argument("--model", default="smollm2-135m", help="model the swarm serves (also the API's model id)")
    p.add_argument(
        "--api-key",
        action="append",
        default=[],
        metavar="KEY",
        help="accept requests with 'Authorization: Bearer KEY' only (repeat for several users; "
        "fairness is per key); without it the gateway is open",
    )
    p.add_argument("--max-concurrent", type=int, default=8, help="sessions through the swarm at once (default 8)")
    p.add_argument(
        "--queue-timeout",
        type=float,
        default=60.0,
        help="seconds a request may wait for a free session slot before it gets HTTP 429 (default 60)",
    )
    p.add_argument("--max-length", type=int, default=2048, help="prompt + completion tokens per request (default 2048)")
    p.add_argument(
        "--admission",
        default="fifo",
        choices=sorted(ADMISSION_POLICIES),
        help="order of waiting requests across API keys (default fifo)",
    )
    p.add_argument(
        "--chat-template",
        default=None,
        metavar="FILE",
        help="a Jinja chat template to use instead of the model's (e.g. one that renders tools)",
    )
    p.add_argument(
        "--dtype",
        default="float32",
        choices=DTYPE_CHOICES,
        help="dtype of the client head and of the hidden states it sends (default float32)",
    )
    p.add_argument(
        "--adapters",
        nargs="+",
        default=[],
        metavar="NAME",
        help="LoRA adapters (names servers list, from their --adapters folders) offered as models "
        "'MODEL:NAME'; a request's model picks its session's adapter",
    )
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N]: where the client head (embeddings, LM head) runs")
    p.add_argument(
        "--client-batch-rows",
        type=int,
        default=4096,
        help="most rows in one batched embedding / LM-head call of concurrent sessions "
        "(1: no cross-session batching, a baseline for benchmarks; default 4096)",
    )
    p.add_argument(
        "--identity-path",
        default=None,
        help="the gateway's peer identity file (a stable peer id, e.g. for a private swarm's --allowed-peers)",
    )
    p.add_argument(
        "--allowed-peers",
        default=None,
        metavar="FILE",
        help="use only servers and orchestrators whose peer ids this file lists (private swarm)",
    )
    p.add_argument(
        "--no-orchestrator", action="store_true", help="route client-side even if the DHT names an orchestrator"
    )
    p.add_argument(
        "--speculative",
        type=parse_speculative,
        default=0,
        metavar="ngram:K",
        help="speculative decoding: ngram:K drafts up to K tokens by prompt lookup, verified in one chain "
        "step (exact greedy output, same sampling distribution; default off)",
    )
    p.add_argument(
        "--no-chat-page", action="store_true", help="do not serve the chat page at / (the OpenAI and Ollama APIs stay)"
    )
    p.add_argument(
        "--speculative-schedule",
        choices=("adaptive", "constant"),
        default="adaptive",
        help="adaptive (default): send 0..K drafted tokens per round, as many as pay off by the measured "
        "acceptance and chain step times; constant: all K",
    )
    p.add_argument(
        "--verify-probability",
        type=unit_interval,
        default=0.0,
        metavar="P",
        help="spot checks: after a step, with probability P, every hop's work is recomputed by other "
        "servers holding the same blocks, off the critical path; a server caught returning wrong "
        "hidden states is banned for every session (and reported to the orchestrator), and the requests "
        "that used it roll back to their last trusted token and go on without it; a server new to the "
        "gateway has its first step always checked (probation), and streams hold text back meanwhile "
        "(default 0: only cheap checks of every reply; petals_chain/client/verification.py)",
    )
    p.add_argument(
        "--verify-prompt-share",
        type=unit_interval,
        default=0.0,
        metavar="S",
        help="spot checks: also audit the prompt step of this share of requests (default 0)",
    )
    return p


def parse_speculative(text: str) -> int:
    """'ngram:K' -> K (draft tokens per step by prompt lookup)."""
    kind, _, k = text.partition(":")
    if kind != "ngram" or not k.isdigit() or int(k) < 1:
        raise argparse.ArgumentTypeError(f"bad --speculative {text!r}: use ngram:K with K >= 1, e.g. ngram:4")
    return int(k)


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    for flag, value, low in (
        ("--max-concurrent", args.max_concurrent, 1),
        ("--max-length", args.max_length, 2),
        ("--client-batch-rows", args.client_batch_rows, 1),
    ):
        if value < low:
            print(f"petals-chain api: {flag} must be >= {low}", file=sys.stderr)
            return 2
    if not 0 <= args.port <= 65535 or args.queue_timeout <= 0:
        print("petals-chain api: --port must be in 0..65535 and --queue-timeout > 0", file=sys.stderr)
        return 2
    from hivemind.utils.multiaddr import Multiaddr

    for maddr in args.initial_peers:
        try:
            if "/p2p/" not in str(Multiaddr(maddr)):
                raise ValueError("no /p2p/PEERID part")
        except Exception as e:
            print(
                f"petals-chain api: bad --initial-peers {maddr!r} ({e}); pass the full multiaddr printed by "
                "`petals-chain dht`, e.g. /ip4/127.0.0.1/tcp/31337/p2p/12D3KooW...",
                file=sys.stderr,
            )
            return 2
    template_text = None
    if args.chat_template is not None:
        try:
            with open(args.chat_template, encoding="utf-8") as f:
                template_text = f.read()
        except OSError as e:
            print(f"petals-chain api: cannot read --chat-template {args.chat_template!r} ({e})", file=sys.stderr)
            return 2
    try:  # bind first: a port in use is a clear error before the model loads
        sock = socket.socket(socket.AF_INET6 if ":" in args.host else socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((args.host, args.port))
    except OSError as e:
        print(
            f"petals-chain api: cannot listen on {args.host}:{args.port} ({e}); choose another --port", file=sys.stderr
        )
        return 2

    import uvicorn
    from transformers import AutoTokenizer

    from petals_chain.api.gateway import Gateway, GatewayConfig
    from petals_chain.client.model import DistributedModelForCausalLM
    from petals_chain.client.verification import VerificationConfig
    from petals_chain.errors import PetalsChainError

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # one line per finished session, with the request id (the servers' and orchestrator's logs name it too)
    logging.getLogger("petals_chain.api").setLevel(logging.INFO)
    from petals_chain.transport.membership import load_allowed_peers

    try:
        model = DistributedModelForCausalLM.from_pretrained(
            args.model,
            initial_peers=args.initial_peers,
            dtype=args.dtype,
            device=args.device,
            max_batch_rows=args.client_batch_rows,
            use_orchestrator=not args.no_orchestrator,
            identity_path=args.identity_path,
            allowed_servers=load_allowed_peers(args.allowed_peers),
            verification=VerificationConfig(
                check_probability=args.verify_probability, prompt_check_share=args.verify_prompt_share
            ),
        )
    except PetalsChainError as e:
        print(f"petals-chain api: {e}", file=sys.stderr)
        return 2
    tokenizer = AutoTokenizer.from_pretrained(model.head.model_path)
    if args.chat_template is not None:
        tokenizer.chat_template = template_text
    keys = {key: f"key{i}" for i, key in enumerate(args.api_key)}  # labels, so metrics never show a key
    gateway = Gateway(
        model,
        tokenizer,
        GatewayConfig(
            model_name=args.model,
            api_keys=keys,
            adapters=args.adapters,
            max_concurrent=args.max_concurrent,
            queue_timeout_s=args.queue_timeout,
            max_length=args.max_length,
            admission=args.admission,
            prompt_lookup_tokens=args.speculative,
            prompt_lookup_schedule=args.speculative_schedule,
            chat_page=not args.no_chat_page,
        ),
    )
    port = sock.getsockname()[1]
    # Why 2 s: Ctrl-C must end the whole command within 5 s, and uvicorn first waits this long for
    # requests in flight (then the DHT child and p2p daemon are stopped)
    server = uvicorn.Server(
        uvicorn.Config(gateway.app, log_level="warning", lifespan="off", timeout_graceful_shutdown=2)
    )
    # uvicorn stops on SIGINT/SIGTERM and then re-raises the signal to the handler it found: make
    # that handler an exception, so the `finally` below still stops the DHT child and its p2p daemon.
    # Installed before the ready line: a Ctrl-C right after it meets this handler, not Python's default.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _exit_on_signal)
    freeze_startup_heap("api gateway")  # requests never meet a full collection of the start-up heap
    # Listen before the ready line: a bound socket that does not listen refuses connections, and
    # uvicorn calls listen() only once its event loop has started, some time after the line. From
    # here the kernel queues connections (up to the backlog) until uvicorn accepts them.
    sock.listen(LISTEN_BACKLOG)
    routing = "orchestrator" if getattr(model.backend, "orchestrator", None) else "client-side routing"
    print(
        f"api ready at http://{args.host}:{port}/v1 (model {args.model}, {routing}, "
        f"{args.max_concurrent} concurrent sessions)",
        flush=True,
    )
    shown = f"[{args.host}]" if ":" in args.host else args.host
    print(
        f"Ollama API at http://{shown}:{port} (/api/chat, /api/generate, /api/tags)"
        + ("" if args.no_chat_page else f"; chat page at http://{shown}:{port}/"),
        flush=True,
    )
    try:
        server.run(sockets=[sock])
    finally:
        gateway.shutdown()
        model.backend.shutdown()
    return 0


def _exit_on_signal(signum, _frame) -> None:
    raise SystemExit(0)
