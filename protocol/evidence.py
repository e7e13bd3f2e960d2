"""Proof that a peer lied: a frame it signed that no honest peer sends, whatever its group.

A signature proves who sent a message, not that it is honest; but a signed ``PushSlice`` or
``SliceAveraged`` whose values are NaN or infinite, whose block scales or layout the codec
refuses, or whose shape is not a flat float32 slice, proves to *anyone* that its signer sent
something no honest client sends. Such a frame is kept as evidence (``peer.bans``), and anyone
can check it again with ``offence`` alone. A frame that is wrong only for the round it was sent
in (a weight or an offset that does not match the group, a slice sent late or short) is
dropped from that round, but proves nothing to others: it is never evidence, so an honest peer
that is slow, or that saw another view of a group, is never banned.
"""

from __future__ import annotations

from protocol.codecs import get_codec
from protocol.envelope import verify
from protocol.errors import ProtocolError, RemoteProtocolError
from protocol.messages import MAX_FRAME_BYTES
from protocol.messages_swarm import PushSlice, SliceAveraged

__all__ = ["offence"]


def offence(frame: bytes, run_id: bytes) -> tuple[bytes, str] | None:
    """(the signer's Ed25519 public key, what is wrong) if ``frame`` is a ``PushSlice`` or
    ``SliceAveraged`` of run ``run_id``, validly signed, that fails a check needing nothing but
    the frame itself; None for anything else (a bad signature proves nothing about anyone)."""
    try:
        v = verify(frame, expect=(PushSlice, SliceAveraged), run_id=run_id, max_size=MAX_FRAME_BYTES)
    except RemoteProtocolError:
        return None
    msg = v.message
    assert isinstance(msg, (PushSlice, SliceAveraged))
    try:
        if msg.dtype != "float32" or tuple(msg.shape) != (msg.numel,) or msg.numel == 0:
            raise RemoteProtocolError(f"shape {tuple(msg.shape)} / dtype {msg.dtype} is not a flat float32 slice")
        get_codec(msg.codec).decode(msg.payload, msg.numel)  # layout, block scales, finiteness
    except ProtocolError as e:
        return v.signer, f"{type(msg).__name__}: {e}"[:200]
    return None
