"""Private swarms: the list of peers that may take part (`--allowed-peers FILE`).

The file holds one libp2p peer id a line (`petals-chain identity show PATH` prints a peer's id);
`#` starts a comment, blank lines are ignored. A peer id is authenticated by libp2p's secure
channel (the caller proves it holds the key), so `context.remote_id` can be trusted as the caller.
"""

from __future__ import annotations

from hivemind.p2p import PeerID

from petals_chain.errors import InvalidRequestError, NotAllowedError


def parse_allowed_peers(text: str, *, source: str = "allowed peers") -> frozenset[str]:
    """Peer ids in `text`; a line that is not a peer id is an error naming the line."""
    peers = set()
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        try:
            if PeerID.from_base58(line).to_base58() != line:
                raise ValueError("does not round-trip")
        except (ValueError, TypeError) as e:
            raise InvalidRequestError(
                f"{source}:{number}: {line!r} is not a peer id ({e}); put one base58 peer id "
                "a line, as `petals-chain identity show PATH` prints it"
            ) from None
        peers.add(line)
    if not peers:
        raise InvalidRequestError(
            f"{source} lists no peer id: an empty allowlist would refuse everyone; "
            "add the members' peer ids or drop --allowed-peers"
        )
    return frozenset(peers)


def load_allowed_peers(path: str | None) -> frozenset[str] | None:
    """The allowlist in `path`, or None (everyone allowed) when no path is given."""
    if path is None:
        return None
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise InvalidRequestError(f"cannot read --allowed-peers {path}: {e.strerror}") from None
    return parse_allowed_peers(text, source=path)


def check_allowed(allowed: frozenset[str] | None, peer_id: str) -> None:
    if allowed is not None and peer_id not in allowed:
        raise NotAllowedError(
            f"peer {peer_id} is not a member of this private swarm; ask its operator to add "
            "your peer id (`petals-chain identity show PATH`) to their --allowed-peers file"
        )
