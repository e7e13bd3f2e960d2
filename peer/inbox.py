"""What another peer can make an averager read and hold: length-prefixed frames, and the
bounded buffer of frames for groups this member has not started yet.

Any key can open averaging streams to us and sign frames, so everything here is bounded per
peer as well as in total (issue 12, *resource limits*):

- a frame's announced length is checked before its body is read (``read_frame``);
- ``StreamGate``: at most ``max_streams`` concurrent streams per peer (more are closed at
  once; a member forwarding parts opens one per part, so it is well above a group's size in
  practice), and at most ``bodies`` frame bodies of one peer being read at a time (a peer's
  other streams wait, which backs up its sender through libp2p's flow control). A body is
  read in chunks into one allocation (``read_body``), so a stream holds no frame-sized buffer;
- ``PendingFrames``: frames for groups we have not started are buffered for at most
  ``ttl_s``, in at most ``max_groups`` groups and ``max_bytes`` bytes in all, and one peer's
  frames in at most ``max_groups_per_peer`` of those groups and ``max_bytes_per_peer``
  bytes, each item charged ``ITEM_OVERHEAD`` besides its frame, each blame and stream-end
  marker once. One identity gets at most its share: it cannot fill the buffer, though while
  the buffer is full of other peers' groups a new group of its own evicts the oldest one.
  A peer's frames for a new group, once it holds its share of groups, evict its own frames
  from its oldest group (``_make_room``), not the new ones: a peer whose earlier
  groups never started here (we did not follow its group record, or suspended it) would
  otherwise have its frames for the group we do start dropped until those expire, and that
  round wait for it until the push deadline (seen: 8 s a round). It can only evict itself.
  The evicted group takes no more frames of that peer (a bounded memory of such pairs): it
  would come back partial, evict the newer group in turn, and take a stream-end marker that
  drops the sender as short when the round starts (a review's repro).

Only asyncio, no I/O of its own besides reading the streams it is handed.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from collections.abc import AsyncIterator
from typing import Any

from protocol.envelope import Envelope
from protocol.errors import RemoteProtocolError
from protocol.messages import decode

log = logging.getLogger("peer.allreduce")  # the averager's log: one place to read a round's story

HEADER_LEN = 8  # bytes of the big-endian frame length, as hivemind's P2P.send_raw_data


class FrameTooLarge(RemoteProtocolError):
    pass


async def read_header(reader: asyncio.StreamReader, max_bytes: int, timeout: float) -> int | None:
    """The length of the next frame, or None at a clean end of stream; over ``max_bytes`` raises
    before a byte of the body is read."""
    try:
        header = await asyncio.wait_for(reader.readexactly(HEADER_LEN), timeout)
    except asyncio.IncompleteReadError as e:
        if not e.partial:
            return None
        raise
    size = int.from_bytes(header, "big")
    if size > max_bytes:
        raise FrameTooLarge(f"frame of {size} bytes is over the {max_bytes}-byte limit")
    return size


BODY_CHUNK = 1 << 20
"""Bytes asked of the stream at a time for a frame's body. Reading a body whole with
``readexactly`` grows the stream's own buffer to the frame's size, and CPython keeps that
allocation after the frame is taken from its front: each open stream would then hold a frame's
worth of memory between frames. In chunks, the stream's buffer stays at its limit (64 KiB)."""


async def read_body(reader: asyncio.StreamReader, size: int, timeout: float) -> bytearray:
    """A frame body of ``size`` bytes, in one allocation, within ``timeout`` seconds in all."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    body = bytearray(size)
    view = memoryview(body)
    pos = 0
    while pos < size:
        chunk = await asyncio.wait_for(reader.read(min(BODY_CHUNK, size - pos)), max(deadline - loop.time(), 0.001))
        if not chunk:
            raise asyncio.IncompleteReadError(b"", size)
        view[pos:pos + len(chunk)] = chunk
        pos += len(chunk)
    view.release()
    return body


async def read_frame(reader: asyncio.StreamReader, max_bytes: int, timeout: float) -> bytes | None:
    """One length-prefixed frame, or None at a clean end of stream. The announced length is
    checked before the body is read; each read waits at most ``timeout`` seconds."""
    size = await read_header(reader, max_bytes, timeout)
    if size is None:
        return None
    return bytes(await read_body(reader, size, timeout))


def peek_group(data: bytes) -> bytes | None:
    """The group ID a frame *claims*, without trusting it: only to know which round to blame
    the stream's (authenticated) remote peer in when the frame fails verification."""
    try:
        env = decode(data, expect=Envelope)
        gid = decode(env.body).context()[3]  # type: ignore[attr-defined]
        return bytes(gid) if gid is not None else None
    except RemoteProtocolError:
        return None


class TooManyStreams(Exception):
    """The peer already has ``max_streams`` averaging streams open to us."""


class StreamGate:
    """Concurrent streams per peer, and frame bodies of one peer in memory at once."""

    def __init__(self, max_streams: int = 32, bodies: int = 1):
        if max_streams < 1 or bodies < 1:
            raise ValueError("max_streams and bodies must be >= 1")
        self.max_streams, self.bodies = max_streams, bodies
        self._open: dict[str, int] = {}
        self._body: dict[str, asyncio.Semaphore] = {}

    def streams(self, peer_id: str) -> int:
        return self._open.get(peer_id, 0)

    @asynccontextmanager
    async def stream(self, peer_id: str) -> AsyncIterator[None]:
        """Hold one of the peer's stream slots; raises ``TooManyStreams`` when none is free."""
        if self._open.get(peer_id, 0) >= self.max_streams:
            raise TooManyStreams(f"{self.max_streams} streams open already")
        self._open[peer_id] = self._open.get(peer_id, 0) + 1
        self._body.setdefault(peer_id, asyncio.Semaphore(self.bodies))
        try:
            yield
        finally:
            self._open[peer_id] -= 1
            if not self._open[peer_id]:
                del self._open[peer_id], self._body[peer_id]

    def body(self, peer_id: str) -> asyncio.Semaphore:
        """Held while one of the peer's frame bodies is read and handled (inside ``stream``)."""
        return self._body[peer_id]


@dataclass(frozen=True, slots=True)
class StreamEnded:
    """A marker in a group's buffer: the sender's stream that carried its ``kind`` of frames
    (``PushSlice`` or ``SliceAveraged``) for the group ended here. A slice or part it left
    short will not be completed by that stream: the round drops the sender at once."""

    kind: type
    part: int = -1
    """The part its frames were of (a ``PushSlice`` to a witness is of its sender's own part)."""


MAX_CUT = 4096
"""(group, peer) pairs remembered as evicted for the peer's newer group (``PendingFrames._cut``):
at most twice its share of groups per peer, this many in all."""

ITEM_OVERHEAD = 512
"""Bytes charged per buffered item besides its frame: a blame or a marker is not free."""


@dataclass(slots=True)
class _Group:
    created: float
    items: list[tuple[str, Any, int, bytes]] = field(default_factory=list)
    nbytes: int = 0
    by_peer: dict[str, int] = field(default_factory=dict)  # bytes charged per peer
    notes: set[tuple[str, Any]] = field(default_factory=set)  # (peer, blame or marker): each once
    truncated: set[str] = field(default_factory=set)  # peers whose frames we dropped at a limit
    first: dict[str, float] = field(default_factory=dict)  # peer -> when its first waiting push came (monotonic)


class PendingFrames:
    """Frames (verified, or a blame string, or ``StreamEnded``) for groups not started yet."""

    def __init__(self, *, max_groups: int, max_bytes: int, max_groups_per_peer: int, max_bytes_per_peer: int,
                 ttl_s: float):
        if min(max_groups, max_bytes, max_groups_per_peer, max_bytes_per_peer) < 0:
            raise ValueError("the pending limits must be >= 0")
        self.max_groups, self.max_bytes, self.ttl_s = max_groups, max_bytes, ttl_s
        self.max_groups_per_peer, self.max_bytes_per_peer = max_groups_per_peer, max_bytes_per_peer
        self._groups: OrderedDict[bytes, _Group] = OrderedDict()
        self._cut: OrderedDict[tuple[bytes, str], None] = OrderedDict()  # (group, peer) dropped for a newer group
        self._bytes = 0
        self._peer_bytes: dict[str, int] = {}

    @property
    def nbytes(self) -> int:
        return self._bytes

    def peer_bytes(self, peer_id: str) -> int:
        return self._peer_bytes.get(peer_id, 0)

    def groups(self) -> list[bytes]:
        """Buffered group IDs, oldest first."""
        return list(self._groups)

    def items(self, gid: bytes) -> list[tuple[str, Any, int, bytes]]:
        g = self._groups.get(gid)
        return list(g.items) if g is not None else []

    def __contains__(self, gid: bytes) -> bool:
        return gid in self._groups

    def add(self, gid: bytes, peer_id: str, item: Any, nbytes: int = 0, data: bytes = b"", *,
            waits: bool = False) -> bool:
        """Buffer ``item`` (a verified frame of ``nbytes``, or a blame string) from ``peer_id``
        for group ``gid``. -> False when it was dropped (logged) at a limit. ``waits``: the
        frame is a push of a member that started the round at its step and now waits for us
        (what ``waited`` and ``started`` count; a blame, a note or a push sent early by a
        member that pauses, stops or catches up by a download does not)."""
        self._expire()
        g = self._groups.get(gid)
        if isinstance(item, str) and g is not None and (peer_id, item) in g.notes:
            return True  # this blame is there already
        if (gid, peer_id) in self._cut:  # its frames here gave way to a newer group of it: the rest too
            log.info("frame for an unknown group dropped reason=older_group_of_peer peer=%s bytes=%d", peer_id, nbytes)
            return False  # (the group must not come back partial and evict the newer one in turn)
        charge = nbytes + ITEM_OVERHEAD
        self._make_room(gid, peer_id)
        why = ""
        if g is None or peer_id not in g.by_peer:
            held = sum(1 for other in self._groups.values() if peer_id in other.by_peer)
            if held >= self.max_groups_per_peer:
                why = "peer_groups_full"
        if not why and self._bytes + charge > self.max_bytes:
            why = "pending_full"
        if not why and self.peer_bytes(peer_id) + charge > self.max_bytes_per_peer:
            why = "peer_pending_full"
        if not why and g is None and self.max_groups == 0:
            why = "no_buffer"
        if why:
            log.warning("frame for an unknown group dropped reason=%s peer=%s bytes=%d", why, peer_id, nbytes)
            if g is not None:
                g.truncated.add(peer_id)  # its slice here is short by our doing: no marker blames it
            return False
        if g is None:
            while len(self._groups) >= self.max_groups:
                self._evict(next(iter(self._groups)), "too_many_groups")
            g = self._groups[gid] = _Group(created=time.monotonic())
        self._append(g, peer_id, item, nbytes, charge, data)
        if waits:
            g.first.setdefault(peer_id, time.monotonic())
        if isinstance(item, str):
            g.notes.add((peer_id, item))
        return True

    def _make_room(self, gid: bytes, peer_id: str) -> None:
        """If group ``gid`` holds no frames of ``peer_id`` yet and it holds its share of groups,
        drop its frames from its oldest groups until it holds one fewer. (Its bytes are left as
        they are: a peer's frames for two groups at once, two fragments, are both wanted.)"""
        g = self._groups.get(gid)
        if g is not None and peer_id in g.by_peer:
            return
        mine = [other for other, og in self._groups.items() if peer_id in og.by_peer]
        for other in mine[:max(0, len(mine) - self.max_groups_per_peer + 1)] if self.max_groups_per_peer else ():
            self._drop_peer(other, peer_id)

    def _drop_peer(self, gid: bytes, peer_id: str) -> None:
        """Forget ``peer_id``'s items in group ``gid`` (the whole group if they are all it has),
        and refuse its later ones there (``add``, ``note``)."""
        self._cut[(gid, peer_id)] = None
        mine = [key for key in self._cut if key[1] == peer_id]  # a few per peer: one peer's made-up
        for key in mine[:max(0, len(mine) - 2 * max(1, self.max_groups_per_peer))]:  # groups must not push
            del self._cut[key]  # another's out
        while len(self._cut) > MAX_CUT:
            self._cut.popitem(last=False)
        g = self._groups[gid]
        if all(p == peer_id for p, *_ in g.items):
            self._evict(gid, "newer_group_of_peer")
            return
        n = g.by_peer.pop(peer_id)
        g.items = [it for it in g.items if it[0] != peer_id]
        g.nbytes -= n
        self._bytes -= n
        left = self.peer_bytes(peer_id) - n
        if left > 0:
            self._peer_bytes[peer_id] = left
        else:
            self._peer_bytes.pop(peer_id, None)
        g.notes = {note for note in g.notes if note[0] != peer_id}
        g.first.pop(peer_id, None)
        g.truncated.add(peer_id)  # its frames here were dropped by us: no marker blames it short
        log.info("dropped buffered frames of a peer for its newer group reason=newer_group_of_peer peer=%s group=%s "
                 "bytes=%d", peer_id, gid.hex(), n)

    def note(self, gid: bytes, peer_id: str, item: Any) -> None:
        """Add ``item`` (a marker) once to a group already buffered with frames of ``peer_id``,
        unless some of those frames were dropped here at a limit."""
        g = self._groups.get(gid)
        if g is None or peer_id not in g.by_peer or peer_id in g.truncated or (peer_id, item) in g.notes \
                or (gid, peer_id) in self._cut:
            return
        if self._bytes + ITEM_OVERHEAD > self.max_bytes:
            return
        g.notes.add((peer_id, item))
        self._append(g, peer_id, item, 0, ITEM_OVERHEAD, b"")

    def waited(self, gid: bytes, peer_ids: list[str]) -> float:
        """Seconds since half of ``peer_ids`` (rounded up: one liar of three cannot decide it)
        had sent frames for group ``gid`` that wait for us to start it; 0 if fewer did. How
        long the group's other members were kept waiting by us (``peer.pace``)."""
        g = self._groups.get(gid)
        if g is None or not peer_ids:
            return 0.0
        came = sorted(g.first[p] for p in peer_ids if p in g.first)
        half = -(-len(peer_ids) // 2)
        return time.monotonic() - came[half - 1] if len(came) >= half else 0.0

    def started(self, gid: bytes, peer_ids: list[str], majority: bool = False) -> bool:
        """Whether half of ``peer_ids`` (rounded up; with ``majority``, more than half) have
        sent frames for group ``gid`` that wait for us: they started its all-reduce. Read from
        the training thread (dict lookups only)."""
        g = self._groups.get(gid)
        need = len(peer_ids) // 2 + 1 if majority else -(-len(peer_ids) // 2)
        return g is not None and sum(p in g.first for p in peer_ids) >= need  # none of none: False

    def _append(self, g: _Group, peer_id: str, item: Any, nbytes: int, charge: int, data: bytes) -> None:
        g.items.append((peer_id, item, nbytes, data))
        g.nbytes += charge
        g.by_peer[peer_id] = g.by_peer.get(peer_id, 0) + charge
        self._bytes += charge
        self._peer_bytes[peer_id] = self.peer_bytes(peer_id) + charge

    def pop(self, gid: bytes) -> list[tuple[str, Any, int, bytes]]:
        """The group's items in arrival order (none if nothing was buffered); forgets them."""
        g = self._groups.pop(gid, None)
        if g is None:
            return []
        self._release(g)
        return g.items

    def clear(self) -> None:
        self._groups.clear()
        self._cut.clear()
        self._bytes = 0
        self._peer_bytes.clear()

    def _release(self, g: _Group) -> None:
        self._bytes -= g.nbytes
        for peer_id, n in g.by_peer.items():
            left = self._peer_bytes.get(peer_id, 0) - n
            if left > 0:
                self._peer_bytes[peer_id] = left
            else:
                self._peer_bytes.pop(peer_id, None)

    def _expire(self) -> None:
        now = time.monotonic()
        while self._groups:
            gid, g = next(iter(self._groups.items()))
            if now - g.created <= self.ttl_s:
                break
            self._evict(gid, "expired")

    def _evict(self, gid: bytes, why: str) -> None:
        g = self._groups.pop(gid)
        self._release(g)
        log.info("dropped buffered frames reason=%s group=%s frames=%d bytes=%d", why, gid.hex(), len(g.items),
                 g.nbytes)


RECENT_ROUNDS = 4  # finished rounds always kept to answer a late member's report (``keep_recent``)
RECENT_BYTES = 256 << 20  # and more of them, within their time, while their frames take no more than this


def keep_recent(recent: OrderedDict[bytes, Any], now: float) -> None:
    """Forget the oldest finished rounds (``recent``, oldest first; ``peer.allreduce_round.Round``)
    beyond the newest ``RECENT_ROUNDS`` once past their ``keep_until`` (two agreement windows
    after they finished), or while the frames kept take more than ``RECENT_BYTES``. A member
    late to a round reports when it gets there: after a wait in a group nobody else joined,
    that is up to a window after we finished, and a swarm of small fragments finishes many
    rounds meanwhile (CI: a starved member came 9 s after its group had landed, four of the
    others' rounds later; nobody answered its report, and it landed apart)."""
    held = {gid: _held_bytes(r) for gid, r in recent.items()}
    total = sum(held.values())
    while len(recent) > RECENT_ROUNDS:
        gid, oldest = next(iter(recent.items()))
        if now <= oldest.keep_until and total <= RECENT_BYTES:
            return
        total -= held.pop(gid)
        del recent[gid]


def _held_bytes(rnd: Any) -> int:
    """Bytes of the signed frames a finished round keeps: its parts, and an audit's inputs."""
    frames = [*(f for fs in rnd.frames.values() for f in fs), *rnd.own_frames,
              *([d] for fs in rnd.push_frames.values() for *_, d in fs)]
    return sum(memoryview(b).nbytes for f in frames for b in f)
