"""Sending an averager's frames to one peer, so that they arrive or the sender knows.

A frame goes out on a fresh libp2p stream (8-byte big-endian length, then the body), and the
receiver answers each frame it has read with one byte (``ACK``). The sender closes the stream
only once every frame is acknowledged. Two reasons:

- The libp2p daemon bundled with hivemind loses a stream that is written and closed at once:
  its lazy protocol negotiation resets the stream if the opener closes it before reading the
  handshake's answer (the race fixed upstream in go-multistream #87/#89 and #115, "finish
  reading handshake on lazyConn close"). The sender saw a clean close, the receiver never saw
  the stream, and the round waited for that part until its deadline: 30-45 s stalls of one
  pair of peers, in about one run in five of ``bench/swarm.py``. Reading the acknowledgements
  reads the handshake's answer too.
- Whatever else loses a stream (a connection that breaks), the frames not acknowledged in time
  are sent again on a new stream, up to ``ATTEMPTS`` times within the caller's deadline. The
  receiver takes a resent frame it already holds as a no-op (``peer.allreduce_round``: same
  sender, part, offset and payload), so a resend whose original did arrive costs bytes only.

How long to wait for acknowledgements: ``ACK_MIN_S`` plus the frames' bytes at
``ACK_FLOOR_BPS``, doubled at each resend, and on the last stream as long as the caller's
deadline allows: a receiver that is slow to read (a download cap, a large frame of the same
peer ahead of ours) costs a resend or two, and is never given up on for being slow. A stream
that breaks (reset, or ended early) counts as not acknowledged: what it did not carry goes
again. A receiver buffers at most ``MAX_UNREAD_ACKS`` bytes of acknowledgements for a sender
that does not read them, then closes the stream.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from hivemind.p2p import P2P, PeerID

from peer.inbox import HEADER_LEN
from peer.ratelimit import CHUNK_BYTES, RateLimiter

log = logging.getLogger("peer.allreduce")

ACK = b"\x06"  # the receiver's answer to each frame it has read
ATTEMPTS = 4  # streams per send: the first and up to three resends of what was not acknowledged
ACK_MIN_S = 2.0  # seconds to wait for acknowledgements, at least
ACK_FLOOR_BPS = 125_000.0  # bytes per second the wait allows for (1 Mbit/s), doubled at each resend
MAX_UNREAD_ACKS = 4096  # bytes of acknowledgements a receiver holds for a sender that does not read them


class BadAcknowledgement(ConnectionError):
    """The peer answered something else than acknowledgements: not a resend's business."""


class NotAcknowledged(ConnectionError):
    """Frames were still not acknowledged after ``ATTEMPTS`` streams."""


async def send_frames(p2p: P2P, peer_id: str, handler_name: str, frames: list[list[Any]], *,
                      upload: RateLimiter, reconnect: Callable[[str], Awaitable[bool]] | None = None) -> int:
    """Send ``frames`` (each a list of buffers: one sealed message) to ``peer_id`` until each is
    acknowledged; -> bytes sent (resends included). Raises if the peer cannot be reached, if
    it answers something else, or if frames are still not acknowledged after ``ATTEMPTS``
    streams (the last one waits until the caller's deadline)."""
    sent = 0
    left = list(frames)
    for attempt in range(ATTEMPTS):
        last = attempt == ATTEMPTS - 1
        # through relays only on the first stream: dialing circuits again at every resend put
        # libp2p dial backoffs on the relays (test_relay's probe could no longer connect)
        n, acked = await _attempt(p2p, peer_id, handler_name, left, upload, reconnect if attempt == 0 else None,
                                  None if last else 2 ** attempt)
        sent += n
        left = left[acked:]
        if not left:
            return sent
        if attempt + 1 < ATTEMPTS:
            log.info("frames not acknowledged, sending them again peer=%s frames=%d attempt=%d",
                     peer_id, len(left), attempt + 1)
    raise NotAcknowledged(f"{len(left)} frame(s) not acknowledged after {ATTEMPTS} streams")


async def _attempt(p2p: P2P, peer_id: str, handler_name: str, frames: list[list[Any]], upload: RateLimiter,
                   reconnect: Callable[[str], Awaitable[bool]] | None, patience: float | None) -> tuple[int, int]:
    """One stream: write the frames, read their acknowledgements, waiting ``patience`` times the
    usual time for them (None: until cancelled). -> (bytes sent, frames acknowledged). Raises
    only if no stream can be opened."""
    try:
        _, reader, writer = await p2p.call_binary_stream_handler(PeerID.from_base58(peer_id), handler_name)
    except Exception:  # no connection and no address of theirs we can dial
        if reconnect is None or not await reconnect(peer_id):
            raise
        _, reader, writer = await p2p.call_binary_stream_handler(PeerID.from_base58(peer_id), handler_name)
    sent = acked = 0
    try:
        for parts in frames:
            sent += await _write(writer, parts, upload)
        loop = asyncio.get_running_loop()
        until = None if patience is None else loop.time() + patience * (ACK_MIN_S + sent / ACK_FLOOR_BPS)
        while acked < len(frames):
            left = None if until is None else max(until - loop.time(), 0.001)
            got = await asyncio.wait_for(reader.read(len(frames) - acked), left)
            if not got:
                break  # the stream ended: what is not acknowledged goes again
            if got.strip(ACK):
                raise BadAcknowledgement(f"the peer answered {got[:8]!r}, not acknowledgements")
            acked += len(got)
    except (asyncio.TimeoutError, ConnectionError, asyncio.IncompleteReadError) as e:
        if isinstance(e, BadAcknowledgement):
            raise
        log.info("stream to a peer broke or went quiet peer=%s acknowledged=%d of %d reason=%s",
                 peer_id, acked, len(frames), type(e).__name__)
    finally:
        writer.close()
    return sent, acked


async def _write(writer: asyncio.StreamWriter, parts: list[Any], upload: RateLimiter) -> int:
    """One frame: its length, then its parts. -> bytes written."""
    size = sum(len(p) for p in parts)
    if upload.limited:  # under a cap: small writes, each paid for before it goes
        await upload.take(HEADER_LEN)
        writer.write(size.to_bytes(HEADER_LEN, "big"))
        for part in parts:
            view = memoryview(part).cast("B")
            for i in range(0, len(view), CHUNK_BYTES):
                chunk = view[i:i + CHUNK_BYTES]
                await upload.take(len(chunk))
                writer.write(chunk)
                await writer.drain()
    else:
        writer.write(size.to_bytes(HEADER_LEN, "big"))
        writer.writelines(parts)
    await writer.drain()
    return HEADER_LEN + size
