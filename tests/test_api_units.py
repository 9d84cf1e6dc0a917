"""The gateway's pure parts: stop-string scanning, admission queue and policy, error mapping, metrics."""
from __future__ import annotations

import asyncio

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from petals_chain.api.admission import AdmissionQueue, CapacityError, FifoPolicy, make_admission_policy
from petals_chain.api.engine import StopScanner
from petals_chain.api.metrics import GatewayMetrics
from petals_chain.errors import AcquireTimeoutError, MaxLengthExceededError, NoChainError, ServerUnavailableError

text_st = st.text(alphabet="abcXY \ufffd", max_size=30)


@given(text=text_st, stops=st.lists(st.text(alphabet="abcXY", min_size=1, max_size=4), max_size=3),
       cuts=st.lists(st.integers(0, 30), max_size=8))
@settings(max_examples=300, deadline=None)
def test_stop_scanner_streams_exactly_the_text_before_the_first_stop(text, stops, cuts):
    assume("\ufffd" not in text[-1:])  # the final text of a finished generation has no half character
    scanner = StopScanner(tuple(stops))
    sent = ""
    pushed = [text[:n] for n in sorted(cuts)] + [text]
    for prefix in pushed:
        sent += scanner.push(prefix, final=prefix is text)
        if scanner.stopped:
            break
    # the generation stops at the first pushed text that contains a stop string, cut where the
    # earliest one in it begins (as servers that check stop strings token by token do)
    hit = next((p for p in pushed if any(s in p for s in stops)), None)
    expected = text if hit is None else hit[:min(hit.find(s) for s in stops if s in hit)]
    assert sent == expected == scanner.sent
    assert scanner.stopped == (hit is not None)


def test_stop_scanner_holds_back_a_possible_stop_prefix_and_half_characters():
    s = StopScanner(("END",))
    assert s.push("Hello E") == "Hello "
    assert s.push("Hello EN") == ""
    assert s.push("Hello ENx") == "ENx"
    assert s.push("Hello ENx \ufffd") == " "
    assert s.push("Hello ENx é END more") == "é " and s.stopped


def _run(coro):
    return asyncio.run(coro)


def test_admission_fifo_order_timeout_and_cancel():
    async def scenario():
        q = AdmissionQueue(1, FifoPolicy())
        await q.acquire("a", 5, timeout_s=1)
        order = []

        async def waiter(user):
            await q.acquire(user, 5, timeout_s=30)
            order.append(user)

        tasks = [asyncio.create_task(waiter(u)) for u in ("b", "c", "d")]
        while len(q.waiting) < 3:
            await asyncio.sleep(0)
        tasks[1].cancel()  # "c" gives its place up (its client went away)
        with pytest.raises(asyncio.CancelledError):
            await tasks[1]
        assert [t.user for t in q.waiting] == ["b", "d"]
        q.release("a", 5, 7)
        await tasks[0]
        q.release("b", 5, 7)
        await tasks[2]
        assert order == ["b", "d"] and q.active == 1
        with pytest.raises(CapacityError, match="retry later"):
            await q.acquire("e", 5, timeout_s=0.01)
        assert not q.waiting and q.active == 1
        q.release("d", 5, 7)
        assert q.active == 0

    _run(scenario())


def test_admission_policy_by_name():
    assert make_admission_policy("fifo").name == "fifo"
    with pytest.raises(ValueError, match="choose one of fifo"):
        make_admission_policy("lottery")


def test_swarm_errors_map_to_http_statuses():
    from petals_chain.api.gateway import _api_error

    assert _api_error(NoChainError("none")).status == 503
    assert _api_error(AcquireTimeoutError("queued too long")).status == 503
    assert _api_error(ServerUnavailableError("gone")).status == 503
    assert _api_error(MaxLengthExceededError("too long")).status == 400
    assert _api_error(RuntimeError("bug")).status == 500


def test_metrics_rate_window_uses_injected_clock():
    now = [100.0]
    m = GatewayMetrics(clock=lambda: now[0], rate_window_s=10.0)
    m.generation(5, 30, 0.4, "length")
    assert m.tokens_per_s() == 3.0
    now[0] = 111.0
    assert m.tokens_per_s() == 0.0
    text = m.render()
    assert 'petals_chain_api_time_to_first_token_seconds_bucket{le="0.5"} 1' in text
    assert "petals_chain_api_completion_tokens_total 30" in text


@pytest.mark.parametrize("args, message", [
    (["--initial-peers", "garbage"], "bad --initial-peers"),
    (["--initial-peers", "/ip4/127.0.0.1/tcp/5"], "no /p2p/PEERID part"),
    (["--initial-peers", "/ip4/127.0.0.1/tcp/5/p2p/12D3KooWJ2xx", "--max-concurrent", "0"], "--max-concurrent must be >= 1"),
    (["--initial-peers", "/ip4/127.0.0.1/tcp/5/p2p/12D3KooWJ2xx", "--port", "70000"], "--port must be in 0..65535"),
])
def test_api_cli_bad_arguments_exit_2_with_one_clear_line(args, message, capsys):
    from petals_chain.api.cli import main

    assert main(["--port", "0", *args]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
