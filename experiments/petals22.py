"""Real PETALS 2.2.0 as a fifth Table 1 column, on the same hosts, trace and memory budgets.

PETALS runs from its own virtual environment (transformers 4.34, hivemind 1.1.12 with the small
compatibility patch) and its converted SmolLM2 checkpoint, both built by
`../shared/anchors/petals_2_2_cpu.sh` (default places: ~/.cache/petals-anchor/venv and .../smollm2-hf).
Per run: `petals.cli.run_dht` on the client host, 9 `petals.cli.run_server` on the servers' hosts,
each choosing its blocks by PETALS' own placement (no --block_indices) with `--num_blocks` from
PETALS' own memory rule applied to our budget (`petals_num_blocks`), then
`experiments.petals_loadgen` replays the same requests through PETALS' client.

What differs from our servers (stated in the results): PETALS' cache is a per-server token pool
(`--attn_cache_tokens 4096`, PETALS' default for models without multi-query attention) that sessions wait for, not a
reservation planned by an
orchestrator; PETALS measures throughput with a network speed test that needs the internet, so
`--throughput` is given (1 / (K t_O) of our measurement); slow servers are NOT slowed (PETALS has no
emulation flag, and we do not patch it), which favours PETALS.
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import threading
import time
from pathlib import Path

from experiments.cpu import CpuMeter

DEFAULT_WORK = Path.home() / ".cache" / "petals-anchor"
DHT_PREFIX = "smollm2-hf"
GIB = 2**30


def petals_paths(work: str | os.PathLike | None = None) -> tuple[Path, Path]:
    w = Path(work or os.environ.get("PETALS_ANCHOR_WORK", DEFAULT_WORK))
    return w / "venv" / "bin" / "python", w / "smollm2-hf"


def why_unavailable(python: Path, model: Path) -> str | None:
    if not python.exists():
        return (
            f"no PETALS 2.2 environment at {python.parent.parent}: run `bash ../shared/anchors/petals_2_2_cpu.sh` "
            "once (it builds the venv and converts the checkpoint), or pass --petals-work"
        )
    if not (model / "config.json").exists():
        return f"no converted checkpoint at {model}: run ../shared/anchors/petals_2_2_cpu.sh once"
    return None


ATTN_CACHE_TOKENS = 4096  # PETALS' default for models without multi-query attention (16384 with it: no
# server of our budgets could then hold a block: SmolLM2's 3 KV heads are counted as full hidden size)


def petals_num_blocks(
    budget_bytes: int,
    block_bytes: int,
    hidden_size: int,
    attn_cache_tokens: int = ATTN_CACHE_TOKENS,
    dtype_bytes: int = 4,
) -> int:
    """PETALS 2.2's own rule (petals/server/server.py `_choose_num_blocks`) with our budget as the device
    memory: floor((M - autograd) / (block + 2 * hidden * cache_tokens * dtype)), autograd = 2 GiB * hidden / 14336."""
    autograd = 2 * GIB / 14336 * hidden_size
    per_block = block_bytes + 2 * hidden_size * attn_cache_tokens * dtype_bytes
    return math.floor((budget_bytes - autograd) / per_block)


class _Proc:
    def __init__(self, name: str, popen: subprocess.Popen, ready: str):
        self.name, self.popen, self.lines = name, popen, []
        self.ready = threading.Event()
        threading.Thread(target=self._read, args=(ready,), daemon=True).start()

    def _read(self, marker: str) -> None:
        for line in self.popen.stdout:
            self.lines.append(line.rstrip("\n"))
            if marker in line:
                self.ready.set()
        self.ready.set()


def _stop(procs: list[_Proc]) -> None:
    """SIGTERM then SIGKILL to each process group (PETALS' children survive a SIGTERM to the main pid)."""
    import signal

    for p in procs:
        try:
            os.killpg(p.popen.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + 10
    for p in procs:
        try:
            p.popen.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    for p in procs:
        try:
            os.killpg(p.popen.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            p.popen.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass


def run_petals22(
    cfg,
    launcher,
    requests_file: Path,
    records_file: Path,
    server_specs: list[dict],
    python: Path,
    model: Path,
    deadline_s: float,
    last_arrival_s: float,
    log,
) -> dict:
    """Start PETALS' DHT + servers in `launcher`'s hosts, replay, stop everything. `server_specs`:
    [{"name", "num_blocks", "throughput"}]. Returns run facts (chosen blocks, startup, exit code)."""
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "PYTHONWARNINGS": "ignore",
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
        "PETALS_CACHE": str(records_file.parent / "petals-cache"),
        "PYTHONPATH": str(Path(__file__).resolve().parents[1]),
    }
    kw = dict(stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True)
    procs: list[_Proc] = []
    facts: dict = {"servers": {}}
    try:
        t0 = time.monotonic()
        dht = _Proc(
            "dht",
            launcher.popen(
                "dht", [str(python), "-m", "petals.cli.run_dht", "--host_maddrs", launcher.listen_maddr("dht")], **kw
            ),
            "--initial_peers",
        )
        procs.append(dht)
        if not dht.ready.wait(120) or dht.popen.poll() is not None:
            raise RuntimeError("PETALS' DHT did not start:\n" + "\n".join(dht.lines[-15:]))
        peer = re.search(r"--initial_peers (\S+)", next(x for x in dht.lines if "--initial_peers" in x)).group(1)
        for spec in server_specs:  # one at a time: each picks its blocks seeing the ones before (PETALS' way)
            srv = _Proc(
                spec["name"],
                launcher.popen(
                    spec["name"],
                    [
                        str(python),
                        "-m",
                        "petals.cli.run_server",
                        str(model),
                        "--dht_prefix",
                        DHT_PREFIX,
                        "--initial_peers",
                        peer,
                        "--host_maddrs",
                        launcher.listen_maddr(spec["name"]),
                        "--device",
                        "cpu",
                        "--torch_dtype",
                        "float32",
                        "--quant_type",
                        "none",
                        "--num_blocks",
                        str(spec["num_blocks"]),
                        "--attn_cache_tokens",
                        str(ATTN_CACHE_TOKENS),
                        "--throughput",
                        f"{spec['throughput']:.6g}",
                        "--num_handlers",
                        "4",
                    ],
                    **kw,
                ),
                "[INFO] Started",
            )
            procs.append(srv)
            if not srv.ready.wait(300) or srv.popen.poll() is not None:
                raise RuntimeError(f"PETALS server {spec['name']} did not start:\n" + "\n".join(srv.lines[-15:]))
            m = next((re.search(r"blocks (.*) are joining", x) for x in srv.lines if "are joining" in x), None)
            facts["servers"][spec["name"]] = {**spec, "blocks": m.group(1) if m else "?"}
            log(f"[petals-2.2] {spec['name']} started: blocks {facts['servers'][spec['name']]['blocks']}")
        facts["startup_s"] = time.monotonic() - t0
        if not cfg.daemons_in_share:  # as for our servers: a host's DHT process and p2pd run beside its device
            names = {spec["name"] for spec in server_specs}
            facts["daemons_exempted"] = launcher.exempt_daemons({p.name: p.popen.pid for p in procs if p.name in names})
        gen = _Proc(
            "loadgen",
            launcher.popen(
                "loadgen",
                [
                    str(python),
                    "-m",
                    "experiments.petals_loadgen",
                    "--initial-peers",
                    peer,
                    "--model",
                    str(model),
                    "--dht-prefix",
                    DHT_PREFIX,
                    "--requests",
                    str(requests_file),
                    "--out",
                    str(records_file),
                    "--seed",
                    str(cfg.seed),
                    "--deadline",
                    str(deadline_s),
                ],
                **kw,
            ),
            "loadgen: done",
        )
        procs.append(gen)
        meter = CpuMeter([p.popen.pid for p in procs])
        end_by = time.monotonic() + last_arrival_s + deadline_s + 240
        seen = 0
        while gen.popen.poll() is None and time.monotonic() < end_by and not gen.ready.wait(2.0):
            meter.sample()
            for line in gen.lines[seen:]:
                if line.startswith("loadgen:"):
                    log(f"[petals-2.2] {line}")
            seen = len(gen.lines)
        gen.ready.wait(30)
        facts["cpu"] = meter.report()
        facts["loadgen_tail"] = [x for x in gen.lines if x.startswith(("loadgen:", "Traceback", "Error"))][-10:]
    finally:
        _stop(procs)
    return facts
