"""State sync: a peer that joins late or resumes after a pause downloads the run's global state.

What is synced
--------------
The *global state* of a run is what peers that averaged together hold bit for bit once the last
fragment lands a round: for each fragment p, ``global/<p>`` (its fp32 flat global copy,
``OuterFragment.global_flat``) and ``outer_momentum/<p>`` (the outer SGD momentum buffer, absent
until the first outer step), plus ``rounds`` (completed rounds per fragment) and ``step``. The
inner AdamW moments and the local weights are *not* part of it: ``apply`` sets the local weights
to the global copy (a merge with alpha = 0) and leaves the inner optimizer alone.

Format (``FORMAT``)
-------------------
A donor serializes the tensors into one byte string, the *blob*::

    header_len (u32, big-endian) || header || zero padding to a multiple of 8 || data

where ``header`` is the msgpack array ``[[name, numel], ...]`` sorted by name, and ``data`` holds
each tensor's elements as little-endian fp32, back to back in header order. Every tensor is 1-D.
Nothing in it varies between peers holding equal tensors (no timestamps, no library versions),
so equal states give equal blobs on every machine.

The blob is cut into chunks of ``chunk_bytes`` (the last one shorter); the ``StateIndex`` message
lists ``step``, ``rounds``, the format, the sizes and the SHA-256 of every chunk. The SHA-256 of
the encoded index is the state's *digest*: what ``Heartbeat.state_digest`` vouches for. Because
the index is canonical msgpack of canonical content, peers with equal states vouch for the same
digest. ``chunk_bytes`` is raised (deterministically) when the state would need more than
``MAX_STATE_CHUNKS`` chunks, so all peers still agree.

Wire
----
One libp2p stream protocol per run, ``swarmstream.state.<run_id hex>``. A stream is a *session*:
the joiner sends requests one at a time and reads each reply before the next; every message is a
signed envelope (``protocol.envelope``) in a frame of ``u32 big-endian length || bytes``. The
length is checked against a limit before anything is read (requests: ``MAX_REQUEST_BYTES``; an
index: ``MAX_HEAD_BYTES`` plus envelope overhead; a chunk: the index's ``chunk_bytes`` plus
overhead), and every read and write has a deadline.

Donor: ``peer.state_server.StateServer`` (publishing, serving, what it keeps).

Joiner (``fetch_state``)
------------------------
1. Ask donors in turn for the index until one answers with an index whose digest is the vouched
   one (the index is then exactly what the vouchers announced, chunk digests included).
2. ``parallel`` tasks download chunks; task k starts at donor k mod n (round-robin over donors),
   keeps one session open, and takes the next chunk from a shared queue.
3. Each ``StateChunk`` is checked: envelope signature, run, signer = the stream's peer, the
   index digest and chunk number asked for, its length, and the SHA-256 of its payload against
   the index. A chunk that fails (bad data, refusal, no answer within ``chunk_timeout_s``,
   broken stream) goes back to the queue, and its donor is not asked again during this fetch.
   A busy donor is retried after a backoff (0.2 s, doubling, at most ``chunk_timeout_s``) while
   other donors carry on; after ``MAX_BUSY_RETRIES`` busy answers in a row it is dropped too.
   A donor that is busy because it already serves *us* on other sessions (``parallel`` above
   its ``max_concurrent``) is not held against it: the surplus task hands its chunk back and
   ends, and the sessions it allows carry on.
4. When every donor is dropped, ``StateSyncError`` says which chunk was left and why each
   donor failed; the caller may pick a fresh digest from heartbeats and try again.
5. The assembled blob is parsed (names, sizes and padding checked) into a ``GlobalState``.

Tuning: raise ``parallel`` on fast links with many donors; raise ``chunk_timeout_s`` if donors are
dropped for timeouts on slow links (a chunk must arrive within it: chunk_bytes / bandwidth plus
latency); raise a donor's ``max_concurrent`` if joiners see many busy answers.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from hivemind.p2p import P2P, P2PDaemonError, P2PHandlerError, PeerID

from protocol.envelope import seal_parts, verify
from protocol.errors import RemoteProtocolError
from protocol.identity import Identity
from protocol.messages import MAX_HEAD_BYTES, Message
from protocol.messages import digest as sha256
from protocol.messages_swarm import Rejected, RequestStateChunk, RequestStateIndex, StateChunk, StateIndex

from peer.globalstate import (  # noqa: F401  (re-exported: the state and its format live there)
    FORMAT, MAX_CHUNK_BYTES, GlobalState, PackedState, StateSyncError, apply, choose_digest, decode_state, encode_state,
    index_digest, index_packed, pack_state, packed_blob, snapshot,
)
from peer.state_server import ServerStats, StateServer  # noqa: F401  (re-exported: the donor)
from peer.statewire import (  # noqa: F401  (handler_name re-exported)
    ENVELOPE_OVERHEAD, Refused, close_writer, handler_name, read_frame, short_id, write_frame,
)

log = logging.getLogger(__name__)

MAX_BUSY_RETRIES = 5
"""Busy answers in a row after which a donor is dropped from a fetch."""


class _DonorFailed(Exception):
    """This donor cannot be used for the rest of the fetch; the message says why."""


class _Busy(Exception):
    """The donor serves as many joiners as it will; try again later."""


class _Session:
    """One stream to a donor: requests one at a time, every reply verified."""

    def __init__(self, donor: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.donor, self.reader, self.writer = donor, reader, writer

    @classmethod
    async def open(cls, p2p: P2P, donor: str, name: str, timeout_s: float) -> _Session:
        try:
            async with asyncio.timeout(timeout_s):
                _, reader, writer = await p2p.call_binary_stream_handler(PeerID.from_base58(donor), name)
        except TimeoutError:
            raise _DonorFailed(f"no stream within {timeout_s:g} s") from None
        except (P2PDaemonError, P2PHandlerError, OSError, asyncio.IncompleteReadError) as e:
            raise _DonorFailed(f"cannot open a stream ({e})") from None
        return cls(donor, reader, writer)

    async def ask(self, request: Message, identity: Identity, expect: type, *, limit: int, timeout_s: float) -> Any:
        """Send ``request``; the verified reply of type ``expect``. Raises _Busy or _DonorFailed."""
        try:
            async with asyncio.timeout(timeout_s):
                await write_frame(self.writer, seal_parts(request, identity))
                data = await read_frame(self.reader, limit)
            v = verify(data, expect=(expect, Rejected), run_id=request.run_id, sender=self.donor)
        except TimeoutError:
            raise _DonorFailed(f"no answer within {timeout_s:g} s") from None
        except (asyncio.IncompleteReadError, ConnectionError, OSError) as e:
            raise _DonorFailed(f"the stream broke ({type(e).__name__})") from None
        except RemoteProtocolError as e:
            raise _DonorFailed(f"broke the protocol: {e}") from None
        if isinstance(v.message, Rejected):
            if v.message.code == "busy":
                raise _Busy(v.message.detail)
            raise _DonorFailed(str(Refused(v.message.code, v.message.detail)))
        return v

    def close(self) -> None:
        close_writer(self.writer)


@dataclass(slots=True)
class FetchStats:
    """What a ``fetch_state`` did, per donor (peer ID)."""

    chunks: dict[str, int] = field(default_factory=dict)
    """Verified chunks received from each donor."""
    bytes: dict[str, int] = field(default_factory=dict)
    busy: dict[str, int] = field(default_factory=dict)
    """Busy answers from each donor."""
    dropped: dict[str, str] = field(default_factory=dict)
    """Donors given up on, and why."""
    index_from: str = ""


@dataclass(slots=True)
class _Donor:
    peer_id: str
    busy_in_a_row: int = 0
    busy_until: float = 0.0


class _Donors:
    """Which donors are still usable, which are busy until when, and why others were dropped."""

    def __init__(self, peer_ids: list[str], stats: FetchStats, chunk_timeout_s: float):
        self.order = [_Donor(p) for p in peer_ids]
        self.stats, self.chunk_timeout_s = stats, chunk_timeout_s

    def drop(self, donor: str, reason: str) -> None:
        if donor not in self.stats.dropped:
            self.stats.dropped[donor] = reason
            log.info("state donor dropped peer=%s reason=%s", donor, reason)

    def busy(self, donor: str) -> None:
        d = next(d for d in self.order if d.peer_id == donor)
        d.busy_in_a_row += 1
        self.stats.busy[donor] = self.stats.busy.get(donor, 0) + 1
        if d.busy_in_a_row > MAX_BUSY_RETRIES:
            self.drop(donor, f"busy {d.busy_in_a_row} times in a row")
        d.busy_until = time.monotonic() + min(self.chunk_timeout_s, 0.2 * 2 ** (d.busy_in_a_row - 1))

    def served(self, donor: str) -> None:
        next(d for d in self.order if d.peer_id == donor).busy_in_a_row = 0

    async def pick(self, start: int) -> str | None:
        """The first usable donor from position ``start`` on (round-robin), waiting out backoffs
        when all usable ones are busy; None when every donor has been dropped."""
        n = len(self.order)
        while True:
            alive = [self.order[(start + j) % n] for j in range(n)]
            alive = [d for d in alive if d.peer_id not in self.stats.dropped]
            if not alive:
                return None
            now = time.monotonic()
            ready = [d for d in alive if d.busy_until <= now]
            if ready:
                return ready[0].peer_id
            await asyncio.sleep(min(d.busy_until for d in alive) - now)  # a backoff, bounded by chunk_timeout_s

    def summary(self) -> str:
        return "; ".join(f"{short_id(p)}: {r}" for p, r in self.stats.dropped.items())


async def current_indexes(p2p: P2P, identity: Identity, run_id: bytes, donors: list[str], *,
                          timeout_s: float) -> dict[str, tuple[bytes, StateIndex]]:
    """Ask each donor, concurrently, for the index of the state it serves now: peer ID ->
    (digest, index), for the donors that answered with a valid signed index in time.

    Heartbeats vouch for a digest with a delay of up to one heartbeat interval (and are read
    up to one more interval late), and a donor keeps the state before its latest only while a
    download may be of it; in a swarm whose rounds are shorter than that, the vouched digest is
    often gone. The signed indexes the donors return are announcements
    too, so a digest served by two or more of them is as well vouched for."""
    name = handler_name(run_id)

    async def ask(donor: str) -> tuple[str, tuple[bytes, StateIndex] | None]:
        session = None
        try:
            # the stream and the answer within timeout_s together: one donor slow at both used
            # to hold the poll for twice that, past its caller's budget, and failed the download
            async with asyncio.timeout(timeout_s):
                session = await _Session.open(p2p, donor, name, timeout_s)
                v = await session.ask(RequestStateIndex(run_id=run_id), identity, StateIndex,
                                      limit=MAX_HEAD_BYTES + ENVELOPE_OVERHEAD, timeout_s=timeout_s)
            return donor, (sha256(v.body), v.message)
        except (_Busy, _DonorFailed, TimeoutError) as e:
            log.info("no state index from donor peer=%s reason=%s", short_id(donor), e or "no answer in time")
            return donor, None
        finally:
            if session is not None:
                session.close()

    answers = await asyncio.gather(*(ask(d) for d in dict.fromkeys(donors)))  # at most timeout_s
    return {d: a for d, a in answers if a is not None}


async def fetch_state(p2p: P2P, identity: Identity, run_id: bytes, donors: list[str], digest: bytes, *,
                      chunk_timeout_s: float, parallel: int = 4, progress: Callable[[int, int], None] | None = None,
                      stats: FetchStats | None = None, max_bytes: int | None = None) -> GlobalState:
    """Download and check the state with digest ``digest`` from ``donors`` (peer IDs that vouch
    for it); see the module docstring. ``stats``, if given, is filled in as the fetch goes.
    ``max_bytes``: the largest state that can fit our model (``globalstate.max_state_bytes``);
    an index declaring more is refused before anything is allocated for it.
    Raises StateSyncError when no donor can provide some part in time."""
    stats = stats if stats is not None else FetchStats()
    peers = list(dict.fromkeys(donors))
    if not peers:
        raise StateSyncError("no donors to fetch the state from; wait for peers that vouch for one")
    if parallel < 1:
        raise ValueError(f"parallel must be >= 1, got {parallel}")
    if len(digest) != 32:
        raise ValueError(f"a state digest is 32 bytes, got {len(digest)}")
    pool = _Donors(peers, stats, chunk_timeout_s)
    name = handler_name(run_id)
    want = digest.hex()[:12]

    # 1. the index, from the first donor that serves the vouched one
    index: StateIndex | None = None
    while index is None:
        donor = await pool.pick(0)
        if donor is None:
            raise StateSyncError(f"none of the {len(peers)} donors served the index of state {want} "
                                 f"({pool.summary()}); the swarm may have moved on, pick a fresh digest")
        session = None
        try:
            session = await _Session.open(p2p, donor, name, chunk_timeout_s)
            v = await session.ask(RequestStateIndex(run_id=run_id), identity, StateIndex,
                                  limit=MAX_HEAD_BYTES + ENVELOPE_OVERHEAD, timeout_s=chunk_timeout_s)
        except _Busy:
            pool.busy(donor)
            continue
        except _DonorFailed as e:
            pool.drop(donor, f"index: {e}")
            continue
        finally:
            if session is not None:
                session.close()
        if sha256(v.body) != digest:
            pool.drop(donor, f"serves state {sha256(v.body).hex()[:12]}, not {want}")
            continue
        if v.message.chunk_bytes > MAX_CHUNK_BYTES:
            pool.drop(donor, f"index has chunks of {v.message.chunk_bytes} bytes (over {MAX_CHUNK_BYTES})")
            continue
        if max_bytes is not None and v.message.total_bytes > max_bytes:
            pool.drop(donor, f"index declares {v.message.total_bytes} bytes, more than a state of this model "
                             f"takes ({max_bytes})")
            continue
        index = v.message
        stats.index_from = donor
        pool.served(donor)
    total, size, count = index.total_bytes, index.chunk_bytes, len(index.chunk_digests)
    log.info("state fetch started digest=%s bytes=%d chunks=%d donors=%d", want, total, count, len(peers))

    # 2. the chunks, from all donors at once
    try:
        blob = bytearray(total)
    except MemoryError:
        raise StateSyncError(f"not enough memory for a state of {total} bytes (digest {want})") from None
    todo: asyncio.Queue[int] = asyncio.Queue()
    for i in range(count):
        todo.put_nowait(i)
    done = {"chunks": 0, "bytes": 0}
    finished: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    if progress is not None:
        progress(0, total)
    if count == 0:
        finished.set_result(None)

    opened: dict[str, int] = {}  # donor -> our sessions open to it now
    alive = {"tasks": min(parallel, count)}  # download tasks that have not stepped aside

    async def download(k: int) -> None:
        donor: str | None = None
        session: _Session | None = None
        def close() -> None:
            nonlocal session
            if session is not None:
                session.close()
                session = None
                opened[donor] -= 1

        try:
            while True:
                i = await todo.get()
                length = min(size, total - i * size)
                while True:
                    if donor is None or donor in stats.dropped:
                        close()
                        donor = await pool.pick(k)
                        if donor is None:
                            if not finished.done():
                                finished.set_exception(StateSyncError(
                                    f"no donor could serve chunk {i} of state {want} ({pool.summary()}); "
                                    "try again with a fresh digest"))
                            return
                    try:
                        if session is None:
                            session = await _Session.open(p2p, donor, name, chunk_timeout_s)
                            opened[donor] = opened.get(donor, 0) + 1
                        v = await session.ask(RequestStateChunk(run_id=run_id, index_digest=digest, chunk=i),
                                              identity, StateChunk, limit=size + ENVELOPE_OVERHEAD,
                                              timeout_s=chunk_timeout_s)
                        got = v.message
                        if got.index_digest != digest or got.chunk != i:
                            raise _DonorFailed(f"answered chunk {got.chunk} of {got.index_digest.hex()[:12]} "
                                               f"to a request for chunk {i} of {want}")
                        if len(got.payload) != length or v.payload_digest != index.chunk_digests[i]:
                            raise _DonorFailed("does not match the index (bad data)")
                    except _Busy:
                        if opened.get(donor, 0) > 1 and alive["tasks"] > 1:
                            # our other sessions fill its slots: this task is one too many for it,
                            # not a sign of trouble. Hand the chunk back and step aside.
                            close()
                            todo.put_nowait(i)
                            alive["tasks"] -= 1
                            return
                        close()
                        pool.busy(donor)
                        donor = None
                        continue
                    except _DonorFailed as e:
                        close()
                        pool.drop(donor, f"chunk {i}: {e}")
                        donor = None
                        continue
                    blob[i * size:i * size + length] = got.payload
                    pool.served(donor)
                    stats.chunks[donor] = stats.chunks.get(donor, 0) + 1
                    stats.bytes[donor] = stats.bytes.get(donor, 0) + length
                    done["chunks"] += 1
                    done["bytes"] += length
                    if progress is not None:
                        progress(done["bytes"], total)
                    if done["chunks"] == count and not finished.done():
                        finished.set_result(None)
                    break
        except Exception as e:  # noqa: BLE001  (a bug, or the progress callback failed: end the fetch, don't hang)
            if not finished.done():
                finished.set_exception(e)
        finally:
            close()

    tasks = [asyncio.create_task(download(k)) for k in range(min(parallel, count))]
    try:
        await finished
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    log.info("state fetch done digest=%s chunks_by_donor=%s", want,
             {short_id(p): c for p, c in stats.chunks.items()})
    return decode_state(index, blob)
