"""`petals-chain api`: an OpenAI-compatible HTTP gateway over the swarm (see gateway.py)."""
