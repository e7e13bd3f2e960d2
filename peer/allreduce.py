"""Butterfly all-reduce of one fragment's flat fp32 vector among a formed group, over libp2p.

The arithmetic is ``protocol.butterfly``'s and must match ``peer.simulation.allreduce`` bit for
bit: member j reduces slice j. Every member encodes its foreign slices with the group's codec
and pushes them (``PushSlice``) to their reducers; reducer j accumulates in fp32, in member
index order, ``weight_i / total * decode(slice_i)`` for every contributor i (its own slice
unencoded, at its own index), encodes that mean once and pushes it (``SliceAveraged``) to
every other contributor. Every member, the reducer included, keeps the *decoded* mean, so all
members that got part j hold the same bytes for it.

Transport. One handler per run (``HANDLER_PREFIX`` + run ID) on hivemind's P2P binary
streams. Everything is a push: a sender opens a stream to a member, writes its frames and
closes it; nothing is answered on the same stream, so a reducer never holds a stream open
while it waits for the others. A frame is an 8-byte big-endian length (hivemind's
``P2P.send_raw_data`` framing) followed by one signed envelope; the length is checked against
``max_frame_bytes`` before a byte of the body is read. A slice whose envelope would exceed
that is sent as several messages with consecutive offsets, cut at multiples of 256 elements
(a multiple of every codec's block), so the decoded values are those of one whole encoding.

Checks on every frame: the envelope's signature, that it is for this run (then round,
fragment and group through the signed context), that its signer is the libp2p peer the
stream came from (libp2p authenticated that connection with the same key), that the signer
is the member expected for that part, and the slice's codec, dtype, shape ``(numel,)``,
offset and extent, weight, and that it decodes to finite values. Any failure drops that
member from the round (``reason=... peer=<peer id>`` in the log): nothing it sent is used,
its slice is not reduced, and its own reduced part falls back (below). A frame that does not
even verify is blamed on the stream's remote peer, which libp2p authenticated.

Deadlines (``D = group.deadline_s``, from the moment ``allreduce`` is called): pushes for our
slice must be in by ``D``; members missing then are dropped and the reducer averages the rest,
re-weighted over the members it actually received from (``SliceAveraged.contributors``,
``weight`` = their summed weight). Reduced parts must be in by ``1.5 * D``; every send and
read is bounded by the same deadlines, so no round can hang on a stalled or killed member.

Fallback. A part whose reducer was dropped (timed out, unreachable, or sent garbage) holds
*this member's own value* in the returned average, and is listed in
``AllReduceOutcome.fallback_parts``. Those elements can differ between members; all other
parts are identical on every member that got them. ``peer.node``, whose vectors are
pseudo-gradients, replaces those parts with zeros (that slice of the global copy stays
where it was), which is the same on every surviving member.

Memory bounds. Frames may arrive before the local member has called ``allreduce`` for their
group (it learned of the group a little later than the sender). They are verified (signature,
run, sender) and buffered per group ID, at most ``max_pending_groups`` groups (the oldest is
evicted) and ``max_pending_bytes`` in all (frames beyond are dropped), each group for at most
``pending_ttl_s``. Frames for a group this member already finished are dropped (a bounded
memory of recent group IDs). So failed or foreign rounds cannot grow memory. Raise
``max_pending_bytes`` if you see ``reason=pending_full`` with large fragments.

Only asyncio: no threads or processes. Encoding and decoding run on the event loop (they are
vectorized torch ops; a 64 MB slice takes tens of milliseconds).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from collections.abc import Awaitable, Callable
from typing import Any

import torch
from hivemind.p2p import P2P, PeerID

from peer.ratelimit import CHUNK_BYTES, RateLimiter
from protocol.butterfly import slice_bounds
from protocol.codecs import Codec, get_codec
from protocol.envelope import Envelope, Verified, seal_parts, verify
from protocol.errors import LocalProtocolError, RemoteProtocolError
from protocol.identity import Identity, peer_id_from_public_key
from protocol.messages import MAX_FRAME_BYTES, decode
from protocol.messages_swarm import PushSlice, SliceAveraged

__all__ = ["HANDLER_PREFIX", "AllReduceOutcome", "Averager", "Group", "chunk_elements"]

log = logging.getLogger(__name__)

HANDLER_PREFIX = "swarmstream-avg-v1-"
HEADER_LEN = 8  # bytes of the big-endian frame length, as hivemind's P2P.send_raw_data
CHUNK_ALIGN = 256  # elements: a multiple of every codec's block (int8: 256, fp4: 32)
_HEAD_ROOM = 4096  # bytes of a frame that are not payload: envelope and message heads
RESULT_GRACE = 0.5  # reduced parts are due by (1 + RESULT_GRACE) * deadline_s
_FINISHED_MEMORY = 1024  # group IDs of finished rounds whose late frames we drop quietly


@dataclass(frozen=True, slots=True)
class Group:
    """What a verified ``GroupFormed`` says: who averages, in which order, how."""

    run_id: bytes
    fragment: int
    round: int
    group_id: bytes
    members: tuple[bytes, ...]
    """Ed25519 public keys, ordered: member j reduces slice j."""
    weights: tuple[float, ...]
    numel: int
    codec: str
    deadline_s: float


@dataclass(slots=True)
class AllReduceOutcome:
    average: torch.Tensor
    """(numel,) fp32: identical on every member that finished, except ``fallback_parts``."""
    dropped: tuple[int, ...]
    """Member indices excluded from this member's round (timed out, unreachable, bad signature,
    shape, codec or values)."""
    fallback_parts: tuple[int, ...]
    """Slices whose reducer was dropped: those elements hold this member's own value."""
    bytes_sent: int
    bytes_received: int
    elapsed_s: float
    partial_parts: tuple[int, ...] = ()
    """Parts we hold that their reducer averaged without some member (it dropped that one's
    slice). The drop was not ours, but it says the members may not all hold the same result
    (the dropped one kept its own value there): compare states after the round."""


def chunk_elements(max_frame_bytes: int) -> int:
    """Elements per message so that any codec's envelope fits in ``max_frame_bytes`` (4 bytes
    per element is the largest codec), a multiple of ``CHUNK_ALIGN``."""
    return (max_frame_bytes - _HEAD_ROOM) // 4 // CHUNK_ALIGN * CHUNK_ALIGN


def _chunks(start: int, end: int, step: int) -> list[tuple[int, int]]:
    return [(a, min(a + step, end)) for a in range(start, end, step)]


class _FrameTooLarge(RemoteProtocolError):
    pass


async def read_frame(reader: asyncio.StreamReader, max_bytes: int, timeout: float) -> bytes | None:
    """One length-prefixed frame, or None at a clean end of stream. The announced length is
    checked before the body is read; each read waits at most ``timeout`` seconds."""
    try:
        header = await asyncio.wait_for(reader.readexactly(HEADER_LEN), timeout)
    except asyncio.IncompleteReadError as e:
        if not e.partial:
            return None
        raise
    size = int.from_bytes(header, "big")
    if size > max_bytes:
        raise _FrameTooLarge(f"frame of {size} bytes is over the {max_bytes}-byte limit")
    return await asyncio.wait_for(reader.readexactly(size), timeout)


def _peek_group(data: bytes) -> bytes | None:
    """The group ID a frame *claims*, without trusting it: only to know which round to blame
    the stream's (authenticated) remote peer in when the frame fails verification."""
    try:
        env = decode(data, expect=Envelope)
        gid = decode(env.body).context()[3]  # type: ignore[attr-defined]
        return bytes(gid) if gid is not None else None
    except RemoteProtocolError:
        return None


def _check_disjoint(chunks: list[tuple[int, int]], offset: int, numel: int) -> None:
    """A new chunk may not overlap one already received: every element comes exactly once,
    so "as many elements as the slice" means "all of the slice"."""
    for off, cnt in chunks:
        if offset < off + cnt and off < offset + numel:
            raise RemoteProtocolError(f"chunk [{offset}, {offset + numel}) overlaps one already received")


@dataclass(slots=True)
class _Pending:
    """Verified frames (or blames) for a group this member has not started yet."""

    created: float
    items: list[tuple[str, Verified | str, int]] = field(default_factory=list)
    nbytes: int = 0


class _Round:
    """One member's state of one group's all-reduce. Fed by the stream handler, read by
    ``Averager.allreduce``; ``changed`` wakes the latter whenever something arrives."""

    def __init__(self, group: Group, me: int, vector: torch.Tensor, codec: Codec):
        self.group, self.me, self.codec = group, me, codec
        self.n = len(group.members)
        self.bounds = slice_bounds(group.numel, self.n)
        self.peer_ids = [peer_id_from_public_key(k) for k in group.members]
        self.index = {p: i for i, p in enumerate(self.peer_ids)}
        self.vector = vector  # (numel,) fp32, our own values
        self.result = torch.empty(group.numel, dtype=torch.float32)
        self.dropped: dict[int, str] = {}  # member -> reason
        # pushes of our slice: sender -> [(offset, numel, payload)], and elements covered
        self.pushes: dict[int, list[tuple[int, int, Any]]] = {}
        self.pushed = [0] * self.n
        # reduced parts from the other reducers: elements covered and contributors seen
        self.got = [0] * self.n
        self.contributors: dict[int, tuple[int, ...]] = {}
        self.mean_chunks: dict[int, list[tuple[int, int]]] = {}  # part -> [(offset, numel)]
        self.collecting_pushes = True
        self.collecting_means = True
        self.bytes_received = 0
        self.changed = asyncio.Event()

    def size(self, j: int) -> int:
        s, e = self.bounds[j]
        return e - s

    # --- what the waiters ask -------------------------------------------------------------

    def pushes_done(self) -> bool:
        return all(i == self.me or i in self.dropped or self.pushed[i] == self.size(self.me) for i in range(self.n))

    def means_done(self) -> bool:
        return all(j == self.me or j in self.dropped or self.got[j] == self.size(j) for j in range(self.n))

    # --- what the handler feeds -----------------------------------------------------------

    def drop(self, i: int, reason: str) -> None:
        if i == self.me or i in self.dropped:
            return
        self.dropped[i] = reason
        log.warning("dropped member reason=%s peer=%s group=%s index=%d", reason, self.peer_ids[i],
                    self.group.group_id.hex(), i)
        self.changed.set()

    def accept(self, peer_id: str, v: Verified, nbytes: int) -> None:
        i = self.index.get(peer_id)
        if i is None:
            log.warning("rejected slice reason=not_a_member peer=%s group=%s", peer_id, self.group.group_id.hex())
            return
        if i in self.dropped or i == self.me:
            return
        self.bytes_received += nbytes
        msg = v.message
        try:
            if isinstance(msg, PushSlice):
                self._accept_push(i, msg)
            else:
                self._accept_mean(i, msg)  # type: ignore[arg-type]
        except RemoteProtocolError as e:
            self.drop(i, f"{type(msg).__name__}:{e}")
            return
        self.changed.set()

    def _check_slice(self, msg: PushSlice | SliceAveraged, part: int, covered: int) -> None:
        g = self.group
        s, e = self.bounds[part]
        if msg.codec != g.codec:
            raise RemoteProtocolError(f"codec {msg.codec} is not the group's {g.codec}")
        if msg.dtype != "float32" or tuple(msg.shape) != (msg.numel,):
            raise RemoteProtocolError(f"shape {tuple(msg.shape)} / dtype {msg.dtype} is not a flat float32 slice")
        if msg.numel == 0 or not (s <= msg.offset and msg.offset + msg.numel <= e):
            raise RemoteProtocolError(f"elements [{msg.offset}, {msg.offset + msg.numel}) are outside "
                                      f"slice {part} [{s}, {e})")
        if covered + msg.numel > e - s:
            raise RemoteProtocolError(f"more than the {e - s} elements of slice {part}")

    def _accept_push(self, i: int, msg: PushSlice) -> None:
        if msg.part != self.me:
            raise RemoteProtocolError(f"part {msg.part} sent to the reducer of part {self.me}")
        if not self.collecting_pushes:
            log.info("late slice ignored peer=%s group=%s", self.peer_ids[i], self.group.group_id.hex())
            return
        self._check_slice(msg, self.me, self.pushed[i])
        if msg.weight != self.group.weights[i]:
            raise RemoteProtocolError(f"weight {msg.weight} is not the group's {self.group.weights[i]}")
        chunks = self.pushes.setdefault(i, [])
        _check_disjoint([(off, cnt) for off, cnt, _ in chunks], msg.offset, msg.numel)
        self.codec.decode(msg.payload, msg.numel)  # layout, scales and finiteness; raises
        chunks.append((msg.offset, msg.numel, msg.payload))
        self.pushed[i] += msg.numel

    def _accept_mean(self, j: int, msg: SliceAveraged) -> None:
        if msg.part != j:
            raise RemoteProtocolError(f"reduced part {msg.part} sent by the reducer of part {j}")
        if not self.collecting_means:
            log.info("late reduced part ignored peer=%s group=%s", self.peer_ids[j], self.group.group_id.hex())
            return
        self._check_slice(msg, j, self.got[j])
        contrib = tuple(msg.contributors)
        if j not in contrib or contrib[-1] >= self.n:
            raise RemoteProtocolError(f"contributors {contrib} must include the reducer and be members")
        if self.contributors.setdefault(j, contrib) != contrib:
            raise RemoteProtocolError("contributors differ between chunks of one part")
        total = math.fsum(self.group.weights[c] for c in contrib)
        if not math.isclose(msg.weight, total, rel_tol=1e-9, abs_tol=1e-12):
            raise RemoteProtocolError(f"weight {msg.weight} is not the contributors' total {total}")
        _check_disjoint(self.mean_chunks.setdefault(j, []), msg.offset, msg.numel)
        decoded = self.codec.decode(msg.payload, msg.numel)  # raises on bad bytes or non-finite values
        self.result[msg.offset:msg.offset + msg.numel] = decoded
        self.mean_chunks[j].append((msg.offset, msg.numel))
        self.got[j] += msg.numel

    # --- the reduction ------------------------------------------------------------------

    def reduce(self) -> tuple[torch.Tensor, tuple[int, ...], float]:
        """Our slice's weighted mean over the members we have all of, in member order, as
        peer.simulation.allreduce does it. -> (fp32 mean, contributors, their total weight)."""
        me, (s, e) = self.me, self.bounds[self.me]
        contrib = tuple(i for i in range(self.n)
                        if i == me or (i not in self.dropped and self.pushed[i] == e - s))
        total_w = float(sum(self.group.weights[i] for i in contrib))
        acc = torch.zeros(e - s, dtype=torch.float32)
        for i in contrib:
            w = self.group.weights[i] / total_w
            if i == me:
                acc.add_(self.vector[s:e], alpha=w)
            else:
                for off, cnt, payload in sorted(self.pushes.get(i, ()), key=lambda c: c[0]):
                    self.codec.decode_add_(acc[off - s:off - s + cnt], payload, w)
        self.pushes.clear()  # the payloads are no longer needed
        return acc, contrib, total_w


class Averager:
    """Runs the all-reduces of one run's groups on one P2P instance (see the module docstring).

    ``max_frame_bytes`` bounds every frame we read or write; keep it equal across a run's
    peers (a smaller value on a receiver refuses the larger frames of others). Lower it on
    memory-starved peers; raise it for fewer messages per slice.
    """

    def __init__(self, p2p: P2P, identity: Identity, run_id: bytes, *, max_pending_groups: int = 8,
                 max_frame_bytes: int = 64 << 20, max_pending_bytes: int | None = None,
                 pending_ttl_s: float = 120.0, read_timeout_s: float = 30.0,
                 upload: RateLimiter | None = None, download: RateLimiter | None = None):
        if not 2 * _HEAD_ROOM <= max_frame_bytes <= MAX_FRAME_BYTES:
            raise LocalProtocolError(f"max_frame_bytes must be in [{2 * _HEAD_ROOM}, {MAX_FRAME_BYTES}], "
                                     f"got {max_frame_bytes}")
        if max_pending_groups < 0:
            raise LocalProtocolError("max_pending_groups must be >= 0")
        self.p2p = p2p
        self.identity = identity
        self.run_id = bytes(run_id)
        self.max_pending_groups = max_pending_groups
        self.max_frame_bytes = max_frame_bytes
        self.max_pending_bytes = 4 * max_frame_bytes if max_pending_bytes is None else max_pending_bytes
        self.pending_ttl_s = pending_ttl_s
        self.read_timeout_s = read_timeout_s
        self.reconnect: Callable[[str], Awaitable[bool]] | None = None
        """Called with a peer ID when no stream to it could be opened; True if it opened
        another way there (the node dials peers behind NAT through their relays)."""
        # the volunteer's bandwidth caps (shared with the node, which changes their rates)
        self.upload = upload or RateLimiter()
        self.download = download or RateLimiter()
        self.handler_name = HANDLER_PREFIX + self.run_id.hex()
        self._active: dict[bytes, _Round] = {}
        self._pending: OrderedDict[bytes, _Pending] = OrderedDict()
        self._pending_bytes = 0
        self._finished: deque[bytes] = deque(maxlen=_FINISHED_MEMORY)
        self._started = False

    # --- lifecycle ----------------------------------------------------------------------

    async def start(self) -> None:
        await self.p2p.add_binary_stream_handler(self.handler_name, self._handle_stream)
        self._started = True

    async def shutdown(self) -> None:
        if self._started:
            self._started = False
            try:
                await self.p2p.remove_binary_stream_handler(self.handler_name)
            except Exception as e:  # noqa: BLE001  (the daemon may be gone already; nothing else to undo)
                log.info("could not remove the averaging handler reason=%r", e)
        self._pending.clear()
        self._pending_bytes = 0

    @property
    def pending_bytes(self) -> int:
        """Bytes of buffered frames for groups not started yet (bounded by max_pending_bytes)."""
        return self._pending_bytes

    # --- inbound ------------------------------------------------------------------------

    async def _handle_stream(self, info: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer_id = info.peer_id.to_base58()
        try:
            while True:
                data = await read_frame(reader, self.max_frame_bytes, self.read_timeout_s)
                if data is None:
                    break
                await self.download.take(HEADER_LEN + len(data))  # holds back the sender under a cap
                self._on_frame(peer_id, data)
        except _FrameTooLarge as e:
            self._blame(peer_id, None, f"frame_too_large:{e}")
        except (asyncio.TimeoutError, asyncio.IncompleteReadError, ConnectionError) as e:
            log.info("averaging stream ended early reason=%s peer=%s", type(e).__name__, peer_id)
        finally:
            writer.close()

    def _on_frame(self, peer_id: str, data: bytes) -> None:
        try:
            v = verify(data, expect=(PushSlice, SliceAveraged), run_id=self.run_id, sender=peer_id,
                       max_size=self.max_frame_bytes)
        except RemoteProtocolError as e:
            self._blame(peer_id, _peek_group(data), f"{type(e).__name__}:{e}")
            return
        gid = bytes(v.message.group_id)  # type: ignore[attr-defined]
        nbytes = HEADER_LEN + len(data)
        rnd = self._active.get(gid)
        if rnd is not None:
            rnd.accept(peer_id, v, nbytes)
        elif gid in self._finished:
            log.debug("frame for a finished group dropped peer=%s group=%s", peer_id, gid.hex())
        else:
            self._buffer(gid, peer_id, v, nbytes)

    def _blame(self, peer_id: str, gid: bytes | None, reason: str) -> None:
        """A frame from ``peer_id`` (authenticated by libp2p) was bad: drop it from the round
        the frame claims, or from every round it is in if the frame names none we know."""
        log.warning("rejected slice reason=%s peer=%s", reason, peer_id)
        if gid is not None and gid in self._active:
            rounds = [self._active[gid]]
        elif gid is not None and gid not in self._finished:
            self._buffer(gid, peer_id, reason, 0)
            return
        else:
            rounds = [r for r in self._active.values() if peer_id in r.index]
        for r in rounds:
            if peer_id in r.index:
                r.drop(r.index[peer_id], reason)

    def _expire_pending(self) -> None:
        now = time.monotonic()
        while self._pending:
            gid, p = next(iter(self._pending.items()))
            if now - p.created <= self.pending_ttl_s:
                break
            self._evict(gid, "expired")

    def _evict(self, gid: bytes, why: str) -> None:
        p = self._pending.pop(gid)
        self._pending_bytes -= p.nbytes
        log.info("dropped buffered frames reason=%s group=%s frames=%d bytes=%d", why, gid.hex(), len(p.items),
                 p.nbytes)

    def _buffer(self, gid: bytes, peer_id: str, item: Verified | str, nbytes: int) -> None:
        self._expire_pending()
        p = self._pending.get(gid)
        if p is None:
            if self.max_pending_groups == 0:
                log.info("frame for an unknown group dropped reason=no_buffer peer=%s", peer_id)
                return
            while len(self._pending) >= self.max_pending_groups:
                self._evict(next(iter(self._pending)), "too_many_groups")
            p = self._pending[gid] = _Pending(created=time.monotonic())
        if self._pending_bytes + nbytes > self.max_pending_bytes:
            log.warning("frame for an unknown group dropped reason=pending_full peer=%s bytes=%d", peer_id, nbytes)
            return
        p.items.append((peer_id, item, nbytes))
        p.nbytes += nbytes
        self._pending_bytes += nbytes

    # --- outbound -----------------------------------------------------------------------

    async def _send_frames(self, peer_id: str, frames: list[list[Any]]) -> int:
        """Open a stream to ``peer_id``, write each frame (sealed parts), close. -> bytes sent."""
        try:
            _, _, writer = await self.p2p.call_binary_stream_handler(PeerID.from_base58(peer_id), self.handler_name)
        except Exception:  # no connection and no address of theirs we can dial
            if self.reconnect is None or not await self.reconnect(peer_id):
                raise
            _, _, writer = await self.p2p.call_binary_stream_handler(PeerID.from_base58(peer_id), self.handler_name)
        sent = 0
        try:
            for parts in frames:
                size = sum(len(p) for p in parts)
                if self.upload.limited:  # under a cap: small writes, each paid for before it goes
                    await self.upload.take(HEADER_LEN)
                    writer.write(size.to_bytes(HEADER_LEN, "big"))
                    for part in parts:
                        view = memoryview(part).cast("B")
                        for i in range(0, len(view), CHUNK_BYTES):
                            chunk = view[i:i + CHUNK_BYTES]
                            await self.upload.take(len(chunk))
                            writer.write(chunk)
                            await writer.drain()
                else:
                    writer.write(size.to_bytes(HEADER_LEN, "big"))
                    writer.writelines(parts)
                await writer.drain()
                sent += HEADER_LEN + size
        finally:
            writer.close()
        return sent

    def _encode(self, rnd: _Round, part: int, values: torch.Tensor) -> list[tuple[int, int, bytes]]:
        """``values`` (the elements of slice ``part``) encoded in chunks: [(start, end, bytes)]."""
        s, e = rnd.bounds[part]
        return [(a, b, rnd.codec.encode(values[a - s:b - s]))
                for a, b in _chunks(s, e, chunk_elements(self.max_frame_bytes))]

    def _frames(self, rnd: _Round, part: int, encoded: list[tuple[int, int, bytes]], weight: float,
                contributors: tuple[int, ...] | None) -> list[list[Any]]:
        """Sealed PushSlices (or SliceAverageds, with ``contributors``) carrying ``encoded``."""
        g = rnd.group
        frames = []
        for a, b, payload in encoded:
            common: dict[str, Any] = {
                "run_id": g.run_id, "fragment": g.fragment, "round": g.round, "group_id": g.group_id, "part": part,
                "offset": a, "numel": b - a, "shape": (b - a,), "dtype": "float32", "codec": g.codec,
                "weight": weight, "payload": payload}
            msg = (PushSlice(**common) if contributors is None
                   else SliceAveraged(contributors=contributors, **common))
            frames.append(seal_parts(msg, self.identity))
        return frames

    # --- the all-reduce -----------------------------------------------------------------

    async def allreduce(self, group: Group, vector: torch.Tensor, weight: float) -> AllReduceOutcome:
        """Average ``vector`` (numel,) with the group's other members; see the module docstring.
        Never waits more than ``1.5 * group.deadline_s`` (plus the local encode/decode)."""
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        started = time.perf_counter()
        me = self._check_call(group, vector, weight)
        vec = vector.detach().to(device="cpu", dtype=torch.float32).reshape(-1).contiguous()
        if len(group.members) == 1:
            return AllReduceOutcome(vec.clone(), (), (), 0, 0, time.perf_counter() - started)
        gid = bytes(group.group_id)
        if gid in self._active:
            raise LocalProtocolError(f"group {gid.hex()} is already averaging")
        rnd = _Round(group, me, vec, get_codec(group.codec))
        self._active[gid] = rnd
        pending = self._pending.pop(gid, None)
        if pending is not None:
            self._pending_bytes -= pending.nbytes
            for peer_id, item, nbytes in pending.items:
                if isinstance(item, str):
                    if peer_id in rnd.index:
                        rnd.drop(rnd.index[peer_id], item)
                else:
                    rnd.accept(peer_id, item, nbytes)
        tasks: list[asyncio.Task[None]] = []
        sent = [0]
        try:
            push_deadline = t0 + group.deadline_s
            end_deadline = t0 + (1 + RESULT_GRACE) * group.deadline_s
            for j in range(rnd.n):
                if j != me and rnd.size(j):
                    s, e = rnd.bounds[j]
                    frames = self._frames(rnd, j, self._encode(rnd, j, vec[s:e]), group.weights[me], None)
                    tasks.append(asyncio.create_task(self._deliver(rnd, j, frames, push_deadline, sent, True)))
            await self._wait(rnd, rnd.pushes_done, push_deadline)
            rnd.collecting_pushes = False
            for i in range(rnd.n):
                if i != me and i not in rnd.dropped and rnd.pushed[i] != rnd.size(me):
                    rnd.drop(i, "timeout:slice not received in time")

            if rnd.size(me):
                mean, contrib, total = rnd.reduce()
                encoded = self._encode(rnd, me, mean)
                frames = self._frames(rnd, me, encoded, total, contrib)
                for a, b, payload in encoded:  # the mean exactly as the others decode it
                    rnd.result[a:b] = rnd.codec.decode(payload, b - a)
                for i in contrib:
                    if i != me:
                        tasks.append(asyncio.create_task(self._deliver(rnd, i, frames, end_deadline, sent, False)))

            await self._wait(rnd, rnd.means_done, end_deadline)
            rnd.collecting_means = False
            for j in range(rnd.n):
                if j != me and j not in rnd.dropped and rnd.got[j] != rnd.size(j):
                    rnd.drop(j, "timeout:reduced part not received in time")
            if tasks:
                await asyncio.wait(tasks, timeout=max(0.0, end_deadline - loop.time()))
        finally:
            for t in tasks:
                t.cancel()
            if tasks:
                await asyncio.gather(*tasks, return_exceptions=True)
            self._active.pop(gid, None)
            self._finished.append(gid)

        fallback = tuple(j for j in sorted(rnd.dropped) if rnd.size(j))
        for j in fallback:
            s, e = rnd.bounds[j]
            rnd.result[s:e] = vec[s:e]
        # (our own part is never partial unless we dropped someone, which ``dropped`` says)
        partial = tuple(j for j, contrib in sorted(rnd.contributors.items())
                        if j not in rnd.dropped and len(contrib) < rnd.n)
        return AllReduceOutcome(rnd.result, tuple(sorted(rnd.dropped)), fallback, sent[0], rnd.bytes_received,
                                time.perf_counter() - started, partial)

    def _check_call(self, group: Group, vector: torch.Tensor, weight: float) -> int:
        if group.run_id != self.run_id:
            raise LocalProtocolError("the group is for another run than this averager's")
        if not self._started:
            raise LocalProtocolError("Averager.start() was not called")
        try:
            me = group.members.index(self.identity.public_key)
        except ValueError:
            raise LocalProtocolError("this peer is not a member of the group") from None
        if len(group.weights) != len(group.members):
            raise LocalProtocolError("the group has as many weights as members")
        if not isinstance(vector, torch.Tensor) or vector.numel() != group.numel or not vector.is_floating_point():
            raise LocalProtocolError(f"vector must be a float tensor of {group.numel} elements")
        if weight != group.weights[me]:
            raise LocalProtocolError(f"weight {weight} is not this member's weight in the group ({group.weights[me]})")
        if not sum(group.weights) > 0:
            raise LocalProtocolError("the group's weights must have a positive sum")
        return me

    async def _wait(self, rnd: _Round, done: Any, deadline: float) -> None:
        loop = asyncio.get_running_loop()
        while not done():
            remaining = deadline - loop.time()
            if remaining <= 0:
                return
            rnd.changed.clear()  # nothing can arrive between done() and here: no await
            try:
                await asyncio.wait_for(rnd.changed.wait(), remaining)
            except asyncio.TimeoutError:
                return

    async def _deliver(self, rnd: _Round, j: int, frames: list[list[Any]], deadline: float, sent: list[int],
                       drop_on_failure: bool) -> None:
        """Send frames to member j by ``deadline``. A reducer we cannot reach will not reduce
        our slice nor send us its part: drop it at once rather than wait for it."""
        remaining = deadline - asyncio.get_running_loop().time()
        try:
            if remaining <= 0:
                raise asyncio.TimeoutError
            nbytes = await asyncio.wait_for(self._send_frames(rnd.peer_ids[j], frames), remaining)
            sent[0] += nbytes  # not ``sent[0] += await ...``: that reads sent[0] before the await
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001  (any failure to reach a peer is that peer's problem)
            reason = "timeout" if isinstance(e, asyncio.TimeoutError) else f"unreachable:{type(e).__name__}"
            log.info("send failed reason=%s peer=%s detail=%s", reason, rnd.peer_ids[j], e)
            if drop_on_failure:
                rnd.drop(j, reason)
