"""Store-time validation of DHT map records (peer.network.RecordOwnerValidator)."""

import time

from hivemind.dht.validation import DHTRecord
from hivemind.utils.serializer import MSGPackSerializer

from peer.network import RecordOwnerValidator
from protocol.config import TrainConfig
from protocol.envelope import seal
from protocol.identity import Identity
from protocol.manifest import RunManifest, SwarmConfig, sign_manifest
from protocol.messages_swarm import Heartbeat

creator, owner, intruder = Identity.generate(), Identity.generate(), Identity.generate()
RUN = bytes(20)


def record(subkey: bytes, value: bytes) -> DHTRecord:
    return DHTRecord(key=b"k" * 20, subkey=MSGPackSerializer.dumps(subkey), value=MSGPackSerializer.dumps(value),
                     expiration_time=time.time() + 60)


def heartbeat(ident: Identity) -> bytes:
    return seal(Heartbeat(run_id=RUN, sent_at=1.0, state="training", step=1, tokens=1, tokens_per_s=1.0, rounds=(0,),
                          state_digest=b"", reachable=True, maddrs=(), client="t", device="cpu"), ident)


def test_only_the_owner_of_a_slot_may_write_it():
    v = RecordOwnerValidator()
    assert v.validate(record(owner.public_key, heartbeat(owner)))
    assert not v.validate(record(owner.public_key, heartbeat(intruder)))  # someone else's heartbeat slot
    assert not v.validate(record(owner.public_key, b"junk"))


def test_any_peer_of_a_run_may_republish_its_creators_manifest():
    signed = sign_manifest(RunManifest(name="r", description="", train=TrainConfig(), swarm=SwarmConfig(), creator=creator.public_key,
                                       created_at=1.0), creator)
    v = RecordOwnerValidator()
    assert v.validate(record(owner.public_key, signed))  # a joiner republishes it under its own slot
    assert not v.validate(record(owner.public_key + b"x", signed))  # manifest slots are plain keys
