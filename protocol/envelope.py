"""Signed envelopes: how every message a peer sends is bound to its sender and its context.

On the wire an envelope is itself a message (tag ``ENVELOPE``)::

    [PROTOCOL_VERSION, 0, signer (32-byte Ed25519 key), signature (64 bytes), body (bin32)]

where ``body`` is the encoded message. The signature is over a short, canonical statement::

    b"swarmstream/signed-message/v1\\0" + msgpack([PROTOCOL_VERSION, tag, run_id, round,
        fragment, group_id, signer, sha256(head), sha256(payload) or b""])

``head`` is the body up to its payload (all of it for types without one) and ``payload`` the
rest; the context fields come from the decoded message (``Message.context``). So a signature
binds the sender, the message type and the run, round, fragment and group it was sent for,
and ``verify`` refuses an envelope whose context differs from what the caller expects: a slice
replayed into another run, round, fragment or group fails even though its signature is
valid. Hashing the payload separately means each side hashes a 64 MB slice exactly once (a
plain Ed25519 signature hashes its input twice), and the receiver gets the payload digest for
free to compare with a state index.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any

import msgpack

from protocol.errors import LocalProtocolError, RemoteProtocolError
from protocol.identity import Identity, peer_id_from_public_key, verify_signature
from protocol.messages import (
    KEY_BYTES, MAX_FRAME_BYTES, PROTOCOL_VERSION, SIGNATURE_BYTES, Bytes, DecodeError, Message, Payload,
    PublicKey, Tag, decode, decode_split, digest, encode_parts, frame_head, message,
)

SIGNATURE_DOMAIN = b"swarmstream/signed-message/v1\0"


class VerificationError(RemoteProtocolError):
    """The signature does not check out: the bytes were altered, or forged."""


class ContextMismatch(VerificationError):
    """A validly signed message, but for another run, round, fragment, group or sender
    than the caller expects: a replay, or a confused peer."""


@message(Tag.ENVELOPE)
@dataclass(frozen=True, kw_only=True, slots=True)
class Envelope(Message):
    """The wire form; use ``seal`` and ``verify`` rather than building one by hand."""

    signer: PublicKey
    signature: Annotated[bytes, Bytes((SIGNATURE_BYTES,))]
    body: Annotated[bytes, Payload()]


@dataclass(frozen=True, slots=True)
class Verified:
    """A message whose signature and context checked out."""

    message: Message
    signer: bytes
    """Raw Ed25519 key of the sender."""
    payload_digest: bytes
    """SHA-256 of the message's payload (b"" for types without one), computed once here."""
    body: memoryview
    """The message's bytes as received (a view into the envelope)."""

    @property
    def peer_id(self) -> str:
        return peer_id_from_public_key(self.signer)


def statement(msg: Message, signer: bytes, head_digest: bytes, payload_digest: bytes) -> bytes:
    """The exact bytes an Ed25519 signature covers (see the module docstring)."""
    run_id, round_, fragment, group_id = msg.context()
    return SIGNATURE_DOMAIN + msgpack.packb(
        [PROTOCOL_VERSION, int(msg.TAG), run_id, round_, fragment, group_id, signer, head_digest, payload_digest],
        use_bin_type=True)


def seal_parts(msg: Message, identity: Identity) -> list[Any]:
    """The envelope as a list of buffers to write one after another (no copy of the payload)."""
    if isinstance(msg, Envelope):
        raise LocalProtocolError("an envelope cannot carry another envelope")
    head, payload = encode_parts(msg)
    payload_digest = digest(payload) if msg.HAS_PAYLOAD else b""
    signature = identity.sign(statement(msg, identity.public_key, digest(head), payload_digest))
    body_len = len(head) + len(payload)
    if body_len > MAX_FRAME_BYTES - 128:
        raise LocalProtocolError(f"{type(msg).__name__} of {body_len} bytes is too large to seal; split it")
    parts = [frame_head(Tag.ENVELOPE, [identity.public_key, signature], body_len), head]
    if len(payload):
        parts.append(payload)
    return parts


def seal(msg: Message, identity: Identity) -> bytes:
    """Encode ``msg`` and sign it as ``identity``: the bytes to send (one copy of the payload)."""
    return b"".join(seal_parts(msg, identity))


def verify(data: Any, *, expect: type | tuple[type, ...] | None = None, run_id: bytes | None = None,
           round: int | None = None, fragment: int | None = None, group_id: bytes | None = None,
           sender: bytes | str | None = None, max_size: int = MAX_FRAME_BYTES) -> Verified:
    """Decode an envelope, check its signature, then check the message against what the
    caller expects (each argument left ``None`` is not checked; ``sender`` is a raw key or a
    peer ID, e.g. the remote peer of the libp2p stream it came on).

    Raises DecodeError for malformed bytes, VerificationError for a bad signature and
    ContextMismatch for a valid one in the wrong place; nothing else."""
    env = decode(data, max_size=max_size, expect=Envelope)
    assert isinstance(env, Envelope)
    body = env.body
    assert isinstance(body, memoryview)  # decode returns payloads as views into ``data``
    msg, head_len = decode_split(body, max_size=len(body))
    if isinstance(msg, Envelope):
        raise DecodeError("an envelope inside an envelope")
    if expect is not None and not isinstance(msg, expect):
        names = ", ".join(c.__name__ for c in (expect if isinstance(expect, tuple) else (expect,)))
        raise DecodeError(f"expected {names}, got {type(msg).__name__}")
    payload_digest = digest(body[head_len:]) if msg.HAS_PAYLOAD else b""
    signed = statement(msg, env.signer, digest(body[:head_len]), payload_digest)
    if not verify_signature(env.signer, env.signature, signed):
        raise VerificationError(f"bad signature on {type(msg).__name__} from {peer_id_from_public_key(env.signer)}")
    _check_context(msg, env.signer, run_id=run_id, round=round, fragment=fragment, group_id=group_id,
                   sender=sender)
    return Verified(message=msg, signer=env.signer, payload_digest=payload_digest, body=body)


def _check_context(msg: Message, signer: bytes, *, run_id: bytes | None, round: int | None,
                   fragment: int | None, group_id: bytes | None, sender: bytes | str | None) -> None:
    got_run, got_round, got_fragment, got_group = msg.context()
    name = type(msg).__name__
    if run_id is not None and got_run != run_id:
        raise ContextMismatch(f"{name} was signed for run {got_run.hex() or '(none)'}, not {run_id.hex()}")
    if round is not None and got_round != round:
        raise ContextMismatch(f"{name} was signed for round {got_round}, not {round}")
    if fragment is not None and got_fragment != fragment:
        raise ContextMismatch(f"{name} was signed for fragment {got_fragment}, not {fragment}")
    if group_id is not None and got_group != group_id:
        raise ContextMismatch(f"{name} was signed for another averaging group")
    if sender is not None:
        if isinstance(sender, str):
            ok = peer_id_from_public_key(signer) == sender
        else:
            ok = len(sender) == KEY_BYTES and bytes(sender) == signer
        if not ok:
            raise ContextMismatch(f"{name} was signed by {peer_id_from_public_key(signer)}, "
                                  f"not by the peer it came from")
