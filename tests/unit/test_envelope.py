"""Signed envelopes: what a signature binds, and that nothing else gets through."""

from __future__ import annotations

import hashlib

import msgpack
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from protocol.envelope import ContextMismatch, Envelope, VerificationError, seal, seal_parts, statement, verify
from protocol.errors import RemoteProtocolError
from protocol.identity import Identity
from protocol.messages import PROTOCOL_VERSION, DecodeError, Tag, decode, encode, encode_parts, frame_head
from protocol.messages_control import GetStatus
from protocol.messages_swarm import Heartbeat, PushSlice, StateChunk

ALICE = Identity.from_seed(bytes(range(32)))
MALLORY = Identity.from_seed(bytes(range(1, 33)))
RUN = b"R" * 20
OTHER_RUN = b"S" * 20
GROUP = b"G" * 16

fast = settings(max_examples=30, deadline=None)


def heartbeat(run_id: bytes = RUN) -> Heartbeat:
    return Heartbeat(run_id=run_id, sent_at=1.7e9, state="training", step=10, tokens=1280, tokens_per_s=99.5,
                     rounds=(1, 0), state_digest=b"", reachable=True, maddrs=(), client="swarmstream/0.1.0",
                     device="cpu")


def push_slice(payload: bytes = bytes(range(256)) * 4, *, run_id: bytes = RUN, round: int = 7,
               fragment: int = 2, group_id: bytes = GROUP) -> PushSlice:
    return PushSlice(run_id=run_id, fragment=fragment, round=round, group_id=group_id, part=1, offset=512,
                     numel=2 * len(payload), shape=(2 * len(payload),), dtype="float32", codec="fp4",
                     weight=4096.0, stopping=False, payload=payload)


def test_seal_and_verify_round_trip():
    msg = push_slice()
    checked = verify(seal(msg, ALICE), expect=PushSlice, run_id=RUN, round=7, fragment=2, group_id=GROUP,
                     sender=ALICE.peer_id)
    assert checked.message == msg
    assert checked.signer == ALICE.public_key and checked.peer_id == ALICE.peer_id
    assert checked.payload_digest == hashlib.sha256(msg.payload).digest()
    assert bytes(checked.body) == encode(msg)


def test_seal_parts_do_not_copy_the_payload():
    msg = push_slice()
    parts = seal_parts(msg, ALICE)
    assert parts[-1] is msg.payload
    assert b"".join(parts) == seal(msg, ALICE)  # Ed25519 signatures are deterministic


@fast
@given(st.binary(max_size=2048), st.integers(0, 2**32 - 1), st.integers(0, 1023), st.binary(min_size=20, max_size=20))
def test_any_slice_verifies_in_its_own_context_only(payload, round_, fragment, run_id):
    wire = seal(push_slice(payload, run_id=run_id, round=round_, fragment=fragment), ALICE)
    assert verify(wire, run_id=run_id, round=round_, fragment=fragment).message.payload == payload
    with pytest.raises(ContextMismatch):
        verify(wire, run_id=bytes(20) if run_id != bytes(20) else b"\x01" * 20)
    with pytest.raises(ContextMismatch):
        verify(wire, round=(round_ + 1) % 2**32)
    with pytest.raises(ContextMismatch):
        verify(wire, fragment=(fragment + 1) % 1024)


def test_replays_into_another_run_round_fragment_group_or_sender_fail():
    wire = seal(push_slice(), ALICE)
    for wrong in (dict(run_id=OTHER_RUN), dict(round=8), dict(fragment=3), dict(group_id=b"H" * 16),
                  dict(sender=MALLORY.peer_id), dict(sender=MALLORY.public_key)):
        with pytest.raises(ContextMismatch):
            verify(wire, **wrong)
    # types without a round or fragment cannot be replayed as if they had one
    with pytest.raises(ContextMismatch):
        verify(seal(heartbeat(), ALICE), run_id=RUN, round=0)


def test_every_single_bit_flip_of_an_envelope_fails():
    wire = seal(heartbeat(), ALICE)
    for bit in range(8 * len(wire)):
        flipped = bytearray(wire)
        flipped[bit // 8] ^= 1 << (bit % 8)
        with pytest.raises(RemoteProtocolError):
            verify(bytes(flipped))


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_any_single_bit_flip_of_a_slice_envelope_fails(data):
    wire = seal(push_slice(), ALICE)
    bit = data.draw(st.integers(0, 8 * len(wire) - 1))
    flipped = bytearray(wire)
    flipped[bit // 8] ^= 1 << (bit % 8)
    with pytest.raises(RemoteProtocolError):
        verify(bytes(flipped))


def _envelope(signer: bytes, signature: bytes, body: bytes) -> bytes:
    return frame_head(Tag.ENVELOPE, [signer, signature], len(body)) + body


def test_a_message_changed_after_signing_fails_even_if_well_formed():
    original = seal(heartbeat(RUN), ALICE)
    env = decode(original, expect=Envelope)
    swapped = _envelope(env.signer, env.signature, encode(heartbeat(OTHER_RUN)))
    with pytest.raises(VerificationError):
        verify(swapped)


def test_claiming_someone_elses_key_fails():
    body = encode(heartbeat())
    head, _ = encode_parts(heartbeat())
    # Mallory signs the right statement, but names Alice as the signer.
    forged = MALLORY.sign(statement(heartbeat(), ALICE.public_key, hashlib.sha256(head).digest(), b""))
    with pytest.raises(VerificationError):
        verify(_envelope(ALICE.public_key, forged, body))


def test_the_signature_covers_the_domain_separated_statement_only():
    msg = heartbeat()
    head, _ = encode_parts(msg)
    signed = statement(msg, ALICE.public_key, hashlib.sha256(head).digest(), b"")
    assert signed.startswith(b"swarmstream/signed-message/v1\0")
    fields = msgpack.unpackb(signed[len(b"swarmstream/signed-message/v1\0"):])
    assert fields == [PROTOCOL_VERSION, int(Tag.HEARTBEAT), RUN, None, None, None, ALICE.public_key,
                      hashlib.sha256(head).digest(), b""]
    # A signature over the bare message bytes (no domain, no context) is not accepted.
    raw = _envelope(ALICE.public_key, ALICE.sign(encode(msg)), encode(msg))
    with pytest.raises(VerificationError):
        verify(raw)


def test_state_chunks_hand_over_their_payload_digest():
    chunk = StateChunk(run_id=RUN, index_digest=bytes(32), chunk=3, payload=b"state" * 1000)
    checked = verify(seal(chunk, ALICE), expect=StateChunk)
    assert checked.payload_digest == hashlib.sha256(b"state" * 1000).digest()


def test_nested_or_unexpected_messages_are_rejected():
    inner = seal(heartbeat(), ALICE)
    nested = _envelope(ALICE.public_key, bytes(64), inner)
    with pytest.raises(DecodeError, match="envelope inside"):
        verify(nested)
    with pytest.raises(DecodeError, match="expected PushSlice"):
        verify(inner, expect=PushSlice)
    with pytest.raises(DecodeError, match="expected Envelope"):
        verify(encode(heartbeat()))


def test_unsigned_control_messages_can_still_be_sealed():
    checked = verify(seal(GetStatus(request_id=5), ALICE))
    assert checked.message == GetStatus(request_id=5) and checked.payload_digest == b""


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=400))
def test_random_bytes_only_raise_protocol_errors(data):
    try:
        verify(data)
    except RemoteProtocolError:
        pass


@pytest.mark.parametrize("where, inserted", [(1, b"\xd0"), (2, b"\xd0")])
def test_a_signed_envelope_in_another_encoding_of_the_same_values_is_refused(where, inserted):
    """One message, one byte string: re-encoding a field of the envelope in a longer msgpack
    form (int8 0xd0 before a fixint: the same number) keeps the signed body intact, and was
    accepted (hypothesis found it in CI). Evidence and digests compare bytes."""
    wire = bytearray(seal(push_slice(bytes(64)), ALICE))
    wire[where:where] = inserted
    with pytest.raises(RemoteProtocolError, match="canonical"):
        verify(bytes(wire))


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_mutated_envelopes_only_raise_protocol_errors(data):
    original = seal(push_slice(bytes(64)), ALICE)
    wire = bytearray(original)
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(wire) - 1))
        op = data.draw(st.sampled_from(["set", "cut", "insert"]))
        if op == "set":
            wire[i] = data.draw(st.integers(0, 255))
        elif op == "cut":
            del wire[i:]
            if not wire:
                break
        else:
            wire[i:i] = data.draw(st.binary(min_size=1, max_size=6))
    assume(bytes(wire) != original)
    with pytest.raises(RemoteProtocolError):
        verify(bytes(wire))
