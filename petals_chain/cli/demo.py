"""`petals-chain demo`: a private swarm on 127.0.0.1 run by the online orchestrator: a DHT peer,
`petals-chain orchestrator`, and block servers with different memory budgets started with
`--blocks auto`. The orchestrator plans their placement (GBP-CR + GCA by default), the demo
streams one chat answer, then runs N concurrent sessions dispatched by JFFC and prints each
session's queue wait and service time; then it shuts everything down (also on Ctrl-C)."""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import sys
import threading
import time
import urllib.request

from petals_chain.cli.args import (
    CliParser,
    non_negative_int,
    one_line,
    parse_size,
    positive_int,
)

DEFAULT_BUDGETS = "300MiB,340MiB,380MiB,420MiB"
PROMPTS = [
    "The capital of France is",
    "Once upon a time",
    "def fibonacci(n):",
    "The sun is a",
    "In 1492, Columbus",
    "Water boils at",
    "My favourite colour is",
    "A haiku about rain:",
    "The best way to learn is",
    "Photosynthesis is",
    "The three primary colors are",
    "A good cup of coffee",
]


def get_policy_names() -> tuple[str, ...]:
    from orchestrator.policies import (
        POLICY_NAMES,  # the registry (planner, simulator, service read it too)
    )

    return POLICY_NAMES


def parse_budgets(text: str) -> list[str]:
    """'300MiB,340MiB' -> ['300MiB', '340MiB'], each checked as a size (the servers get them as written)."""
    budgets = [b.strip() for b in text.split(",") if b.strip()]
    if not budgets:
        raise argparse.ArgumentTypeError(f"no budget in {text!r}: use e.g. {DEFAULT_BUDGETS}")
    for b in budgets:
        parse_size(b)
    return budgets


def check_budgets(path, budgets_bytes: list[int], max_length_tokens: int) -> None:
    """Refuse budgets that cannot serve the model, before any process starts: each server must hold
    at least one block with one session's KV, and together they must hold every block with one
    session each (a necessary condition; the orchestrator's plan may still need more for c > 1)."""
    from petals_chain.errors import InvalidRequestError
    from petals_chain.runtime.block_range import BlockRange

    probe = BlockRange(path, 0, 1, model_path=path)  # sizes of one block, as a server measures them
    s_m, s_c = probe.block_bytes, probe.kv_bytes_per_block(max_length_tokens)
    num_blocks = probe.family.num_blocks(probe.config)
    per_block = s_m + s_c
    mib = 2**20
    too_small = [b for b in budgets_bytes if b < per_block]
    if too_small:
        raise InvalidRequestError(
            f"--budgets: {too_small[0] / mib:.0f} MiB cannot hold one block ({s_m / mib:.1f} MiB) with one session's "
            f"KV at --max-length {max_length_tokens} ({s_c / mib:.2f} MiB); give every server at least "
            f"{per_block / mib:.0f} MiB, e.g. --budgets {DEFAULT_BUDGETS}"
        )
    held = sum(b // per_block for b in budgets_bytes)
    if held < num_blocks:
        raise InvalidRequestError(
            f"--budgets: together the servers hold {held} of the model's {num_blocks} blocks (each block "
            f"{per_block / mib:.1f} MiB with one session's KV); add servers or memory, "
            f"e.g. --budgets {DEFAULT_BUDGETS}"
        )


def _get(url: str, timeout_s: float = 10.0) -> dict:
    with urllib.request.urlopen(url, timeout=timeout_s) as r:
        return json.load(r)


def _get_or_none(url: str, timeout_s: float = 10.0) -> dict | None:
    """The orchestrator's status, or None when it did not answer in time (a busy machine: ask again)."""
    try:
        return _get(url, timeout_s)
    except OSError:  # a timeout (TimeoutError), a refused or reset connection (URLError, ConnectionError)
        return None


# What the swarm's processes print that says where their start is (the orchestrator's events, the
# servers' own lines); everything else they print (warnings, hivemind's logs) stays in their output.
ORCHESTRATOR_EVENTS = ("server ", "plan v", "cannot plan yet")
SERVER_MARKERS = ("serving ", "standing by: ", "start-up profile from the cache")
STARTING = "starting (importing torch, measuring one block's t_I and t_O)"
LOADING = "loading the assigned blocks and measuring them"


class StartupProgress:
    """Says what the swarm is doing while it starts, instead of minutes of silence: each server's
    phase (measuring one block, registered, loading and measuring its assigned range, serving), the
    orchestrator's events as they happen, and every `quiet_s` without news a line naming who is still
    busy with what. It only reads what the processes print (`LocalSwarm` keeps their output)."""

    def __init__(self, swarm, start_s: float, *, clock=time.monotonic, quiet_s: float = 15.0, out=print):
        self.swarm, self.start_s, self.clock, self.quiet_s, self.out = swarm, start_s, clock, quiet_s, out
        self.phase = {sp.name: STARTING for sp in swarm.servers}  # name -> what it is doing now
        self.blocks: dict[str, str] = {}  # name -> the range the plan gave it, e.g. "[0,21)"
        self.done: set[str] = set()
        self._seen: dict[str, int] = {}  # how many lines of each process were read
        self._last_news_s = clock()

    def say(self, text: str) -> None:
        self.out(f"  [{self.clock() - self.start_s:5.0f} s] {text}", flush=True)
        self._last_news_s = self.clock()

    def _new_lines(self, key: str, lines: list[str]) -> list[str]:
        seen, n = self._seen.get(key, 0), len(lines)  # the reader threads only append
        self._seen[key] = n
        return lines[seen:n]

    def poll(self) -> None:
        for line in self._new_lines("orchestrator", self.swarm.orchestrator_lines):
            if not line.startswith(ORCHESTRATOR_EVENTS):
                continue
            self.say(f"orchestrator: {line.removeprefix('server ')}")
            if line.startswith("server ") and " registered" in line:
                name = line.split()[1]
                if name in self.phase and name not in self.done:
                    self.phase[name] = "registered, waiting for the plan"
            elif line.startswith("plan v") and "): " in line:
                for part in line.split("): ", 1)[1].split("; ")[0].split(", "):
                    name, _, where = part.partition("=")
                    if name in self.phase and name not in self.done:
                        self.phase[name] = "left out by the plan" if where == "unused" else LOADING
                        self.blocks[name] = where
        for sp in self.swarm.servers:
            for line in self._new_lines(sp.name, sp.lines):
                if line.startswith("serving "):
                    self.done.add(sp.name)
                    self.say(f"{sp.name}: {line.split(' as ')[0]}")
                elif line.startswith("standing by: "):
                    self.done.add(sp.name)
                    self.say(f"{sp.name}: standing by (the plan gives it no blocks)")
                elif line.startswith(SERVER_MARKERS[2]):
                    self.say(f"{sp.name}: start-up profile read from the cache (measured at an earlier start)")
        if self.clock() - self._last_news_s >= self.quiet_s:
            by_phase: dict[str, list[str]] = {}
            for name, phase in self.phase.items():
                if name not in self.done:
                    by_phase.setdefault(phase, []).append(self._named(name))
            if by_phase:
                self.say("still " + "; ".join(f"{', '.join(names)}: {phase}" for phase, names in by_phase.items()))

    def _named(self, name: str) -> str:
        return f"{name} {self.blocks[name]}" if self.phase[name] == LOADING else name

    def servers_ready(self) -> bool:
        return len(self.done) == len(self.swarm.servers)


def start_swarm(swarm, progress_start_s: float, *, timeout_s: float = 600.0, poll_s: float = 0.3) -> dict:
    """Start `swarm` (a LocalSwarm with an orchestrator), printing its progress; return the
    orchestrator's status once its plan is online and every server serves (or stands by)."""
    from petals_chain.swarm.local import SwarmStartError

    swarm.start(wait_servers=False)
    progress = StartupProgress(swarm, progress_start_s)
    progress.say(
        f"DHT peer and orchestrator up; {len(swarm.servers)} servers starting (each measures one block, "
        "registers, then loads the blocks the orchestrator assigns it and measures those)"
    )
    deadline = time.monotonic() + timeout_s
    while True:
        progress.poll()
        for sp in swarm.servers:
            if not sp.alive:
                raise SwarmStartError(f"{sp.name} exited while starting", sp.lines)
        if swarm.orchestrator_process.poll() is not None:
            raise SwarmStartError("the orchestrator exited", swarm.orchestrator_lines)
        status = _get_or_none(swarm.orchestrator_url + "status") if progress.servers_ready() else None
        if status is not None and status["plan_installed"]:
            swarm.wait_ready()  # every server said it serves: reads their peer ids and ranges
            return status
        if time.monotonic() > deadline:
            busy = [name for name in progress.phase if name not in progress.done]
            raise RuntimeError(
                f"the swarm did not come online within {timeout_s:.0f} s (still starting: "
                f"{', '.join(busy) or 'none; the plan is not installed'}); a loaded machine "
                "may need a later try"
            )
        time.sleep(poll_s)


def _is_converted(model: str) -> bool:
    """Whether `model` needs no conversion now (a checkpoint folder, or an embedded model converted before)."""
    from petals_chain.models.checkpoint import CHECKPOINT_FILE, EMBEDDED_MODELS, cache_dir

    name = str(model).lower()
    return name not in EMBEDDED_MODELS or (cache_dir() / "models" / name / CHECKPOINT_FILE).is_file()


@contextlib.contextmanager
def _stopping(swarm):
    """Stop `swarm` on the way out, however the block ends (`start_swarm` starts it)."""
    try:
        yield swarm
    finally:
        swarm.stop()


def main(argv: list[str]) -> int:
    start_s = time.monotonic()  # the progress lines' clock: seconds since the command started
    p = CliParser(prog="petals-chain demo", description=__doc__)
    p.add_argument("--model", default="smollm2-135m", help="embedded model name or local checkpoint folder")
    p.add_argument(
        "--budgets",
        type=parse_budgets,
        default=parse_budgets(DEFAULT_BUDGETS),
        help=f"comma-separated memory budgets, one server each (default {DEFAULT_BUDGETS})",
    )
    p.add_argument(
        "--servers",
        type=positive_int,
        default=None,
        help="number of servers (budgets cycle through --budgets; default: one per budget)",
    )
    p.add_argument(
        "--policy",
        default="proposed",
        choices=get_policy_names(),
        help="the orchestrator's placement and dispatch policy (default proposed: GBP-CR + GCA + JFFC)",
    )
    p.add_argument("--c", default="3", help="cache reservation c for the proposed policy: auto or N (default 3)")
    p.add_argument(
        "--sessions", type=non_negative_int, default=8, help="concurrent sessions after the chat (default 8)"
    )
    p.add_argument("--session-tokens", type=positive_int, default=12, help="tokens each concurrent session generates")
    p.add_argument("--prompt", default="Explain in three sentences why the sky is blue.", help="the chat's message")
    p.add_argument("--max-new-tokens", type=positive_int, default=48, help="tokens of the chat's answer (default 48)")
    p.add_argument("--max-length", type=positive_int, default=512, help="servers' --max-length (sets s_c)")
    p.add_argument("--keep-running", action="store_true", help="keep the swarm up (status page) until Ctrl-C")
    args = p.parse_args(argv)
    budgets = args.budgets
    if args.servers is not None:
        budgets = [budgets[i % len(budgets)] for i in range(args.servers)]

    def terminate(*_):
        # The sessions' threads would log every retry against the stopping swarm: quiet them first.
        logging.disable(logging.CRITICAL)
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, terminate)
    signal.signal(signal.SIGINT, terminate)
    from transformers import AutoTokenizer, TextStreamer

    from petals_chain.cli.generate import encode_prompt
    from petals_chain.client.model import DistributedModelForCausalLM
    from petals_chain.errors import PetalsChainError
    from petals_chain.models.checkpoint import cache_dir, resolve_model_path
    from petals_chain.swarm.local import LocalSwarm, SwarmStartError

    converted = not _is_converted(args.model)
    if converted:
        print(
            f"converting the embedded model {args.model} into {cache_dir() / 'models'} (once; later runs reuse it) ...",
            flush=True,
        )
    path = resolve_model_path(args.model)  # convert once here, not in every server
    if converted:
        print(f"  [{time.monotonic() - start_s:5.0f} s] model ready: {path}", flush=True)
    check_budgets(path, [parse_size(b) for b in budgets], args.max_length)  # before any process starts
    orch_args = ["--expected-servers", str(len(budgets)), "--policy", args.policy, "--c", args.c, "--arrival-rate", "2"]
    print(
        f"starting a local swarm on 127.0.0.1: DHT peer + orchestrator ({args.policy}) + {len(budgets)} servers "
        f"with --blocks auto and budgets {', '.join(budgets)} ...",
        flush=True,
    )
    model = None
    swarm = LocalSwarm(
        args.model,
        [None] * len(budgets),
        server_args=["--num-threads", "1", "--max-length", str(args.max_length)],
        per_server_args=[["--memory-budget", b] for b in budgets],
        orchestrator_args=orch_args,
    )
    try:
        with _stopping(swarm):
            status = start_swarm(swarm, start_s)
            names = {s["peer_id"]: s["name"] for s in status["servers"]}
            print(
                f"\norchestrator {swarm.orchestrator_peer_id[-8:]}: plan v{status['plan_version']}, "
                f"policy {status['policy']}, c = {status['c']}   (status page: {swarm.orchestrator_url})"
            )
            print("placement (what each server loaded):")
            for s in status["servers"]:
                blocks = f"[{s['start']:2d}, {s['end']:2d})" if s["end"] > s["start"] else "unused  "
                print(
                    f"  {s['name']:8s} budget {s['memory'] / 2**20:5.0f} MiB  blocks {blocks}  "
                    f"tau_c {s['tau_c'] * 1e3:6.1f} ms  tau_p {s['tau_p'] * 1e3:6.2f} ms/block"
                )
            print("  budget  the server's --memory-budget: its blocks' weights and its sessions' KV caches fit in it")
            print("  blocks  the blocks [start, end) the orchestrator assigned it (0-based, end excluded)")
            print("  tau_c   a session's network time with it: its steps x (the measured RTT + a per-step overhead)")
            print("  tau_p   a session's compute time per block on it: about t_I x prompt + t_O x output tokens,")
            print(
                f"          t_I/t_O measured at its first start (cached in {cache_dir() / 'throughput.json'}; "
                "delete that file to measure again)"
            )
            print(
                "chains:"
                if args.policy in ("proposed", "jffc-only")
                else "chains (per-request routes, made on demand):"
            )
            for k in status["chains"]:
                print(
                    f"  {' -> '.join(names.get(p, p[-8:]) for p in k['servers'])}  blocks {k['blocks']}  "
                    f"capacity {k['capacity']}  T = {k['service_time']:.2f} s"
                )
            if status["chains"]:
                print(
                    "  blocks: each hop's range; capacity: sessions it serves at once (its servers' KV memory); "
                    "T: one session's service time on it"
                )

            model = DistributedModelForCausalLM.from_pretrained(args.model, initial_peers=swarm.initial_peers)
            tokenizer = AutoTokenizer.from_pretrained(path)
            ids = encode_prompt(tokenizer, args.prompt, chat=True)
            print(f"\nuser: {args.prompt}\nassistant: ", end="", flush=True)
            streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
            chat_start_s = time.perf_counter()
            with model.inference_session(max_length=ids.shape[1] + args.max_new_tokens) as session:
                out = model.generate(
                    ids,
                    max_new_tokens=args.max_new_tokens,
                    do_sample=False,
                    streamer=streamer,
                    eos_token_id=tokenizer.eos_token_id,
                )
                chain = session.chain.describe()
            elapsed_s = time.perf_counter() - chat_start_s
            new_tokens = out.shape[1] - ids.shape[1]
            print(f"\nchain: {chain}\n{new_tokens} tokens in {elapsed_s:.2f} s: {new_tokens / elapsed_s:.1f} tokens/s")

            if args.sessions:
                from orchestrator.policies import get_policy

                routed = get_policy(args.policy).per_request
                capacity = (
                    "routes chosen per request"
                    if routed
                    else f"total capacity {sum(k['capacity'] for k in status['chains'])}"
                )
                print(
                    f"\n{args.sessions} concurrent sessions, {args.session_tokens} tokens each ({capacity}):",
                    flush=True,
                )
                rows: dict[int, tuple] = {}
                errors: list[str] = []

                def run(i: int):
                    try:
                        m = DistributedModelForCausalLM(model.config, model.head, model.backend)
                        prompt = tokenizer(PROMPTS[i % len(PROMPTS)], return_tensors="pt").input_ids
                        t0 = time.perf_counter()
                        with m.inference_session(max_length=prompt.shape[1] + args.session_tokens) as s:
                            t1 = time.perf_counter()
                            o = m.generate(prompt, max_new_tokens=args.session_tokens, do_sample=False)
                            t2 = time.perf_counter()
                            grant = getattr(s.chain, "grant", None)  # the orchestrator's, on the session
                            rows[i] = (
                                t1 - t0,
                                grant.wait_s if grant else float("nan"),
                                t2 - t1,
                                s.chain.describe(),
                                tokenizer.decode(o[0, prompt.shape[1] :], skip_special_tokens=True),
                            )
                    except PetalsChainError as e:
                        errors.append(f"session {i}: {e}")

                threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(args.sessions)]
                for t in threads:
                    t.start()
                    time.sleep(0.05)
                for t in threads:
                    t.join()
                print(f"  {'#':>2}  {'wait (client)':>13}  {'queue wait (orch.)':>18}  {'service':>8}  chain")
                for i in sorted(rows):
                    w_client, w_orch, service, chain, text = rows[i]
                    print(
                        f"  {i:2d}  {w_client:11.2f} s  {w_orch:16.2f} s  {service:6.2f} s  {chain}   "
                        f"{text.strip()[:40]!r}"
                    )
                print(
                    "  wait (client): asking for a chain until holding one; queue wait (orch.): the part spent in "
                    "the orchestrator's queue; service: generating the tokens"
                )
                for e in errors:
                    print("  " + e)
                st = _get_or_none(swarm.orchestrator_url + "status")
                if st is None:
                    print("orchestrator: its status page did not answer within 10 s (a busy machine)")
                else:
                    print(
                        f"orchestrator: {st['metrics']['admitted']} sessions admitted, "
                        f"queue length {st['queue_length']}, "
                        f"expected lengths now in={st['expected_lengths']['input_tokens']:.1f} "
                        f"out={st['expected_lengths']['output_tokens']:.1f} tokens"
                    )
            if args.keep_running:
                print(f"\nswarm running; status page {swarm.orchestrator_url} - Ctrl-C stops it", flush=True)
                while True:
                    time.sleep(1)
            model.backend.shutdown()
            model = None
            print("shutting the swarm down ...", flush=True)
    except KeyboardInterrupt:
        # The swarm is stopped (LocalSwarm's exit ran). Leave now: the concurrent sessions' threads
        # would otherwise go on asking a dead orchestrator for minutes, and stopping their event
        # loops under them prints tracebacks. Our DHT child and its p2pd follow us (ParentBoundDHT).
        print("\ninterrupted: swarm stopped", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(130)
    except SwarmStartError as e:
        print(f"petals-chain demo: {e.reason}", file=sys.stderr)
        return 1
    except (PetalsChainError, RuntimeError) as e:
        print(f"petals-chain demo: {one_line(e)}", file=sys.stderr)
        return 1
    finally:
        if model is not None:
            model.backend.shutdown()
    print("done: all processes stopped")
    return 0
