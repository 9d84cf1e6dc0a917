"""The swarm: peer identities and signed DHT records, where records live in the DHT, reachability and
relays for peers behind NAT, and a private swarm of local processes (`local.py`)."""
