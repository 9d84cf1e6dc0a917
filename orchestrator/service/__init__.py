"""The online orchestrator (docs/online-orchestrator.md).

Pure parts (no I/O, clock injected): measurements (footnote 11), registry (server records ->
Cluster), sessions (the one owner of leases, waiting sessions and grants; the plan's dispatcher decides). Service parts:
core (planning and dispatch on the hivemind loop), rpc (OrchestratorService handlers), http
(/status, /metrics, /), cli (`petals-chain orchestrator`).
"""
