"""HTTP observability of the orchestrator (stdlib http.server, one thread per request):

- `GET /status`: JSON (plan_version, c, servers, chains, queue_length, ...), read by scripts;
- `GET /plan-input`: the measured cluster of the current plan in `petals-chain plan` input form,
  the plan's output and the assignment, so anyone can re-run the planner on the same inputs;
- `GET /metrics`: Prometheus text format;
- `GET /`: a small HTML status page (block map, chains, queue, measured tau_p / tau_c).
"""

from __future__ import annotations

import html
import json
import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from orchestrator.service.sessions import WAIT_BUCKETS_S

logger = logging.getLogger(__name__)

# Block-map colours, one per server in order (tests look for them in a screenshot).
PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#17becf", "#bcbd22", "#7f7f7f")


def _model_cells(m: dict | None) -> str:
    """Model vs measured of one server: the start-up profile's t_O against the one fitted from live
    batches (or, before a fit, the profile scaled by the fitted servers'), the fitted per-step overhead,
    the measured per-hop cost and prompt transfer per token, how well the fit describes the batches
    (median |measured / model - 1|) and the CPU share its batches took."""
    if not m:
        return "<td></td>" * 7
    a, f, scaled = m.get("announced") or {}, m.get("fitted"), m.get("scaled")
    t_o = _ms(f["t_o"]) if f is not None else f"{_ms(scaled['t_o'])} (scaled)" if scaled else ""
    src = f if f is not None else scaled
    t_B = "" if src is None else _ms(src.get("t_B")) + ("" if f is not None else " (scaled)")
    fitted = (
        _ms(f["t_O"]) if f is not None else f"not yet: {_ms(scaled['t_O'])} (profile scaled)" if scaled else "not yet"
    )
    resid = "" if f is None else f"{100 * f['median_abs_rel_residual']:.0f}% ({f['samples']} batches)"
    cpu = "" if m.get("cpu_per_wall") is None else f"{m['cpu_per_wall']:.2f}"
    return (
        f"<td>{_ms(a.get('t_O'))} / {fitted}</td><td>{t_o}</td><td>{t_B}</td><td>{_ms(m.get('hop_cost'))}</td>"
        f"<td>{_us(m.get('transfer_s_per_token'))}</td><td>{resid}</td><td>{cpu}</td>"
    )


def metrics_text(orch) -> str:
    with orch.lock:
        ds = orch.sessions
        m = ds.metrics
        chains = ds.chain_views()
        version = orch.current.version if orch.current else 0
        queue = ds.queue_length
        buckets = list(m.wait_bucket_counts)
        wait_sum = m.wait_sum_s
    lines = [
        "# HELP petals_chain_sessions_admitted_total Sessions granted a chain.",
        "# TYPE petals_chain_sessions_admitted_total counter",
        f"petals_chain_sessions_admitted_total {m.admitted}",
        "# HELP petals_chain_sessions_released_total Sessions released by their client.",
        "# TYPE petals_chain_sessions_released_total counter",
        f"petals_chain_sessions_released_total {m.released}",
        "# HELP petals_chain_leases_expired_total Leases that expired without heartbeats.",
        "# TYPE petals_chain_leases_expired_total counter",
        f"petals_chain_leases_expired_total {m.expired}",
        "# HELP petals_chain_acquire_timeouts_total Sessions that gave up waiting in the queue.",
        "# TYPE petals_chain_acquire_timeouts_total counter",
        f"petals_chain_acquire_timeouts_total {m.timed_out}",
        "# HELP petals_chain_leases_dropped_total Leases whose chain vanished with a server.",
        "# TYPE petals_chain_leases_dropped_total counter",
        f"petals_chain_leases_dropped_total {m.dropped}",
        "# HELP petals_chain_queue_length Sessions waiting in the central FIFO queue.",
        "# TYPE petals_chain_queue_length gauge",
        f"petals_chain_queue_length {queue}",
        "# HELP petals_chain_plan_version Version of the current plan.",
        "# TYPE petals_chain_plan_version gauge",
        f"petals_chain_plan_version {version}",
        "# HELP petals_chain_queue_wait_seconds Time from acquire to grant.",
        "# TYPE petals_chain_queue_wait_seconds histogram",
    ]
    cum = 0
    for b, n in zip(WAIT_BUCKETS_S, buckets):
        cum += n
        lines.append(f'petals_chain_queue_wait_seconds_bucket{{le="{b}"}} {cum}')
    cum += buckets[-1]
    lines += [
        f'petals_chain_queue_wait_seconds_bucket{{le="+Inf"}} {cum}',
        f"petals_chain_queue_wait_seconds_sum {wait_sum}",
        f"petals_chain_queue_wait_seconds_count {cum}",
        "# HELP petals_chain_chain_sessions Sessions running on a chain.",
        "# TYPE petals_chain_chain_sessions gauge",
    ]
    for ch in chains:
        lines.append(f'petals_chain_chain_sessions{{chain="{ch["chain_id"]}"}} {ch["in_use"]}')
    lines += [
        "# HELP petals_chain_chain_capacity Session capacity of a chain.",
        "# TYPE petals_chain_chain_capacity gauge",
    ]
    for ch in chains:
        lines.append(f'petals_chain_chain_capacity{{chain="{ch["chain_id"]}"}} {ch["capacity"]}')
    return "\n".join(lines) + "\n"


def _ms(x) -> str:
    return "-" if x is None else f"{x * 1e3:.1f} ms"


def _us(x) -> str:
    return "-" if x is None else f"{x * 1e6:.1f} us"


def _relayed_mark(server: dict) -> str:
    """A server behind a NAT, reached through a libp2p relay (its RTT and tau_c include the relay's hop)."""
    if server.get("reachability") != "relayed":
        return ""
    return (
        ' <span class="relayed" title="behind a NAT or firewall: reached through a libp2p relay; its RTT and '
        "tau_c include the relay's extra hop\">relayed</span>"
    )


def status_html(status: dict) -> str:
    L = status["num_blocks"]
    colors = {s["peer_id"]: PALETTE[i % len(PALETTE)] for i, s in enumerate(status["servers"])}
    names = {s["peer_id"]: s["name"] or s["peer_id"][-8:] for s in status["servers"]}
    cell = max(8, min(28, 840 // max(1, L)))
    rows = []
    for s in status["servers"]:
        cells = []
        for b in range(L):
            held = s["start"] <= b < s["end"]
            bg = colors[s["peer_id"]] if held else "#eeeeee"
            cells.append(f'<td class="b" style="background:{bg};width:{cell}px" title="block {b}"></td>')
        rows.append(
            f'<tr><th class="n">{html.escape(names[s["peer_id"]])}</th>{"".join(cells)}'
            f'<td class="r">[{s["start"]}, {s["end"]}) {html.escape(s["state"])}</td></tr>'
        )
    head = "".join(f'<td class="h">{b if b % 5 == 0 else ""}</td>' for b in range(L))
    srv_rows = "".join(
        f'<tr><td><span class="sw" style="background:{colors[s["peer_id"]]}"></span>'
        f"{html.escape(names[s['peer_id']])}{_relayed_mark(s)}</td>"
        f'<td class="mono">{html.escape(s["peer_id"][-12:])}</td><td>{html.escape(s["state"])}</td>'
        f"<td>[{s['start']}, {s['end']})</td><td>{s['memory'] / 2**20:.0f} MiB</td>"
        f"<td>{_ms(s['rtt'])}</td><td>{_ms(s['tau_c'])}</td><td>{_ms(s['tau_p'])}</td>"
        f"<td>{s['active_sessions']}</td>{_model_cells(s.get('model'))}</tr>"
        for s in status["servers"]
    )
    chain_rows = "".join(
        f"<tr><td>{c['chain_id']}</td>"
        f"<td>{' &rarr; '.join(html.escape(names.get(p, p[-8:])) for p in c['servers'])}</td>"
        f"<td>{', '.join(f'[{a},{b})' for a, b in c['blocks'])}</td><td>{c['in_use']} / {c['capacity']}</td>"
        f'<td><div class="bar"><div style="width:{100 * c["in_use"] / max(1, c["capacity"]):.0f}%"></div></div></td>'
        f"<td>{c['service_time']:.3f} s</td><td>{'yes' if c['dispatchable'] else 'draining'}</td></tr>"
        for c in status["chains"]
    )
    events = "".join(f"<li>{html.escape(e)}</li>" for e in status["events"])
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><meta http-equiv="refresh" content="2">
<title>petals-chain orchestrator</title>
<style>
body {{ font-family: sans-serif; margin: 16px; color: #222; background: #ffffff; }}
h1 {{ font-size: 20px; margin: 0 0 8px 0; }} h2 {{ font-size: 16px; margin: 16px 0 6px 0; }}
.relayed {{ font-size: 11px; background: #fde8c8; border: 1px solid #e0a050; border-radius: 3px; padding: 0 3px; }}
table {{ border-collapse: collapse; }} td, th {{ padding: 2px 6px; font-size: 13px; text-align: left; }}
table.map td.b {{ height: 22px; padding: 0; border: 1px solid #ffffff; }}
table.map td.h {{ font-size: 10px; padding: 0; color: #777; }}
table.list td, table.list th {{ border-bottom: 1px solid #ddd; }}
.sw {{ display: inline-block; width: 12px; height: 12px; margin-right: 6px; vertical-align: middle; }}
.bar {{ width: 120px; height: 10px; background: #eeeeee; }} .bar div {{ height: 10px; background: #555555; }}
.mono {{ font-family: monospace; }} .kpi {{ display: inline-block; margin-right: 24px; font-size: 14px; }}
</style></head><body>
<h1>petals-chain orchestrator &middot; {html.escape(status["model"])}</h1>
<div><span class="kpi">policy <b>{html.escape(status["policy"])}</b></span>
<span class="kpi">plan v<b>{status["plan_version"]}</b> {"online" if status["plan_installed"] else "loading"}</span>
<span class="kpi">c = <b>{status["c"]}</b></span>
<span class="kpi">sessions <b>{status["sessions"]}</b></span>
<span class="kpi">queue length <b id="queue">{status["queue_length"]}</b></span></div>
<h2>Block map ({L} blocks)</h2>
<table class="map"><tr><th></th>{head}<td></td></tr>{"".join(rows)}</table>
<h2>Chains</h2>
<table class="list"><tr><th>id</th><th>servers</th><th>blocks</th><th>in use / capacity</th><th></th>
<th>service time</th><th>dispatchable</th></tr>{chain_rows}</table>
<h2>Servers</h2>
<table class="list"><tr><th>name</th><th>peer</th><th>state</th><th>blocks</th><th>memory</th><th>RTT</th>
<th>&tau;<sub>c</sub></th><th>&tau;<sub>p</sub> (per block)</th><th>sessions (server-reported)</th>
<th>t<sub>O</sub> start-up / fitted</th><th>t<sub>o</sub> / step</th><th>t<sub>B</sub> / block and step</th>
<th>hop cost / step</th><th>prompt transfer / token</th><th>fit residual</th>
<th>CPU / wall</th></tr>{srv_rows}</table>
<h2>Events</h2><ul>{events}</ul>
</body></html>
"""


class _Handler(BaseHTTPRequestHandler):
    orch = None  # set on the subclass made by serve_http

    def _send(self, code: int, body: str, ctype: str) -> None:
        data = body.encode()
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(data)))
        self.send_header("Cache-Control", "no-store")
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:  # noqa: N802
        path = self.path.split("?")[0]
        try:
            if path == "/status":
                # clients' verification reports and the servers they excluded (orchestrator/service/reports.py)
                status = {**self.orch.status(), "reports": self.orch.reports.view()}
                self._send(200, json.dumps(status), "application/json")
            elif path == "/plan-input":
                self._send(200, json.dumps(self.orch.plan_input()), "application/json")
            elif path == "/metrics":
                self._send(200, metrics_text(self.orch), "text/plain; version=0.0.4")
            elif path in ("/", "/index.html"):
                self._send(200, status_html(self.orch.status()), "text/html; charset=utf-8")
            else:
                self._send(
                    404, json.dumps({"error": f"no such page {path}; try /, /status, /metrics"}), "application/json"
                )
        except Exception as e:  # a status page must never take the orchestrator down
            logger.exception("HTTP handler failed")
            self._send(500, json.dumps({"error": f"{type(e).__name__}: {e}"}), "application/json")

    def log_message(self, fmt, *args) -> None:
        logger.debug("http: " + fmt, *args)


def serve_http(orch, host: str, port: int) -> ThreadingHTTPServer:
    handler = type("Handler", (_Handler,), {"orch": orch})
    server = ThreadingHTTPServer((host, port), handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="orchestrator-http", daemon=True).start()
    return server
