"""Discrete-event simulator of chain-structured jobs (the paper's section 4.1)."""
