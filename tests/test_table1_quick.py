"""`petals-chain experiment table1 --quick` end to end (the proposed column): a real swarm, the real trace,
every request accounted for, results in the documented schema, nothing left running."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import psutil
import pytest

from netem.topology import (
    AZURE_CODE_TRACE_FILENAME,
    RIPE_ATLAS_FILENAME,
    DataNotFoundError,
    resolve_data_file,
)

REPO = Path(__file__).resolve().parents[1]


def _netem_usable() -> tuple[bool, str]:
    try:
        import netem
        from netem.system import require_capabilities
    except ImportError as e:
        return False, f"netem.Network is not available ({e})"
    if not hasattr(netem, "Network"):
        return False, "netem.Network is not available"
    try:
        require_capabilities(tc=False, tun=True)
    except Exception as e:  # noqa: BLE001 - any missing capability means: run without emulation
        return False, str(e)
    return True, ""


def _ours(marker: str) -> list[psutil.Process]:
    out = []
    for p in psutil.process_iter():
        try:
            if p.environ().get("TABLE1_TEST_MARKER") == marker:
                out.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            pass
    return out


def _faster_cpu_dtype() -> str:
    """float16 where this CPU multiplies it faster than float32, else float32. Hosts differ by 60x here:
    with AVX-512 FP16 or AMX float16 decodes about twice as fast as float32, while on an AVX2-only host a
    float16 GEMM is ~30x slower than float32 (a 300-token prefill took 84 s, the test 16 min)."""
    import time

    import torch

    def seconds(dtype) -> float:
        a, w = torch.randn(64, 576, dtype=dtype), torch.randn(576, 1536, dtype=dtype)
        a @ w  # first call: kernel selection
        t0 = time.perf_counter()
        for _ in range(5):
            a @ w
        return time.perf_counter() - t0

    return "float16" if seconds(torch.float16) < seconds(torch.float32) else "float32"


@pytest.mark.integration
@pytest.mark.model
def test_quick_mode_end_to_end(tmp_path):
    try:
        resolve_data_file(AZURE_CODE_TRACE_FILENAME)
    except DataNotFoundError as e:
        pytest.skip(f"Azure code trace not available: {e}")
    netem_ok, why = _netem_usable()
    try:
        resolve_data_file(RIPE_ATLAS_FILENAME)
    except DataNotFoundError as e:
        netem_ok, why = False, str(e)
    marker = uuid.uuid4().hex
    net_name = "t1q" + marker[:4]
    out = tmp_path / "table1"
    # --quick with the proposed column only: fewer requests, a fixed time scale and one policy keep the
    # test bounded (the PETALS policy's swarm added 2 min 15 s of the suite's 22 min; that policy is
    # driven live by tests/test_online_policies.py, and the report's comparison of columns by
    # tests/test_table1_report.py), and 4 servers (2 fast, 2 slow) instead of 9: each starts SmolLM2
    # and runs at a fraction of a core, and 4 still make chains of several servers (a slow server's
    # 240 MiB cannot hold the 405 MiB of blocks). The dtype is the faster of float16 and float32 on this
    # CPU (`_faster_cpu_dtype`); the load generator's client runs the servers' dtype either way
    argv = [
        sys.executable,
        "-m",
        "petals_chain.cli",
        "experiment",
        "table1",
        "--quick",
        "--policies",
        "proposed",
        "--requests",
        "6",
        "--dtype",
        _faster_cpu_dtype(),
        "--time-scale",
        "3",
        "--deadline",
        "240",
        "--warmup-per-chain",
        "1",
        "--servers",
        "4",
        "--fast-servers",
        "2",
        "--out",
        str(out),
        "--netem-name",
        net_name,
    ] + ([] if netem_ok else ["--no-netem"])
    env = {**os.environ, "TABLE1_TEST_MARKER": marker, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        stdout, _ = proc.communicate(timeout=1500)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)  # the driver stops its swarm and network on SIGTERM
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
        for p in _ours(marker):  # whatever a failed run left behind
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        if netem_ok:
            import netem

            netem.cleanup(net_name)
    assert proc.returncode == 0, stdout[-4000:]
    assert not _ours(marker), "processes of the run are still alive"
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary["policies"]) == {"proposed"}
    assert ("netem" in summary["where"]) == netem_ok, (summary["where"], why)
    sc = summary["scale"]
    for key in ("time_scale", "length_scale", "output_scale", "rate_per_s", "interarrival_cv", "requests"):
        assert key in sc
    assert sc["time_scale"] == 3 and sc["requests"] == 6
    for policy, s in summary["policies"].items():
        assert s["requests"] == 6 and s["finished"] + s["failed"] == 6 and s["lost"] == 0, (policy, s)
        assert s["finished"] >= 1, (policy, s["errors"])
        for key in ("response_s", "wait_s", "service_s"):
            assert set(s[key]) >= {"mean", "median", "p95", "p99", "max"}
        recs = [json.loads(line) for line in (out / f"records_{policy}.jsonl").read_text().splitlines()]
        assert sorted(r["index"] for r in recs) == list(range(6))
        for r in recs:
            if r["error"] is None:
                assert r["generated_tokens"] == r["output_tokens"] and r["chain"]
                assert r["arrival_s"] <= r["start_s"] + 0.05 and r["start_s"] <= r["end_s"]
            else:
                assert r["error"].split(":")[0] and "hidden states must be" not in r["error"], r["error"]
    assert summary["policies"]["proposed"]["c"] >= 1
    # the processes' output beside the records: every grant and release of the orchestrator, the load generator's
    orch_log = (out / "log_proposed_orchestrator.txt").read_text()
    assert "granted after" in orch_log and "released after" in orch_log, orch_log[-2000:]
    assert "loadgen:" in (out / "log_proposed_loadgen.txt").read_text()
    # after the warm-up the calibrated re-plans are held (SIGUSR1): the replay and the probe ran on one plan
    assert "re-plans held" in orch_log, orch_log[-2000:]
    calibrated = json.loads((out / "status_proposed_calibrated.json").read_text())
    final = json.loads((out / "status_proposed_final.json").read_text())
    assert calibrated["model_replans_held"] and final["plan_version"] == calibrated["plan_version"]
    # the model probe: after the replay, one session through each chain of the final plan, each alone; their
    # servers get a model error even when no replayed request ran alone
    probe = summary["policies"]["proposed"]["probe"]
    assert probe["sessions"] >= 1 and probe["finished"] == probe["sessions"], probe
    probe_recs = [json.loads(line) for line in (out / "probe_proposed.jsonl").read_text().splitlines()]
    assert len(probe_recs) == probe["sessions"] and all(r["error"] is None for r in probe_recs)
    assert summary["model_error"] and all("decode_compute" in v for v in summary["model_error"].values())
    for policy, s in summary["policies"].items():  # the model the results are checked against: the fitted one
        assert s["final_servers"] and any(v["model_source"] == "live" for v in s["final_servers"].values()), policy
        if netem_ok and sc.get("cpu_shares"):  # each host's share and its measured use
            assert set(s["host_cpu"]) == set(sc["cpu_shares"]) and all(
                v["used_cores"] is not None and v["used_cores"] <= v["share_cores"] * 1.2 + 0.05
                for v in s["host_cpu"].values()
            ), s["host_cpu"]
            # every server's DHT process and p2p daemon left its host's share, and still counted apart
            moved = s["daemons_exempted"]
            assert set(moved) == set(sc["cpu_shares"]) - {"client"} and all(len(p) == 2 for p in moved.values()), moved
            assert all(v["daemons_cores"] is not None for h, v in s["host_cpu"].items() if h != "client")
    from netem import cpu as netem_cpu

    try:
        assert not netem_cpu.owned_groups(net_name, netem_cpu.detect())  # the groups went with the network
    except netem_cpu.CpuLimitUnavailableError:
        pass
    assert (out / "cdf.png").stat().st_size > 1000 and "| metric |" in (out / "summary.md").read_text()
