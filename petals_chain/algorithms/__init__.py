"""Pure algorithms shared by server, orchestrator and gateway (numpy/scipy only): VTC's counters and one
server's fitted service model."""
