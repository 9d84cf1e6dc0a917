"""Servers measure their real service: every batch's record (scheduler -> ServiceMeter -> rpc_info's
typed BatchService list), and the start-up profile of the whole hosted range through the real step
path, cached by shape and CPU share and dropped when live service disagrees (tiny random Llama)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from petals_chain.runtime.block_range import BlockRange
from petals_chain.wire import codec as wire
from petals_chain.wire import records as wire_records
from server import range_profile
from server.policies import make_policy
from server.scheduler import StepScheduler
from server.service_meter import ServiceMeter
from server.step_request import StepRequest


@pytest.fixture(autouse=True)
def one_thread():
    """As servers run (`--num-threads 1` in the swarm tests): several threads thrash a loaded machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_every_batch_is_measured_and_served_by_cursor_as_typed_records(tiny_llama_path):
    br = BlockRange(tiny_llama_path, 0, 6)
    meter = ServiceMeter()
    sched = StepScheduler(br, make_policy("fcfs"), start_thread=False, on_batch=meter.on_batch)
    done = []
    a, b = br.allocate_kv(16), br.allocate_kv(16, first_block=3)  # b enters mid-range: 3 blocks
    sched.submit(
        StepRequest(a, torch.randn(5, br.hidden_size), key="a", client_id="c"), lambda out, err: done.append(err)
    )
    sched.submit(
        StepRequest(b, torch.randn(2, br.hidden_size), key="b", client_id="c"), lambda out, err: done.append(err)
    )
    while sched.run_once():
        pass
    sched.submit(
        StepRequest(a, torch.randn(1, br.hidden_size), key="a", client_id="c"), lambda out, err: done.append(err)
    )
    while sched.run_once():
        pass
    sched.stop()
    assert done == [None, None, None]
    recs = meter.records()
    assert [r.seq for r in recs] == list(range(len(recs)))
    assert sum(r.prefill_tokens for r in recs) == 7 and sum(r.decode_tokens for r in recs) == 1
    assert sum(r.prefill_block_tokens for r in recs) == 5 * 6 + 2 * 3 and sum(r.decode_block_tokens for r in recs) == 6
    assert all(r.wall_s > 0 and r.cpu_s >= 0 and r.sessions >= 1 for r in recs)
    # rpc_info: the records after a cursor, typed on the wire; no cursor, no records
    reply = wire_records.InfoReply.from_wire(wire_records.InfoReply(_info(), meter.since(recs[0].seq)).to_wire())
    assert [r.seq for r in reply.service] == [r.seq for r in recs[1:]]
    assert isinstance(reply.service[0], wire_records.BatchService)
    assert meter.since(None) is None and "service" not in wire_records.InfoReply(_info(), None).to_wire()
    req = wire.decode_request(wire.request(wire_records.InfoRequest(service_since_seq=-1)), wire_records.InfoRequest)
    assert req.service_since_seq == -1
    assert wire.decode_request(wire.request({}), wire_records.InfoRequest).service_since_seq is None  # an older client


def _info():
    return wire_records.ServerInfo("p", "m", 0, 6, "online", 1, 1, 1, 64, 1, 1e-4, 1e-3)


def test_the_range_profile_is_fitted_through_the_step_path_cached_by_shape_and_dropped_on_disagreement(
    tiny_llama_path, tmp_path, monkeypatch
):
    br = BlockRange(tiny_llama_path, 0, 6)
    prof = range_profile.cached_range_profile(br, "tiny", path=tmp_path / "t.json")
    assert prof.blocks == 6 and prof.batches >= 6
    # the tiny model's per-token costs are microseconds next to the per-step overhead: on a loaded
    # machine any one term may fit to 0, but none is negative and the batches cost something
    times = (prof.prefill_s_per_token, prof.decode_s_per_token, prof.step_overhead_s)
    assert all(t >= 0 for t in times) and prof.decode_s_per_token + prof.step_overhead_s > 0
    key = range_profile.profile_key("tiny", br)
    assert "blocks=6" in key and "cpu=" in key and key.startswith(range_profile.PROFILE_VERSION)
    assert range_profile.profile_key("tiny", BlockRange(tiny_llama_path, 0, 3)) != key  # another block count

    def no_measuring(*a, **k):
        raise AssertionError("a cached profile must not be measured again")

    monkeypatch.setattr(range_profile, "measure_range", no_measuring)
    assert range_profile.cached_range_profile(br, "tiny", path=tmp_path / "t.json") == prof
    assert prof.lone_step_s == pytest.approx(prof.blocks * prof.lone_decode_s_per_block) and prof.lone_step_s > 0
    assert not range_profile.disagrees(prof, prof.lone_step_s * 1.8, 500)  # load slows a lone step this much
    assert not range_profile.disagrees(prof, prof.lone_step_s * 0.6, 500)
    assert not range_profile.disagrees(prof, prof.lone_step_s * 3, 10)  # too few batches to say
    assert range_profile.disagrees(prof, prof.lone_step_s * 3, 500)
    assert range_profile.disagrees(prof, prof.lone_step_s * 0.4, 500)
    assert range_profile.forget_profile(br, "tiny", path=tmp_path / "t.json")
    with pytest.raises(AssertionError, match="measured again"):
        range_profile.cached_range_profile(br, "tiny", path=tmp_path / "t.json")


def test_a_process_reads_its_own_cpu_share():
    from netem import cpu as netem_cpu

    try:
        layout = netem_cpu.detect()
    except netem_cpu.CpuLimitUnavailableError as e:
        pytest.skip(str(e))
    if netem_cpu.writable(layout):
        pytest.skip(netem_cpu.writable(layout))
    name = "s" + __import__("uuid").uuid4().hex[:6]
    try:
        share = netem_cpu.apply(name, {0: 0.3}, layout)[0]
        code = (
            "import types; from netem.cpu import own_cpu_share; from server.range_profile import profile_clock; "
            "print(own_cpu_share(), profile_clock(types.SimpleNamespace(device='cpu')))"
        )
        out = subprocess.run(
            netem_cpu.enter_argv(share.procs_files, [sys.executable, "-c", code]),
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        ).stdout.split()
        # a quota makes the start-up profile count CPU seconds per share, not a burst's wall time
        assert float(out[0]) == pytest.approx(0.3) and out[1] == "cpu/share"
    finally:
        netem_cpu.remove(name, layout)


def test_a_profile_under_a_cpu_quota_counts_cpu_seconds_per_share():
    """Under a CFS quota a short batch runs at full speed until the period's quota is spent: its wall
    time says nothing about the share. CPU seconds / share is the sustained speed of that host."""
    assert range_profile.profile_clock(_Dev("cpu")) in ("cpu", "cpu/share")  # "cpu/share" inside a quota
    assert range_profile.profile_seconds(0.010, 0.004, "wall", 0.25) == 0.010
    assert range_profile.profile_seconds(0.010, 0.004, "cpu", 0.25) == 0.004
    assert range_profile.profile_seconds(0.010, 0.004, "cpu/share", 0.25) == pytest.approx(0.016)
    with pytest.raises(ValueError, match="quota"):
        range_profile.profile_seconds(0.010, 0.004, "cpu/share", None)
    with pytest.raises(ValueError, match="unknown profile clock"):
        range_profile.profile_seconds(0.010, 0.004, "gpu", 1.0)


class _Dev:
    def __init__(self, device: str):
        self.device = device


def test_live_service_that_contradicts_the_profile_drops_it_once(monkeypatch, caplog):
    from types import SimpleNamespace

    from server import block_server
    from server.lifecycle import ServerLifecycle
    from server.service_meter import ServiceMeter

    forgotten = []
    monkeypatch.setattr(block_server, "forget_profile", lambda br, name: forgotten.append(name) or len(forgotten) == 1)
    srv = block_server.BlockServer.__new__(block_server.BlockServer)
    srv.lifecycle = ServerLifecycle()
    profile = range_profile.RangeProfile(1e-4, 1e-3, 1e-3, blocks=4, batches=20)
    srv.lifecycle.install(SimpleNamespace(block_range=SimpleNamespace(start=0, end=4)), None, profile)
    srv.config, srv.model_name = SimpleNamespace(emulate_slowdown=1.0), "m"
    srv.meter, srv._profile_checked_seq = ServiceMeter(), -1

    def serve(n):  # decode batches of 1-4 sessions at 3x the profile's t_O
        for i in range(n):
            k = 1 + i % 4
            srv.meter.on_batch(
                {"items": [("c", 1, False)] * k, "service_s": 1e-3 + 3e-3 * 4 * k, "cpu_s": 0.0, "blocks": [4] * k}
            )

    serve(120)
    assert srv.check_profile() is True and forgotten == ["m"]
    serve(120)
    assert srv.check_profile() is False and forgotten == ["m"]  # said once, not every minute
    assert caplog.text.count("disagrees with the cached start-up profile") == 1
