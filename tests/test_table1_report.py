"""Table 1 results: statistics, every request accounted for, the markdown table, the model check."""

from __future__ import annotations

import json

import pytest

from experiments import model_check, report
from experiments.loadgen import hop_summary, prompt_ids
from petals_chain.client.remote_session import HopTiming


def rec(i, arrival, start, end, out=3, gen=3, error=None, policy="proposed"):
    return {
        "index": i,
        "policy": policy,
        "arrival_s": arrival,
        "start_s": start,
        "end_s": end,
        "output_tokens": out,
        "generated_tokens": gen,
        "error": error,
    }


def test_every_request_is_counted_and_failures_stay_out_of_the_statistics():
    recs = [
        rec(0, 0.0, 1.0, 3.0),
        rec(1, 1.0, 1.0, 5.0),
        rec(2, 2.0, None, 9.0, gen=0, error="OutOfCacheError: full"),
        rec(3, 3.0, 4.0, 6.0, gen=2),
    ]  # 3 stopped early: not finished
    s = report.policy_summary(recs, expected=5)
    assert (s["requests"], s["recorded"], s["finished"], s["failed"], s["lost"]) == (5, 4, 2, 2, 1)
    assert s["errors"] == {"OutOfCacheError": 1, "incomplete": 1}
    assert s["response_s"]["mean"] == pytest.approx((3.0 + 4.0) / 2)
    assert s["wait_s"]["max"] == pytest.approx(1.0) and s["wait_s"]["min"] == pytest.approx(0.0)
    assert s["service_s"]["min"] == pytest.approx(2.0) and s["service_s"]["max"] == pytest.approx(4.0)
    for key in ("mean", "median", "p95", "p99", "max"):
        assert key in s["response_s"] and key in s["wait_s"] and key in s["service_s"]


def test_mean_of_all_requests_counts_failures_at_their_give_up_time():
    recs = [
        rec(0, 0.0, 1.0, 3.0),  # finished: 3 s
        rec(1, 1.0, None, 11.0, gen=0, error="AcquireTimeoutError: no chain slot"),  # given up at 11: 10 s
        rec(2, 4.0, None, None, gen=0, error="DeadlineError: not finished"),
    ]  # the deadline: 4 + 20 - 4
    s = report.policy_summary(recs, expected=3, deadline_s=20.0)
    assert s["response_s"]["mean"] == pytest.approx(3.0)  # the finished ones only, as before
    assert s["response_all_lower_bound_s"] == pytest.approx((3.0 + 10.0 + 20.0) / 3)
    assert report.policy_summary(recs, expected=3)["response_all_lower_bound_s"] is None  # no deadline: unknown
    assert report.policy_summary(recs[:1], expected=1)["response_all_lower_bound_s"] == pytest.approx(3.0)
    # a policy that drops its slow requests no longer looks faster than one that serves them all
    served = report.policy_summary([rec(0, 0.0, 1.0, 3.0), rec(1, 1.0, 5.0, 12.0), rec(2, 4.0, 12.0, 20.0)], 3, 20.0)
    imp = report.changes_vs({"petals": s, "proposed": served}, "petals")["proposed"]
    assert imp["mean_response"] > 0 > imp["mean_response_all_lower_bound"]


def test_change_vs_petals_and_markdown():
    pols = {
        p: report.policy_summary([rec(0, 0.0, w, w + 2.0, policy=p)], 1)
        for p, w in (("petals", 8.0), ("proposed", 0.0))
    }
    imp = report.changes_vs(pols, "petals")
    assert imp["proposed"]["mean_response"] == pytest.approx(-0.8)  # 2 s vs 10 s: the paper's sign
    summary = {
        "where": "localhost",
        "command": "x",
        "policies": pols,
        "change_vs_petals": imp,
        "scale": {
            "time_scale": 2.0,
            "length_scale": 0.0625,
            "output_scale": 1.0,
            "max_length_tokens": 1024,
            "requests": 1,
            "offset": 0,
            "rate_per_s": 1.0,
            "trace_rate_per_s": 2.0,
            "interarrival_cv": 1.0,
            "trace_interarrival_cv": 1.0,
            "mean_input_tokens": 1.0,
            "mean_output_tokens": 3.0,
            "trace_mean_input_tokens": 16.0,
            "trace_mean_output_tokens": 3.0,
            "truncated": 0,
        },
    }
    md = report.summary_markdown(summary)
    assert "| metric | petals | proposed |" in md and "80.0%" in md
    json.dumps(summary)  # the summary is plain JSON


def test_hop_summary_splits_prefill_from_decode():
    t = [
        HopTiming(0, "A", 10, 50, 0.5, 0.4, 0.38),
        HopTiming(1, "B", 20, 50, 0.7, 0.6),
        HopTiming(0, "A", 10, 1, 0.1, 0.05, 0.04),
        HopTiming(1, "B", 20, 1, 0.2, 0.1),
        HopTiming(0, "A", 10, 1, 0.1, 0.05, 0.03),
    ]
    hops = hop_summary(t, {"A": "fast0", "B": "slow1"})
    assert [h["name"] for h in hops] == ["fast0", "slow1"]
    a = hops[0]
    assert (a["prefill_tokens"], a["decode_steps"]) == (50, 2)
    assert a["decode_client_s"] == pytest.approx(0.2) and a["decode_server_s"] == pytest.approx(0.1)
    assert a["prefill_batch_s"] == 0.38 and a["decode_batch_s"] == pytest.approx(0.07)
    assert hops[1]["prefill_batch_s"] is None and hops[1]["decode_batch_s"] is None  # a server that did not say


def test_model_check_against_footnote_11():
    recs = [
        {
            **rec(0, 0.0, 0.0, 1.0),
            "hops": [
                {
                    "name": "fast0",
                    "blocks": 10,
                    "prefill_tokens": 100,
                    "prefill_client_s": 0.25,
                    "prefill_server_s": 0.2,
                    "decode_steps": 4,
                    "decode_client_s": 0.6,
                    "decode_server_s": 0.4,
                }
            ],
        }
    ]
    servers = {"fast0": {"t_I": 1e-4, "t_O": 5e-3, "rtt_s": 0.05}}
    pts = model_check.hop_points(recs, servers)
    assert len(pts) == 1 and pts[0]["lone"]
    m = pts[0]["model"]
    assert m["prefill_compute"] == pytest.approx(10 * (0.001 + 1e-4 * 100))
    assert m["decode_compute"] == pytest.approx(10 * 5e-3 * 4) and m["decode_comm"] == pytest.approx(0.2)
    table = model_check.error_table(pts)
    assert table["lone"]["fast0"]["decode_comm"]["rel_error_of_means"] == pytest.approx(0.0)
    assert table["all"]["fast0"]["decode_compute"]["rel_error_of_means"] == pytest.approx(1.0)  # 0.4 vs 0.2


def test_prompts_have_exactly_the_requested_length():
    import numpy as np

    ids = prompt_ids(np.random.default_rng(0), 37, 49152)
    assert len(ids) == 37 and min(ids) >= 256 and max(ids) < 49152


def test_petals_memory_rule_and_missing_environment(tmp_path):
    from experiments import petals22

    # PETALS 2.2's _choose_num_blocks: floor((M - 2 GiB * h / 14336) / (s_m + 2 h * 4096 * 4)), SmolLM2 h = 576
    per_block = 14160384 + 2 * 576 * 4096 * 4
    autograd = 2 * 2**30 / 14336 * 576
    assert [petals22.petals_num_blocks(b * 2**20, 14160384, 576) for b in (480, 240)] == [12, 5]
    for budget in (480 * 2**20, 240 * 2**20, 2 * 2**30):
        n = petals22.petals_num_blocks(budget, 14160384, 576)
        assert n * per_block <= budget - autograd < (n + 1) * per_block
    python, model = petals22.petals_paths(tmp_path)
    assert "petals_2_2_cpu.sh" in petals22.why_unavailable(python, model)


def test_results_are_recomputed_from_the_files_of_a_stopped_run(tmp_path):
    from experiments.run import write_results

    scale = {
        "time_scale": 2.0,
        "length_scale": 0.0625,
        "output_scale": 1.0,
        "max_length_tokens": 1024,
        "requests": 2,
        "offset": 0,
        "rate_per_s": 1.0,
        "trace_rate_per_s": 2.0,
        "interarrival_cv": 1.0,
        "trace_interarrival_cv": 1.0,
        "mean_input_tokens": 1.0,
        "mean_output_tokens": 3.0,
        "trace_mean_input_tokens": 16.0,
        "trace_mean_output_tokens": 3.0,
        "truncated": 0,
    }
    (tmp_path / "scale.json").write_text(
        json.dumps(
            {
                "command": "c",
                "scale": scale,
                "rtt_ms": None,
                "rtt_anchor_indices": [],
                "config": {"policies": ["petals", "proposed", "bprr"]},
            }
        )
    )
    (tmp_path / "run_petals.json").write_text(json.dumps({"policy": "petals", "where": "localhost", "c": None}))
    (tmp_path / "records_petals.jsonl").write_text(
        "\n".join(json.dumps(rec(i, 0.0, 4.0, 6.0, policy="petals")) for i in range(2)) + "\n"
    )
    # proposed was stopped half-way: records but no run file; bprr never started
    (tmp_path / "records_proposed.jsonl").write_text(json.dumps(rec(0, 0.0, 0.0, 2.0)) + "\n")
    # a server's service log: its busiest minute is in the summary and the markdown
    (tmp_path / "service_proposed_fast0.jsonl").write_text(
        "\n".join(
            json.dumps({"t_s": 100.0 + i, "service_s": 0.5, "cpu_s": 0.1, "ok": True, "items": [["c", 1, False]] * 2})
            for i in range(10)
        )
        + "\n"
    )
    s = write_results(tmp_path)
    assert s["policies"]["proposed"]["peak_service"]["fast0"]["busy"] == pytest.approx(5.0 / 60)
    assert "fast0 0.08 / 0.017 / 2.0" in (tmp_path / "summary.md").read_text()
    assert set(s["policies"]) == {"petals", "proposed"}
    assert s["policies"]["proposed"]["lost"] == 1 and "stopped" in s["policies"]["proposed"]["loadgen_error"]
    assert s["change_vs_petals"]["proposed"]["mean_response"] == pytest.approx(-2 / 3)
    assert (tmp_path / "summary.md").exists() and (tmp_path / "cdf.png").exists()


def test_model_check_with_the_calibrated_model_and_model_error_in_the_summary():
    recs = [
        {
            **rec(0, 0.0, 0.0, 1.0),
            "hops": [
                {
                    "name": "slow0",
                    "blocks": 10,
                    "prefill_tokens": 100,
                    "prefill_client_s": 0.25,
                    "prefill_server_s": 0.2,
                    "decode_steps": 4,
                    "decode_client_s": 0.6,
                    "decode_server_s": 0.44,
                }
            ],
        }
    ]
    # fitted: t_o 10 ms per step and server (not per block), hop cost 10 ms beyond the 30 ms RTT
    servers = {"slow0": {"t_I": 1e-4, "t_O": 1e-3, "t_o": 0.01, "hop_cost_s": 0.01, "rtt_s": 0.03}}
    pts = model_check.hop_points(recs, servers)
    m = pts[0]["model"]
    assert m["prefill_compute"] == pytest.approx(0.01 + 10 * 1e-4 * 100)
    assert m["decode_compute"] == pytest.approx(4 * (0.01 + 10 * 1e-3))
    assert m["decode_comm"] == pytest.approx(4 * 0.04) and m["prefill_comm"] == pytest.approx(0.04)
    errors = model_check.model_error(model_check.error_table(pts))
    assert set(errors["slow0"]) == {"prefill_compute", "decode_compute", "decode_comm"}
    assert errors["slow0"]["decode_compute"] == pytest.approx(0.44 / 0.08 - 1)
    assert errors["slow0"]["decode_comm"] == pytest.approx(0.16 / 0.16 - 1, abs=1e-9)
    md = model_check.model_error_markdown(errors)
    assert "slow0" in md and "over the bound" in md
    # with a measured prompt transfer (50 us per token there and back) the prefill step's model has it
    servers["slow0"]["transfer_s_per_token"] = 50e-6
    m = model_check.hop_points(recs, servers)[0]["model"]
    assert m["prefill_comm"] == pytest.approx(0.04 + 100 * 50e-6) and m["decode_comm"] == pytest.approx(4 * 0.04)


def test_cpu_shares_replace_the_emulated_slowdown_where_cgroups_allow(monkeypatch):
    from experiments.table1 import Table1Config, cpu_shares, server_args
    from netem import cpu as netem_cpu

    monkeypatch.setattr(netem_cpu, "detect", lambda: netem_cpu.CgroupLayout(1, None, None, None))
    monkeypatch.setattr(netem_cpu, "writable", lambda layout: None)
    cfg = Table1Config(servers=9, fast_servers=3, n_cpus=2.0)
    shares, why = cpu_shares(cfg)
    assert set(shares) == {"client", *(f"fast{i}" for i in range(3)), *(f"slow{i}" for i in range(6))}
    assert sum(shares.values()) == pytest.approx(0.9 * 2.0)  # together within the cores: no host waits for another
    assert shares["fast0"] / shares["slow0"] == pytest.approx(cfg.slow_slowdown)  # the paper's slow/fast ratio
    args = server_args(cfg, shares)
    assert all("--emulate-slowdown" not in a for a in args)
    # where shares cannot make slow servers slow, the emulated slowdown stays
    for cfg2, word in (
        (Table1Config(cpu="off"), "off"),
        (Table1Config(netem=False), "no-netem"),
        (Table1Config(device="cuda"), "GPU kernels"),
    ):
        shares2, why2 = cpu_shares(cfg2)
        assert shares2 is None and word in why2
        assert sum("--emulate-slowdown" in a for a in server_args(cfg2, shares2)) == cfg2.servers - cfg2.fast_servers
    monkeypatch.setattr(netem_cpu, "writable", lambda layout: "read-only /sys/fs/cgroup")
    assert cpu_shares(cfg) == (None, "no CPU shares (read-only /sys/fs/cgroup); slow servers by --emulate-slowdown")
    explicit, _ = cpu_shares(Table1Config(cpu="fast=0.3,slow=0.1,slow5=0.2"))
    assert (
        explicit["fast2"] == 0.3 and explicit["slow0"] == 0.1 and explicit["slow5"] == 0.2 and "client" not in explicit
    )
    assert server_args(Table1Config(device="cuda"))[0][-2:] == ["--device", "cuda"]


class _FakeClock:
    def __init__(self):
        self.t = 0.0

    def monotonic(self):
        return self.t

    def sleep(self, s):
        self.t += s


def test_wait_plan_reports_a_lasting_plan_error_without_sitting_out_the_timeout(monkeypatch):
    from types import SimpleNamespace

    from experiments import table1

    clock = _FakeClock()
    monkeypatch.setattr(table1, "time", clock)
    swarm = SimpleNamespace(servers=[SimpleNamespace(name=f"s{i}", alive=True) for i in range(3)])

    def status(registered, error):
        return {"plan_installed": False, "plan_error": error, "servers": [{}] * registered, "events": []}

    # servers still registering: the error is expected and waited out; then the plan comes online
    seq = iter([status(1, "no complete chain")] * 100 + [status(3, None), {"plan_installed": True}])
    launcher = SimpleNamespace(fetch_json=lambda host, url: next(seq))
    assert table1.wait_plan(launcher, "http://o/", swarm)["plan_installed"]
    # every server registered and the same error for longer than the grace: raised long before the timeout
    clock.t = 0.0
    launcher = SimpleNamespace(fetch_json=lambda host, url: status(3, "PETALS placement leaves block 2 uncovered"))
    with pytest.raises(RuntimeError, match="block 2 uncovered"):
        table1.wait_plan(launcher, "http://o/", swarm, timeout_s=600.0)
    assert table1.PLAN_ERROR_GRACE_S < clock.t < 600.0


def write_proposed_run(path, requests: int, servers: dict, **run) -> None:
    """A results folder's scale.json and run_proposed.json (the model `servers` at the end) for write_results."""
    scale = {
        "time_scale": 2.0,
        "length_scale": 0.0625,
        "output_scale": 1.0,
        "max_length_tokens": 1024,
        "requests": requests,
        "offset": 0,
        "rate_per_s": 1.0,
        "trace_rate_per_s": 2.0,
        "interarrival_cv": 1.0,
        "trace_interarrival_cv": 1.0,
        "mean_input_tokens": 100.0,
        "mean_output_tokens": 5.0,
        "trace_mean_input_tokens": 1600.0,
        "trace_mean_output_tokens": 5.0,
        "truncated": 0,
    }
    (path / "scale.json").write_text(
        json.dumps(
            {
                "command": "c",
                "scale": scale,
                "rtt_ms": None,
                "rtt_anchor_indices": [],
                "config": {"policies": ["proposed"]},
            }
        )
    )
    (path / "run_proposed.json").write_text(
        json.dumps({"policy": "proposed", "where": "localhost", "final_servers": servers, **run})
    )


def test_the_model_probes_sessions_count_alone_and_stay_out_of_the_replays_statistics(tmp_path):
    """Under the trace's bursts no replayed request may run alone; the probe's sessions (one after another,
    after the replay) give each chain's servers lone requests, and only those enter model_error."""
    from experiments.run import write_results

    hop = {
        "name": "fast0",
        "blocks": 10,
        "prefill_tokens": 100,
        "prefill_client_s": 0.25,
        "prefill_server_s": 0.2,
        "decode_steps": 4,
        "decode_client_s": 0.6,
    }
    # two replayed requests that overlap (neither alone), server time 0.8 s each (waiting in the batch)
    replay = [{**rec(i, 0.0, 0.0, 2.0), "hops": [{**hop, "decode_server_s": 0.8}]} for i in range(2)]
    # the probe's two sessions ran one after another: 0.22 s of decode each
    probe = [
        {
            **rec(1_000_000 + i, 0.0, 3.0 * i, 3.0 * i + 1.0, policy="proposed-probe"),
            "hops": [{**hop, "decode_server_s": 0.22}],
        }
        for i in range(2)
    ]
    servers = {"fast0": {"t_I": 1e-4, "t_O": 5e-3, "t_o": 0.0, "rtt_s": 0.05}}  # model decode: 4 x 10 x 5 ms
    assert not any(p["lone"] for p in model_check.hop_points(replay, servers))
    write_proposed_run(tmp_path, 2, servers, probe={"sessions": 2, "finished": 2})
    (tmp_path / "records_proposed.jsonl").write_text("".join(json.dumps(r) + "\n" for r in replay))
    s = write_results(tmp_path)
    assert s["model_error"] == {}  # without the probe: nothing ran alone
    (tmp_path / "probe_proposed.jsonl").write_text("".join(json.dumps(r) + "\n" for r in probe))
    s = write_results(tmp_path)
    assert s["model_error"]["fast0"]["decode_compute"] == pytest.approx(0.22 / 0.2 - 1)
    # the replay's statistics are the replay's alone: 2 requests, the probe's decode times not in "all"
    assert s["policies"]["proposed"]["requests"] == 2 and s["policies"]["proposed"]["probe"]["finished"] == 2
    assert s["model_check"]["all"]["fast0"]["decode_compute"]["measured_mean_s"] == pytest.approx(0.8)
    assert "fast0" in (tmp_path / "summary.md").read_text().split("Model error")[1]


def test_model_drift_times_the_same_lone_step_in_the_replay_and_in_the_probe(tmp_path):
    """A machine that slowed between the replay (the fit) and the probe reads as model error; each server's
    service log measures by how much (its lone decode steps in both phases, told apart by the phases'
    client ids), and the net error divides that out. Batches of other kinds do not count."""
    from experiments.run import write_results

    def batch(t_s, client, wall_s, *, tokens=1, prefill=False, blocks=10, more=()):
        return {
            "t_s": t_s,
            "service_s": wall_s,
            "cpu_s": wall_s / 5,
            "ok": True,
            "items": [[client, tokens, prefill], *more],
            "blocks": [blocks] * (1 + len(more)),
        }

    log = [batch(1.0 + i, "warmup", 0.5) for i in range(6)]  # the warm-up: slower still
    log += [batch(10.0 + i, "replay", 0.05) for i in range(8)]  # the replay's lone steps
    log += [batch(20.0 + i, "replay", 0.09, more=[["replay", 1, False]]) for i in range(30)]  # batched: not lone
    log += [batch(50.0, "replay", 0.7, tokens=100, prefill=True)]  # a prefill: not a decode step
    log += [batch(60.0 + i, "probe", 0.055) for i in range(6)]  # the probe: 10 % slower
    log += [batch(70.0 + i, "probe", 0.5, blocks=3) for i in range(2)]  # other blocks, too few
    (tmp_path / "service_proposed_fast0.jsonl").write_text("".join(json.dumps(b) + "\n" for b in log))
    hop = {
        "name": "fast0",
        "blocks": 10,
        "prefill_tokens": 100,
        "prefill_client_s": 0.25,
        "prefill_server_s": 0.2,
        "decode_steps": 4,
        "decode_client_s": 0.6,
    }
    probe = [
        {
            **rec(1_000_000 + i, 0.0, 3.0 * i, 3.0 * i + 1.0, policy="proposed-probe"),
            "hops": [{**hop, "decode_server_s": 0.22}],
        }
        for i in range(2)
    ]
    servers = {"fast0": {"t_I": 1e-4, "t_O": 5e-3, "t_o": 0.0, "rtt_s": 0.05}}  # model decode: 4 x 10 x 5 ms
    write_proposed_run(tmp_path, 1, servers)
    (tmp_path / "records_proposed.jsonl").write_text(json.dumps({**rec(0, 0.0, 0.0, 1.0), "hops": []}) + "\n")
    (tmp_path / "probe_proposed.jsonl").write_text("".join(json.dumps(r) + "\n" for r in probe))
    d = write_results(tmp_path)["model_drift"]["proposed"]["fast0"]
    assert (d["blocks"], d["replay_n"], d["probe_n"]) == (10, 8, 6)
    assert d["replay_wall_ms"] == pytest.approx(50) and d["probe_wall_ms"] == pytest.approx(55)
    assert d["wall_ratio"] == pytest.approx(1.1) and d["cpu_ratio"] == pytest.approx(1.1)
    assert d["decode_compute_error"] == pytest.approx(0.22 / 0.2 - 1)
    assert d["decode_compute_net_of_drift"] == pytest.approx((0.22 / 0.2) / 1.1 - 1)
    assert "net of drift" in (tmp_path / "summary.md").read_text()
    # without a probe there is nothing to compare the replay with
    (tmp_path / "probe_proposed.jsonl").unlink()
    assert write_results(tmp_path)["model_drift"] == {}


def test_the_probe_targets_only_chains_it_can_reach_by_avoiding_servers():
    from experiments.table1 import probe_targets

    chains = [
        {"servers": ["f1"]},
        {"servers": ["s2", "f1"]},
        {"servers": ["s2", "s3"]},
        {"servers": ["f0"]},
        {"servers": ["s4", "f0", "s5"]},
        {"servers": ["s4", "s5"]},
    ]
    # s2 -> f1 holds the chain f1 (avoiding the rest, JFFC may grant f1 alone); s4 -> f0 -> s5 holds s4 -> s5
    assert [k["servers"] for k in probe_targets(chains)] == [["f1"], ["s2", "s3"], ["f0"], ["s4", "s5"]]
    assert probe_targets([{"servers": ["a"]}, {"servers": ["a"]}]) == [{"servers": ["a"]}, {"servers": ["a"]}]


def test_peak_service_finds_the_busiest_window_of_a_service_log():
    from hypothesis import given, settings
    from hypothesis import strategies as st

    @settings(max_examples=40, deadline=None)
    @given(
        st.lists(st.tuples(st.floats(0.0, 500.0), st.floats(0.001, 5.0), st.integers(1, 4)), min_size=1, max_size=60),
        st.floats(5.0, 120.0),
    )
    def check(batches, window_s):
        log = [{"t_s": t, "service_s": s, "cpu_s": s / 2, "items": [["c", 1, False]] * k} for t, s, k in batches]
        peak = report.peak_service(log, window_s)
        # brute force: every window (t_i - window_s, t_i]
        best = max(sum(s for t, s, _ in batches if ti - window_s < t <= ti) for ti, _, _ in batches)
        assert peak["busy"] == pytest.approx(best / window_s)
        assert peak["cpu_cores"] == pytest.approx(peak["busy"] / 2)
        assert 1.0 <= peak["sessions_per_batch"] <= 4.0

    check()
    assert report.peak_service([]) is None
    assert report.peak_service([{"t_s": 1.0, "service_s": 1.0, "ok": False, "items": []}]) is None


def test_extend_adds_columns_to_a_recorded_run_and_refuses_another_workload(tmp_path, monkeypatch, tiny_llama_path):
    """`--extend`: a later sitting runs more policies into the folder of an earlier run; they replay the
    recorded requests at the recorded time scale (an auto scale is measured again at each start), the
    summary covers every column, and a folder of other settings is refused naming what differs."""
    import numpy as np

    from experiments import run
    from experiments.table1 import Table1Config
    from orchestrator.sim import traces
    from server.range_profile import RangeProfile

    arrivals = np.arange(12, dtype=float) * 0.5
    monkeypatch.setattr(
        traces, "load_azure_trace", lambda data=None: traces.RequestTrace(arrivals, np.full(12, 320), np.full(12, 4))
    )
    speed = {"t_O": 1e-3}  # the start-up profile of each sitting: the auto time scale follows it
    monkeypatch.setattr(
        run,
        "measured_block_times",
        lambda *a: (RangeProfile(2e-4, speed["t_O"], 0.0, blocks=2, batches=33), tiny_llama_path),
    )
    ran = []

    def fake_policy(cfg, policy, info, rtt_ms, out, gpu_env=None):
        assert gpu_env == {}  # no --gpu-isolation: no MPS environment
        ran.append((policy, [r.to_dict() for r in info["_requests"]]))
        (out / "requests.json").write_text(json.dumps([r.to_dict() for r in info["_requests"]]))
        (out / f"records_{policy}.jsonl").write_text(
            "\n".join(
                json.dumps(rec(i, r.arrival_s, r.arrival_s, r.arrival_s + 2.0, policy=policy))
                for i, r in enumerate(info["_requests"])
            )
            + "\n"
        )
        return {"policy": policy, "where": "localhost"}

    monkeypatch.setattr(run, "run_policy", fake_policy)

    cfg = Table1Config(
        requests=6, policies=("proposed", "petals"), netem=False, cpu="off", out=str(tmp_path), command="first"
    )
    run.run_table1(cfg)
    first_scale = json.loads((tmp_path / "scale.json").read_text())["scale"]["time_scale"]
    speed["t_O"] = 3e-3  # a slower machine today: its own auto scale would differ
    s = run.run_table1(
        Table1Config(
            requests=6, policies=("bprr",), netem=False, cpu="off", out=str(tmp_path), command="second", extend=True
        )
    )
    assert set(s["policies"]) == {"proposed", "petals", "bprr"}
    assert ran[2][1] == ran[0][1]  # the same requests, at the recorded time scale
    meta = json.loads((tmp_path / "scale.json").read_text())
    assert meta["scale"]["time_scale"] == first_scale and meta["command"] == "first"
    assert meta["extended_by"] == ["second"] and meta["config"]["policies"] == ["proposed", "petals", "bprr"]

    with pytest.raises(run.ExtendMismatchError, match="requests: 6 there, 5 here"):
        run.run_table1(
            Table1Config(requests=5, policies=("jffc-only",), netem=False, cpu="off", out=str(tmp_path), extend=True)
        )
    with pytest.raises(FileNotFoundError, match="no scale.json"):
        run.run_table1(
            Table1Config(policies=("jffc-only",), netem=False, cpu="off", out=str(tmp_path / "new"), extend=True)
        )
    # a run recorded before `daemons_in_share` existed had its servers' daemons inside the shares: only
    # --daemons-in-share extends it
    meta["config"].pop("daemons_in_share")
    (tmp_path / "scale.json").write_text(json.dumps(meta))
    with pytest.raises(run.ExtendMismatchError, match="daemons_in_share: True there, False here"):
        run.run_table1(
            Table1Config(requests=6, policies=("jffc-only",), netem=False, cpu="off", out=str(tmp_path), extend=True)
        )
    run.run_table1(
        Table1Config(
            requests=6,
            policies=("jffc-only",),
            netem=False,
            cpu="off",
            out=str(tmp_path),
            daemons_in_share=True,
            extend=True,
        )
    )
    assert len(ran) == 4  # a refused extension starts nothing
    # one recorded before `max_batch_tokens` existed ran the servers' default budget, 2048: only that extends it
    meta["config"].pop("max_batch_tokens")
    (tmp_path / "scale.json").write_text(json.dumps(meta))
    with pytest.raises(run.ExtendMismatchError, match="max_batch_tokens: 2048 there, 128 here"):
        run.run_table1(
            Table1Config(
                requests=6,
                policies=("jffc-only",),
                netem=False,
                cpu="off",
                out=str(tmp_path),
                daemons_in_share=True,
                max_batch_tokens=128,
                extend=True,
            )
        )
    run.run_table1(
        Table1Config(
            requests=6,
            policies=("jffc-only",),
            netem=False,
            cpu="off",
            out=str(tmp_path),
            daemons_in_share=True,
            extend=True,
        )
    )
    assert len(ran) == 5
