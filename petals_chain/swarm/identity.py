"""Who wrote a DHT record: peer identities and signed, validated swarm records.

Every record a petals-chain swarm keeps in its DHT (a server's `ServerInfo`, the orchestrator's
`OrchestratorInfo`) is stored under a subkey that names its owner's RSA public key and is signed
with the matching private key (hivemind's `RSASignatureValidator`, as PETALS does), so no other
peer can overwrite it. `SwarmRecordValidator` adds what the signature alone does not say:

- a record without an owner is refused (hivemind accepts unprotected records by default);
- the record's `peer_id` must be the libp2p peer id of the signing key. The signing key *is* the
  peer's libp2p identity (an RSA key: `--identity-path`, or a fresh one per process), so a peer
  can only announce itself, never another server;
- the value must parse as one of the swarm's record types (a bad schema is refused).

Every DHT node of the swarm (bootstrap, servers, orchestrator, clients) runs these validators, so a
forged record is refused both where it would be stored and where it is read.
"""

from __future__ import annotations

import functools
import hashlib
import os
import tempfile
from dataclasses import dataclass
from typing import Any

import multihash
from cryptography.hazmat.primitives import serialization
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.p2p import P2P, PeerID
from hivemind.proto import crypto_pb2
from hivemind.utils import MSGPackSerializer
from hivemind.utils.crypto import RSAPrivateKey

from petals_chain.errors import IdentityError
from petals_chain.wire.records import OrchestratorInfo, ServerInfo


def peer_id_of_public_key(ssh_public_key: bytes) -> str:
    """The libp2p peer id of an RSA public key in hivemind's OpenSSH form (libp2p peer-id spec:
    multihash sha2-256 of the protobuf-encoded DER SubjectPublicKeyInfo)."""
    key = serialization.load_ssh_public_key(ssh_public_key)
    der = key.public_bytes(encoding=serialization.Encoding.DER, format=serialization.PublicFormat.SubjectPublicKeyInfo)
    encoded = crypto_pb2.PublicKey(key_type=crypto_pb2.RSA, data=der).SerializeToString()
    return PeerID(multihash.encode(hashlib.sha256(encoded).digest(), multihash.coerce_code("sha2-256"))).to_base58()


@dataclass
class SwarmIdentity:
    """A peer's RSA identity: the file hivemind's p2p daemon reads, and the same key for signing."""

    path: str
    private_key: RSAPrivateKey
    peer_id: str
    ephemeral: bool
    _tmpdir: Any = None  # keeps a fresh identity's temporary folder alive as long as the identity

    @classmethod
    def load_or_create(cls, path: str | None = None) -> "SwarmIdentity":
        """Load `path` (a libp2p RSA private key, as `P2P.generate_identity` writes), create it there
        if absent, or with no path make a fresh identity in a temporary folder."""
        tmpdir = None
        ephemeral = path is None
        if path is None:
            tmpdir = tempfile.TemporaryDirectory(prefix="petals-chain-identity-")
            path = os.path.join(tmpdir.name, "identity.key")
        if not os.path.exists(path):
            try:
                P2P.generate_identity(path)
            except OSError as e:
                raise IdentityError(
                    f"cannot write a new identity to {path}: {e}; pass --identity-path to a file in a writable folder"
                ) from None
        try:
            with open(path, "rb") as f:
                data = f.read()
            pb = crypto_pb2.PrivateKey.FromString(data)
            if pb.key_type != crypto_pb2.KeyType.RSA:
                raise ValueError("not an RSA key")
            private_key = RSAPrivateKey.__new__(RSAPrivateKey)
            private_key.__setstate__({"_private_key": pb.data})  # hivemind's own (pickle) loading path
            peer_id = PeerID.from_identity(data).to_base58()
        except Exception as e:
            raise IdentityError(
                f"{path} is not a libp2p RSA identity ({type(e).__name__}: {e}); make one with "
                "`petals-chain identity new PATH` or remove the file to have a new one made"
            ) from None
        return cls(path, private_key, peer_id, ephemeral, tmpdir)

    @functools.cached_property
    def owner_subkey(self) -> bytes:
        """The DHT subkey under which this peer's records live (its public key, hivemind's marker);
        computed once, not on every announcement."""
        return RSASignatureValidator(self.private_key).local_public_key

    def dht_kwargs(self) -> dict[str, Any]:
        """Arguments for `start_dht` so the DHT runs as this identity and signs its records."""
        # a fresh identity cannot be taken by anyone else: skip hivemind's network check for it
        return {
            "identity_path": self.path,
            "check_if_identity_free": not self.ephemeral,
            "record_validators": swarm_validators(self.private_key),
        }


class SwarmRecordValidator(RecordValidatorBase):
    """Owner required, owner == the record's peer id, value parses as a swarm record (see module doc).

    Runs after hivemind's `RSASignatureValidator` (lower priority), so it sees the value with the
    signature stripped and knows the signature was valid."""

    def validate(self, record: DHTRecord) -> bool:
        owners = RSASignatureValidator._PUBLIC_KEY_RE.findall(record.subkey or b"")
        if len(set(owners)) != 1:
            return False
        try:
            value = MSGPackSerializer.loads(record.value)
            return parse_swarm_record(value) is not None and value["peer_id"] == peer_id_of_public_key(owners[0])
        except Exception:
            return False

    def merge_with(self, other: RecordValidatorBase) -> bool:
        return isinstance(other, SwarmRecordValidator)  # one is enough


def parse_swarm_record(value: Any):
    """The typed record `value` holds (ServerInfo or OrchestratorInfo), or None."""
    for kind in (ServerInfo, OrchestratorInfo):
        try:
            return kind.from_wire(value)
        except Exception:
            continue
    return None


def swarm_validators(private_key: RSAPrivateKey | None = None) -> list[RecordValidatorBase]:
    """Validators for every DHT node of a swarm; `private_key` signs this node's own records (readers
    that announce nothing may leave it out)."""
    return [RSASignatureValidator(private_key), SwarmRecordValidator()]
