"""Signed, validated DHT records: nobody can forge or overwrite another peer's record."""

from __future__ import annotations

import dataclasses

import pytest
from hivemind.dht.validation import CompositeValidator, DHTRecord
from hivemind.utils import MSGPackSerializer, get_dht_time

from petals_chain.errors import IdentityError
from petals_chain.process.signals import start_dht
from petals_chain.swarm.identity import (
    SwarmIdentity,
    peer_id_of_public_key,
    swarm_validators,
)
from petals_chain.swarm.records import announce_server, fetch_servers, servers_key
from petals_chain.wire.records import ServerInfo

LOCAL = ["/ip4/127.0.0.1/tcp/0"]


@pytest.fixture(scope="module")
def victim():
    return SwarmIdentity.load_or_create()


@pytest.fixture(scope="module")
def attacker():
    return SwarmIdentity.load_or_create()


def server_info(peer_id: str, start: int = 0, end: int = 30) -> ServerInfo:
    return ServerInfo(
        peer_id=peer_id,
        model="smollm2-135m",
        start=start,
        end=end,
        state="online",
        memory_budget_bytes=1 << 30,
        block_bytes=1,
        kv_bytes_per_block=1,
        max_length_tokens=2048,
        free_kv_slots=4,
        prefill_s_per_token=1e-4,
        decode_s_per_token=1e-3,
    )


def signed_record(owner: SwarmIdentity, value: dict, subkey: bytes | None = None) -> DHTRecord:
    """What a peer running `owner`'s validators would send for `value` (signature appended)."""
    record = DHTRecord(
        key=b"k",
        subkey=MSGPackSerializer.dumps(subkey or owner.owner_subkey),
        value=MSGPackSerializer.dumps(value),
        expiration_time=get_dht_time() + 30,
    )
    signer = CompositeValidator(swarm_validators(owner.private_key))
    return dataclasses.replace(record, value=signer.sign_value(record))


def reader() -> CompositeValidator:
    return CompositeValidator(swarm_validators())


def test_identity_peer_id_is_the_signing_key(victim, tmp_path):
    assert peer_id_of_public_key(victim.private_key.get_public_key().to_bytes()) == victim.peer_id
    path = tmp_path / "server.id"
    first = SwarmIdentity.load_or_create(str(path))
    again = SwarmIdentity.load_or_create(str(path))
    assert first.peer_id == again.peer_id and not first.ephemeral  # persisted: same peer id after a restart
    (tmp_path / "garbage.id").write_bytes(b"not a key")
    with pytest.raises(IdentityError, match="identity new|remove the file"):
        SwarmIdentity.load_or_create(str(tmp_path / "garbage.id"))


def test_genuine_record_is_accepted(victim):
    assert reader().validate(signed_record(victim, server_info(victim.peer_id).to_wire()))


def test_forged_records_are_rejected(victim, attacker):
    genuine = signed_record(victim, server_info(victim.peer_id).to_wire())
    # 1. the attacker signs a record that claims to be the victim's server
    assert not reader().validate(signed_record(attacker, server_info(victim.peer_id).to_wire()))
    # 2. the attacker overwrites the victim's subkey with its own signature
    assert not reader().validate(
        signed_record(attacker, server_info(victim.peer_id).to_wire(), subkey=victim.owner_subkey)
    )
    # 3. the victim's signed record with its value changed (blocks moved) no longer verifies
    tampered_value = MSGPackSerializer.dumps(server_info(victim.peer_id, 0, 5).to_wire())
    signature = genuine.value[len(MSGPackSerializer.dumps(server_info(victim.peer_id).to_wire())) :]
    assert not reader().validate(dataclasses.replace(genuine, value=tampered_value + signature))
    # 4. an unsigned record with no owner at all
    unowned = DHTRecord(
        b"k",
        MSGPackSerializer.dumps(victim.peer_id),
        MSGPackSerializer.dumps(server_info(victim.peer_id).to_wire()),
        get_dht_time() + 30,
    )
    assert not reader().validate(unowned)


def test_bad_schema_is_rejected_even_when_signed(victim):
    bad = server_info(victim.peer_id).to_wire()
    bad["start"] = "zero"
    assert not reader().validate(signed_record(victim, bad))
    assert not reader().validate(signed_record(victim, {"peer_id": victim.peer_id}))


@pytest.mark.integration
def test_live_dht_refuses_a_forged_server_record(victim):
    """A bootstrap node, the victim server's DHT and a client all validate; an attacker DHT without
    validators stores a record under the victim's subkey claiming other blocks: nobody keeps it."""
    bootstrap_id = SwarmIdentity.load_or_create()
    bootstrap = start_dht(host_maddrs=LOCAL, **bootstrap_id.dht_kwargs())
    dhts = [bootstrap]
    try:
        peers = [str(m) for m in bootstrap.get_visible_maddrs()]
        server = start_dht(initial_peers=peers, host_maddrs=LOCAL, **victim.dht_kwargs())
        dhts.append(server)
        assert str(server.peer_id) == victim.peer_id
        assert announce_server(server, server_info(victim.peer_id, 0, 30), victim, ttl_s=60)
        attacker_dht = start_dht(initial_peers=peers, host_maddrs=LOCAL)  # no validators: sends anything
        dhts.append(attacker_dht)
        forged = server_info(victim.peer_id, 0, 1).to_wire()
        attacker_dht.store(
            servers_key("smollm2-135m"), subkey=victim.owner_subkey, value=forged, expiration_time=get_dht_time() + 120
        )
        attacker_dht.store(
            servers_key("smollm2-135m"),
            subkey="unowned",
            value=server_info("fake", 0, 30).to_wire(),
            expiration_time=get_dht_time() + 120,
        )
        client = start_dht(initial_peers=peers, client_mode=True, record_validators=swarm_validators())
        dhts.append(client)
        infos = fetch_servers(client, "smollm2-135m")
        assert [(i.peer_id, i.start, i.end) for i in infos] == [(victim.peer_id, 0, 30)]
    finally:
        for dht in dhts:
            dht.shutdown()


def test_identity_cli_new_and_show(tmp_path, capsys):
    from petals_chain.cli.main import main

    path = str(tmp_path / "peer.id")
    assert main(["identity", "new", path]) == 0
    made = capsys.readouterr().out.strip()
    assert main(["identity", "show", path]) == 0
    assert capsys.readouterr().out.strip() == made == SwarmIdentity.load_or_create(path).peer_id
    assert main(["identity", "new", path]) == 2  # never overwrites a key
    assert "exists" in capsys.readouterr().err
    assert main(["identity", "show", str(tmp_path / "missing.id")]) == 2
