"""The online orchestrator (docs/online-orchestrator.md).

Pure parts (no I/O, clock injected): measurements (footnote 11), registry (server records ->
Cluster), dispatch_state (leases, central FIFO queue, JFFC / per-request routing). Service parts:
core (planning and dispatch on the hivemind loop), rpc (OrchestratorService handlers), http
(/status, /metrics, /), cli (`petals-chain orchestrator`).
"""
