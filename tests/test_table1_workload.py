"""Table 1 workload: the Azure trace loader and the scaling arithmetic (experiments/workload.py)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from experiments import workload
from experiments.workload import Scale, scale_lengths, scale_requests
from netem.topology import DataNotFoundError
from orchestrator.sim.traces import RequestTrace, load_azure_trace


def _trace(arrivals, ctx, gen) -> RequestTrace:
    return RequestTrace(np.asarray(arrivals, float), np.asarray(ctx), np.asarray(gen))


@pytest.fixture(scope="module")
def azure():
    try:
        return load_azure_trace()
    except DataNotFoundError as e:
        pytest.skip(f"Azure code trace not available: {e}")


def test_azure_trace_matches_the_papers_statistics(azure):
    # §4.2.1: 2.57 req/s, mean 2,048 input / 28 output tokens; Fig. 11: inter-arrival std 13.15x exponential's
    assert len(azure.arrival_s) == 8819
    assert azure.mean_rate_per_s == pytest.approx(2.57, abs=0.01)
    assert azure.context_tokens.mean() == pytest.approx(2048, abs=1)
    assert azure.generated_tokens.mean() == pytest.approx(28, abs=0.2)
    assert workload.interarrival_cv(azure.arrival_s) == pytest.approx(13.15, abs=0.01)
    assert np.all(np.diff(azure.arrival_s) >= 0) and azure.arrival_s[0] == 0


def test_scaling_divides_the_rate_and_keeps_the_burstiness(azure):
    base = scale_requests(azure, 1000, Scale(1.0, 1.0, max_length_tokens=10_000))
    slow = scale_requests(azure, 1000, Scale(7.5, 1 / 16, max_length_tokens=10_000))
    a0, a1 = [r.arrival_s for r in base], [r.arrival_s for r in slow]
    assert workload.rate_per_s(a1) == pytest.approx(workload.rate_per_s(a0) / 7.5)
    assert workload.interarrival_cv(a1) == pytest.approx(workload.interarrival_cv(a0), rel=1e-9)
    assert [r.index for r in slow] == list(range(1000))
    # lengths: input / 16 rounded, at least 1; output kept
    assert all(r.input_tokens == max(1, round(r.trace_input_tokens / 16)) for r in slow)
    assert all(r.output_tokens == r.trace_output_tokens for r in slow)


def test_lengths_are_cut_to_fit_max_length_and_counted():
    trace = _trace([0, 1, 2, 3], [160, 1600, 16, 4000], [10, 900, 1, 30])
    reqs = scale_requests(trace, 4, Scale(1.0, 1 / 16, max_length_tokens=200))
    assert [(r.input_tokens, r.output_tokens, r.truncated, r.input_cut) for r in reqs] == [
        (10, 10, False, False),
        (100, 100, True, False),
        (1, 1, False, False),
        (170, 30, False, True),
    ]
    assert workload.summary(reqs)["truncated"] == 1 and workload.summary(reqs)["inputs_cut"] == 1
    # an input over the context keeps its last tokens; its output keeps at most half the context
    assert scale_lengths(3200, 1, Scale(1.0, 1 / 16, max_length_tokens=200)) == (199, 1, False, True)
    assert scale_lengths(5000, 900, Scale(1.0, 1.0, max_length_tokens=4096)) == (3196, 900, False, True)
    assert scale_lengths(5000, 3000, Scale(1.0, 1.0, max_length_tokens=4096)) == (2048, 2048, True, True)


def test_offset_and_bounds():
    trace = _trace([5, 6, 8, 11], [16, 32, 48, 64], [1, 2, 3, 4])
    reqs = scale_requests(trace, 2, Scale(2.0, 1 / 16), offset=2)
    assert [(r.index, r.arrival_s, r.input_tokens) for r in reqs] == [(2, 0.0, 3), (3, 6.0, 4)]
    with pytest.raises(ValueError, match="cannot take"):
        scale_requests(trace, 3, Scale(1.0, 1.0), offset=2)
    with pytest.raises(ValueError, match="> 0"):
        Scale(0.0, 1.0)


def test_auto_time_scale_hits_the_target_load():
    # W = L (t_I l_in + t_O (l_out - 1)) + overhead * hops * l_out
    w = workload.cpu_s_per_request(1e-4, 1e-3, 30, 128, 28, step_overhead_cpu_s=0.01, hops=2)
    assert w == pytest.approx(30 * (0.0128 + 0.027) + 0.01 * 2 * 28)
    ts = workload.auto_time_scale(2.57, w, 2.0, 0.5)
    assert workload.offered_load(2.57 / ts, w, 2.0) == pytest.approx(0.5)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.floats(0.0, 1e4, allow_nan=False), min_size=3, max_size=40),
    st.floats(0.01, 100.0),
    st.floats(0.01, 4.0),
)
def test_time_scaling_is_a_pure_stretch(arrivals, time_scale, length_scale):
    a = sorted(arrivals)
    assume(a[-1] - a[0] > 1e-3)
    trace = _trace(a, [100] * len(a), [5] * len(a))
    reqs = scale_requests(trace, len(a), Scale(time_scale, length_scale, max_length_tokens=10_000))
    got = np.array([r.arrival_s for r in reqs])
    np.testing.assert_allclose(got, (np.array(a) - a[0]) * time_scale, rtol=1e-9, atol=1e-9)
    d0 = np.diff(a)
    assume(d0.mean() > 0)
    assert workload.interarrival_cv(got) == pytest.approx(workload.interarrival_cv(a), rel=1e-6, abs=1e-9)


def test_calibrate_from_an_earlier_run_reads_its_measured_cpu_per_request(tmp_path):
    from experiments.table1 import CalibrationError, measured_cpu_s_per_request

    with pytest.raises(CalibrationError, match="--calibrate-from"):
        measured_cpu_s_per_request(tmp_path, servers_only=True)
    recs = [
        {
            "index": i,
            "arrival_s": 0.0,
            "start_s": 1.0,
            "end_s": 2.0,
            "output_tokens": 3,
            "generated_tokens": 3,
            "error": None,
        }
        for i in range(4)
    ]
    recs.append({**recs[0], "index": 4, "generated_tokens": 0, "error": "DeadlineError: late"})
    (tmp_path / "records_proposed.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    (tmp_path / "run_proposed.json").write_text(
        json.dumps(
            {
                "cpu": {"ours_cpu_s": 20.0},
                "host_cpu": {"client": {"cpu_s": 8.0}, "fast0": {"cpu_s": 6.0}, "slow0": {"cpu_s": 2.0}},
            }
        )
    )
    w, why = measured_cpu_s_per_request(tmp_path, servers_only=True)  # shares: the server hosts, per finished
    assert w == pytest.approx((6.0 + 2.0) / 4) and "proposed" in why
    w, _ = measured_cpu_s_per_request(tmp_path, servers_only=False)  # no shares: all our processes
    assert w == pytest.approx(20.0 / 4)


def test_peak_offered_load_is_the_busiest_window():
    w, cpus = 2.0, 1.0
    arrivals = [0.0, 1.0, 2.0, 100.0, 100.5, 101.0, 101.5, 300.0]  # a burst of 4 within 2 s
    assert workload.peak_offered_load(arrivals, w, cpus, window_s=10.0) == pytest.approx(4 * w / (10.0 * cpus))
    assert workload.peak_offered_load(arrivals, w, cpus, window_s=1000.0) == pytest.approx(8 * w / 1000.0)
    # never below the mean load over the span: the whole span is one of the windows when it is that long
    span = arrivals[-1] - arrivals[0]
    assert workload.peak_offered_load(arrivals, w, cpus, window_s=span + 1) >= workload.offered_load(
        workload.rate_per_s(arrivals), w, cpus
    ) * span / (span + 1)
    assert workload.peak_offered_load([], w, cpus) == 0.0
    with pytest.raises(ValueError):
        workload.peak_offered_load(arrivals, w, cpus, window_s=0.0)


def test_orchestrator_args_of_a_column_parse_and_carry_the_leftover_placement():
    from experiments.cli import build_parser as table1_parser
    from experiments.table1 import Table1Config, orchestrator_args
    from orchestrator.service.cli import build_parser

    info = {"rate_per_s": 0.19, "mean_input_tokens": 129.6, "mean_output_tokens": 22.7}
    for flag in (False, True):
        peer = ["--initial-peers", "/ip4/127.0.0.1/tcp/1/p2p/QmesM6xndavBMs1jxAgfk6s4aGbemH7CT3hRJcVyMFqVsy"]
        args = build_parser().parse_args(
            peer + orchestrator_args(Table1Config(leftover_placement=flag), "proposed", info)
        )
        assert args.leftover_placement is flag and args.policy == "proposed"
        assert args.arrival_rate == pytest.approx(0.19)
        assert args.length_prior_sessions == 250  # the stated means are the whole replay's (250 requests)
    assert table1_parser().parse_args(["--leftover-placement"]).leftover_placement
    assert not table1_parser().parse_args([]).leftover_placement


def test_the_server_compute_model_reaches_the_orchestrator():
    from experiments.cli import build_parser as table1_parser
    from experiments.table1 import Table1Config, orchestrator_args
    from orchestrator.service.cli import build_parser

    info = {"rate_per_s": 0.19, "mean_input_tokens": 129.6, "mean_output_tokens": 22.7}
    peer = ["--initial-peers", "/ip4/127.0.0.1/tcp/1/p2p/QmesM6xndavBMs1jxAgfk6s4aGbemH7CT3hRJcVyMFqVsy"]
    for compute in ("auto", "shared", "parallel"):
        assert table1_parser().parse_args(["--server-compute", compute]).server_compute == compute
        args = build_parser().parse_args(
            peer + orchestrator_args(Table1Config(server_compute=compute), "proposed", info)
        )
        assert args.server_compute == compute
    assert table1_parser().parse_args([]).server_compute == "auto"
    with pytest.raises(SystemExit):
        table1_parser().parse_args(["--server-compute", "gpu"])


def test_the_batch_token_budget_reaches_every_server():
    """--max-batch-tokens (chunked prefill) is the same for every server of every column; 2048, the
    servers' own default, when not given; a budget under 1 is refused by the experiment's parser."""
    from experiments.cli import build_parser as table1_parser
    from experiments.table1 import Table1Config, server_args
    from server.cli import build_parser

    peer = ["--initial-peers", "/ip4/127.0.0.1/tcp/1/p2p/QmesM6xndavBMs1jxAgfk6s4aGbemH7CT3hRJcVyMFqVsy"]
    assert table1_parser().parse_args([]).max_batch_tokens == 2048 == build_parser().parse_args(peer).max_batch_tokens
    assert table1_parser().parse_args(["--max-batch-tokens", "128"]).max_batch_tokens == 128
    for bad in ("0", "-5", "many"):
        with pytest.raises(SystemExit):
            table1_parser().parse_args(["--max-batch-tokens", bad])
    for shares in (None, {"slow0": 0.12}):
        per_server = server_args(Table1Config(max_batch_tokens=128), shares)
        assert len(per_server) == 9
        assert {build_parser().parse_args(peer + a).max_batch_tokens for a in per_server} == {128}


def test_the_kv_plan_length_reaches_the_orchestrator_and_its_cluster():
    """--kv-plan-tokens: auto = the replayed sessions' 95th percentile of prompt + output tokens; the
    orchestrator's cluster then reserves s_c for that many tokens (KV is linear in them), within each
    server's --max-length."""
    from experiments.cli import build_parser as table1_parser
    from experiments.table1 import Table1Config, kv_plan_tokens, orchestrator_args
    from experiments.workload import ScaledRequest
    from orchestrator.service.cli import build_parser
    from orchestrator.service.registry import ServerRecord, build_cluster
    from orchestrator.session_times import SessionShape
    from petals_chain.wire.records import ServerInfo

    reqs = [ScaledRequest(i, float(i), 10 * i, 5, 10 * i, 5, False) for i in range(1, 21)]  # 15, 25, .., 205 tokens
    assert kv_plan_tokens(Table1Config(kv_plan_tokens="auto"), reqs) == 195  # the 19th of 20
    assert kv_plan_tokens(Table1Config(kv_plan_tokens="max"), reqs) is None
    assert kv_plan_tokens(Table1Config(kv_plan_tokens="4096", max_length_tokens=1024), reqs) == 1024
    peer = ["--initial-peers", "/ip4/127.0.0.1/tcp/1/p2p/QmesM6xndavBMs1jxAgfk6s4aGbemH7CT3hRJcVyMFqVsy"]
    info = {"rate_per_s": 0.19, "mean_input_tokens": 129.6, "mean_output_tokens": 22.7, "_requests": reqs}
    args = build_parser().parse_args(peer + orchestrator_args(Table1Config(kv_plan_tokens="auto"), "proposed", info))
    assert args.kv_plan_tokens == 195
    assert build_parser().parse_args(peer + orchestrator_args(Table1Config(), "proposed", info)).kv_plan_tokens is None
    assert table1_parser().parse_args(["--kv-plan-tokens", "auto"]).kv_plan_tokens == "auto"
    for bad in ("0", "-3", "many"):
        with pytest.raises(SystemExit):
            table1_parser().parse_args(["--kv-plan-tokens", bad])
    # s_c: 1000 bytes per block at the server's 2048 tokens
    rec = ServerRecord(ServerInfo("p", "m", 0, 4, "online", 4000, 100, 1000, 2048, 40, 1e-4, 1e-3), rtt_s=0.01)
    shape = SessionShape(100, 20)
    assert build_cluster([rec], 4, shape, 0.1, 0.7)[0].service.cache_size == 1000
    assert build_cluster([rec], 4, shape, 0.1, 0.7, kv_plan_tokens=512)[0].service.cache_size == 250
    assert build_cluster([rec], 4, shape, 0.1, 0.7, kv_plan_tokens=8192)[0].service.cache_size == 1000
    with pytest.raises(ValueError, match="kv_plan_tokens"):
        build_cluster([rec], 4, shape, 0.1, 0.7, kv_plan_tokens=0)


def test_the_stacks_of_late_requests_name_where_they_wait():
    """loadgen writes the stack of every request still running at the deadline (a hung session leaves
    no other evidence)."""
    import threading

    from experiments.loadgen import running_stacks

    release = threading.Event()

    def stuck_in_open_session():
        release.wait(30)

    t = threading.Thread(target=stuck_in_open_session, name="req-126", daemon=True)
    t.start()
    try:
        text = running_stacks({t.ident: t.name, 123456789: "req-gone"})
        assert "--- req-126" in text and "stuck_in_open_session" in text and "req-gone" not in text
    finally:
        release.set()
        t.join()
    assert running_stacks({}) == ""
