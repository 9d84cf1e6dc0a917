"""How peers talk: the RPC surface shared by server and client (`protocol.py`), the framed and direct
per-step streams, and private-swarm membership enforced before a request reaches its handler."""
