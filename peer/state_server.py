"""A donor of state sync: serves the run's global state to joiners (``peer.statesync``).

Donor (``StateServer``)
-----------------------
``publish`` keeps a snapshot as the current state, and the one before it as the previous
while a download may be of it (a session is open, or a joiner asked for it within
``idle_timeout_s``), so a download that started just before a round landed still completes.
Nothing is copied: chunks are read where the tensors lie (``pack_state``), and a node
publishes the worker's own tensors, which its fragments copy on write (``OuterFragment.share``):
serving costs no memory beyond the swarm state itself (2x the fp32 model) but, while the
previous state is kept, the fragment that changed. A node uses ``publish_packed``: chunks are
hashed in a worker thread, so the event loop that averages never waits on a large state, and
only chunks that differ from the state served now are hashed (a landing changes one
fragment). It answers ``RequestStateIndex`` with the current index and ``RequestStateChunk`` for either state; an
unknown digest or chunk gets ``Rejected("not_found")``. At most ``max_concurrent`` sessions are
served at once, at most ``max_per_peer`` of them to one peer (a joiner's surplus tasks step
aside: ``peer.statesync``); a session beyond that gets ``Rejected("busy")`` to its first
request and is closed. (So one key that keeps sessions open with a request now and then
holds one slot, not every slot: it takes ``max_concurrent`` keys to keep a donor busy.) A
session idle for ``idle_timeout_s`` is closed. A request that fails verification (bad
signature, other run, signer other than the stream's peer) gets ``bad_request`` /
``unknown_run`` and the session ends.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

from hivemind.p2p import P2P, P2PDaemonError

from peer.globalstate import MAX_CHUNK_BYTES, GlobalState, PackedState, index_digest, index_packed, pack_state, packed_blob
from peer.statewire import MAX_REQUEST_BYTES, close_writer, handler_name, read_frame, write_frame
from protocol.envelope import seal, seal_parts, verify
from protocol.errors import RemoteProtocolError
from protocol.identity import Identity
from protocol.messages import Message
from protocol.messages_swarm import Rejected, RequestStateChunk, RequestStateIndex, StateChunk, StateIndex

log = logging.getLogger("peer.statesync")  # one logger for both sides of state sync


@dataclass(slots=True)
class _Published:
    digest: bytes
    index: StateIndex
    packed: PackedState
    """Never changed once published (chunks are served as views into it where they can be)."""
    sealed_index: bytes
    asked_at: float = -math.inf
    """When a joiner last asked for its index or a chunk of it (time.monotonic)."""


@dataclass(slots=True)
class ServerStats:
    sessions: int = 0
    chunks_served: int = 0
    bytes_served: int = 0
    busy: int = 0
    """Sessions refused because ``max_concurrent`` were being served."""
    bad_requests: int = 0


class StateServer:
    """Serves the current (and previous) global state to joiners; see the module docstring."""

    def __init__(self, p2p: P2P, identity: Identity, run_id: bytes, *, chunk_bytes: int, max_concurrent: int = 2,
                 max_per_peer: int = 1, idle_timeout_s: float = 30.0, send_timeout_s: float = 60.0):
        if not 1 <= chunk_bytes <= MAX_CHUNK_BYTES:
            raise ValueError(f"chunk_bytes must be in 1..{MAX_CHUNK_BYTES}, got {chunk_bytes}")
        if max_concurrent < 0:
            raise ValueError(f"max_concurrent must be >= 0, got {max_concurrent}")
        self.p2p, self.identity, self.run_id = p2p, identity, run_id
        self.chunk_bytes, self.max_concurrent, self.max_per_peer = chunk_bytes, max_concurrent, max_per_peer
        self.idle_timeout_s, self.send_timeout_s = idle_timeout_s, send_timeout_s
        self.name = handler_name(run_id)
        self.stats = ServerStats()
        self.corrupt_chunks: set[int] = set()
        """Test only: chunk numbers served with one bit flipped (a donor with bad data)."""
        self.stall_chunks: set[int] = set()
        """Test only: chunk numbers never answered (a donor that hangs); the session ends when
        the joiner hangs up, or after ``idle_timeout_s``."""
        self._current: _Published | None = None
        self._previous: _Published | None = None
        self._publish_order = asyncio.Lock()
        self._active = 0
        self._sessions: Counter[str] = Counter()  # peer ID -> its sessions open now
        self._tasks: set[asyncio.Task] = set()
        self._closing = False

    @property
    def digest(self) -> bytes:
        """Digest of the current state, b"" before the first ``publish``."""
        return self._current.digest if self._current else b""

    async def start(self) -> None:
        await self.p2p.add_binary_stream_handler(self.name, self._handle)

    async def publish(self, state: GlobalState) -> bytes:
        """Serve ``state`` from now on; returns its digest. Hashes on the calling loop: a node
        uses ``publish_packed``."""
        packed = pack_state(state)
        return self._publish(index_packed(packed, self.run_id, self.chunk_bytes, self._reuse()), packed)

    async def publish_packed(self, packed: PackedState) -> bytes:
        """``publish`` for a state packed where it cannot change (``pack_state`` of a shared
        ``snapshot``): its chunks are hashed in a worker thread, so the event loop (this node's
        averaging) never waits on them, and only the chunks that differ from the state served
        now are hashed (a landing changes one fragment). Publishes in the order called."""
        async with self._publish_order:
            index = await asyncio.to_thread(index_packed, packed, self.run_id, self.chunk_bytes, self._reuse())
            return self._publish(index, packed)

    def publish_encoded(self, index: StateIndex, blob: bytearray | memoryview) -> bytes:
        """``publish`` for a state already encoded by ``encode_state`` (call on the loop)."""
        if index.run_id != self.run_id or len(blob) != index.total_bytes:
            raise ValueError("the encoded state belongs to another run or does not match its index")
        return self._publish(index, packed_blob(blob, index.rounds, index.step))

    def _wanted(self, pub: _Published) -> bool:
        """A download may be of ``pub``: a session is open, or a joiner asked for it lately (a
        joiner reads the index on one session, then opens others for the chunks)."""
        return self._active > 0 or time.monotonic() - pub.asked_at < self.idle_timeout_s

    def _reuse(self) -> tuple[PackedState, StateIndex] | None:
        return None if self._current is None else (self._current.packed, self._current.index)

    def _publish(self, index: StateIndex, packed: PackedState) -> bytes:
        d = index_digest(index)
        if self._current is None or self._current.digest != d:
            # the state before stays served while a download may be of it; else it is let go
            # (the fragment that changed is the only memory it holds beyond the current one)
            self._previous = self._current if self._current is not None and self._wanted(self._current) else None
            self._current = _Published(d, index, packed, seal(index, self.identity))
            log.info("state published digest=%s bytes=%d chunks=%d step=%d", d.hex()[:12], index.total_bytes,
                     len(index.chunk_digests), index.step)
        return d

    @property
    def serving(self) -> bool:
        """Whether a peer is downloading from us now (a session is open)."""
        return self._active > 0

    async def shutdown(self) -> None:
        self._closing = True
        try:
            await self.p2p.remove_binary_stream_handler(self.name)
        except (P2PDaemonError, OSError, asyncio.IncompleteReadError) as e:  # the daemon may be gone already
            log.debug("state handler removal failed reason=%r", e)
        tasks = [t for t in self._tasks if t is not asyncio.current_task()]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def _reject(self, request: int, code: str, detail: str) -> list[Any]:
        return seal_parts(Rejected(run_id=self.run_id, request=request, code=code, detail=detail[:256]),
                          self.identity)

    async def _handle(self, info: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = info.peer_id.to_base58()
        task = asyncio.current_task()
        if task is not None:
            self._tasks.add(task)
        serving = False
        try:
            # a peer holds at most max_per_peer of the slots: one key keeping sessions open
            # (a request now and then) used to hold them all, and nobody could download from us
            full = self._active >= self.max_concurrent or self._sessions[peer] >= self.max_per_peer
            if self._closing or full:
                code = "shutting_down" if self._closing else "busy"
                if code == "busy":
                    self.stats.busy += 1
                async with asyncio.timeout(self.idle_timeout_s):
                    data = await read_frame(reader, MAX_REQUEST_BYTES)
                    v = verify(data, expect=(RequestStateIndex, RequestStateChunk), run_id=self.run_id, sender=peer)
                    await write_frame(writer, self._reject(int(v.message.TAG), code,
                                                            f"{self._active} downloads in progress"))
                return
            self._active += 1
            self._sessions[peer] += 1
            serving = True
            self.stats.sessions += 1
            await self._serve(peer, reader, writer)
        except (asyncio.IncompleteReadError, ConnectionError, TimeoutError, asyncio.CancelledError) as e:
            # the joiner hung up, went silent, or we are shutting down: the session just ends
            log.debug("state session ended peer=%s reason=%r", peer, e)
        except RemoteProtocolError as e:
            self.stats.bad_requests += 1
            log.info("state request refused peer=%s reason=%s", peer, e)
        finally:
            if serving:
                self._active -= 1
                self._sessions[peer] -= 1
                if not self._sessions[peer]:
                    del self._sessions[peer]
                if self._previous is not None and not self._wanted(self._previous):
                    self._previous = None  # nobody downloads it
            if task is not None:
                self._tasks.discard(task)
            close_writer(writer)

    async def _serve(self, peer: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            async with asyncio.timeout(self.idle_timeout_s):
                data = await read_frame(reader, MAX_REQUEST_BYTES)
            try:
                msg = verify(data, expect=(RequestStateIndex, RequestStateChunk), sender=peer).message
            except RemoteProtocolError as e:  # counted and logged by _handle
                async with asyncio.timeout(self.send_timeout_s):
                    await write_frame(writer, self._reject(0, "bad_request", str(e)))
                raise
            if msg.run_id != self.run_id:
                self.stats.bad_requests += 1
                async with asyncio.timeout(self.send_timeout_s):
                    await write_frame(writer, self._reject(int(msg.TAG), "unknown_run",
                                                            "this peer serves another run"))
                return
            if isinstance(msg, RequestStateChunk) and msg.chunk in self.stall_chunks:
                async with asyncio.timeout(self.idle_timeout_s):
                    await reader.read()  # no answer; the session ends when the joiner gives up
                return
            async with asyncio.timeout(self.send_timeout_s):
                await write_frame(writer, self._answer(msg))

    def _answer(self, msg: Message) -> list[Any]:
        if isinstance(msg, RequestStateIndex):
            if self._current is None:
                return self._reject(int(msg.TAG), "not_found", "no state published yet")
            self._current.asked_at = time.monotonic()
            return [self._current.sealed_index]
        assert isinstance(msg, RequestStateChunk)
        pub = next((p for p in (self._current, self._previous) if p is not None and p.digest == msg.index_digest),
                   None)
        if pub is None:
            return self._reject(int(msg.TAG), "not_found", f"state {msg.index_digest.hex()[:12]} is not held here")
        pub.asked_at = time.monotonic()
        count = len(pub.index.chunk_digests)
        if msg.chunk >= count:
            return self._reject(int(msg.TAG), "not_found", f"chunk {msg.chunk} of a state of {count} chunks")
        size = pub.index.chunk_bytes
        payload: bytes | bytearray | memoryview = pub.packed.read(msg.chunk * size, (msg.chunk + 1) * size)
        if msg.chunk in self.corrupt_chunks:
            payload = bytearray(payload)
            payload[0] ^= 1
        self.stats.chunks_served += 1
        self.stats.bytes_served += len(payload)
        return seal_parts(StateChunk(run_id=self.run_id, index_digest=pub.digest, chunk=msg.chunk, payload=payload),
                          self.identity)
