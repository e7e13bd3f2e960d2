"""The averager's inbound side without a network: framing limits, streams per peer, and the
bounded buffer of frames for groups this member has not started yet (peer.inbox)."""

import asyncio

import pytest

from peer.allreduce import Averager, chunk_elements
from peer.inbox import ITEM_OVERHEAD, FrameTooLarge, PendingFrames, StreamEnded, read_frame
from peer.outbox import ACK, MAX_UNREAD_ACKS
from protocol.envelope import seal
from protocol.identity import Identity
from protocol.messages_swarm import PushSlice

RUN_ID = b"\x07" * 20
SENDER = Identity.from_seed(b"\x01" * 32)


class FakeP2P:
    async def add_binary_stream_handler(self, name, handler):
        self.handler = handler

    async def remove_binary_stream_handler(self, name):
        pass


def frame(group_id: bytes, numel: int = 256, run_id: bytes = RUN_ID, signer: Identity = SENDER,
          stopping: bool = False) -> bytes:
    msg = PushSlice(run_id=run_id, fragment=0, round=1, group_id=group_id, part=0, offset=0, numel=numel,
                    shape=(numel,), dtype="float32", codec="fp32", weight=1.0, stopping=stopping,
                    payload=bytes(4 * numel))
    return seal(msg, signer)


def averager(**kw) -> Averager:
    av = Averager(FakeP2P(), Identity.from_seed(b"\x02" * 32), RUN_ID, max_frame_bytes=8192, **kw)
    asyncio.run(av.start())
    return av


def test_frames_are_length_checked_before_the_body_is_read():
    async def main():
        r = asyncio.StreamReader()
        r.feed_data((1 << 40).to_bytes(8, "big"))  # announces a terabyte, sends nothing more
        with pytest.raises(FrameTooLarge):
            await read_frame(r, 8192, timeout=1)
        r = asyncio.StreamReader()
        r.feed_data((3).to_bytes(8, "big") + b"abc")
        r.feed_eof()
        assert await read_frame(r, 8192, timeout=1) == b"abc"
        assert await read_frame(r, 8192, timeout=1) is None  # a clean end of stream
        r = asyncio.StreamReader()
        r.feed_data((5).to_bytes(8, "big") + b"ab")
        with pytest.raises(asyncio.TimeoutError):  # a stalled sender does not hold us forever
            await read_frame(r, 8192, timeout=0.05)

    asyncio.run(main())


def test_chunks_fit_a_frame_and_keep_codec_blocks_whole():
    n = chunk_elements(8192)
    assert n % 256 == 0 and n > 0 and len(frame(b"g" * 16, numel=n)) + 8 <= 8192


def test_early_frames_are_bounded_by_groups_and_bytes():
    size = 8 + len(frame(b"x" * 16)) + ITEM_OVERHEAD  # 8: the length prefix
    av = averager(max_pending_groups=2, max_pending_bytes=3 * size, max_pending_groups_per_peer=3,
                  max_pending_bytes_per_peer=3 * size)
    peer = SENDER.peer_id
    for g in (b"a", b"b", b"c"):  # three groups: the oldest is evicted
        av._on_frame(peer, frame(g * 16))
    assert av.pending.groups() == [b"b" * 16, b"c" * 16]
    for _ in range(3):  # the byte budget allows one more frame, not three
        av._on_frame(peer, frame(b"c" * 16))
    assert av.pending.nbytes <= 3 * size
    assert len(av.pending.items(b"c" * 16)) == 2


def test_a_peers_frames_for_a_new_group_evict_its_own_oldest_groups_not_the_new_frames():
    """A peer whose earlier groups never started here (we did not follow its record, or we
    suspended it) still gets its frames for the group we start next buffered: its own oldest
    frames give way, and only its own (they used to be dropped until those expired, and that
    round waited for it until the push deadline)."""
    size = 8 + len(frame(b"x" * 16)) + ITEM_OVERHEAD
    av = averager()  # 2 of 8 groups per peer, a quarter of the bytes
    other, peer = SENDER, Identity.from_seed(b"\x0b" * 32)
    av._on_frame(other.peer_id, frame(b"o" * 16))
    av._on_frame(peer.peer_id, frame(b"o" * 16, signer=peer))  # also in the other peer's group
    av._on_frame(peer.peer_id, frame(b"p" * 16, signer=peer))  # a group nobody else is in
    av._on_frame(peer.peer_id, frame(b"r" * 16, signer=peer))  # the group we will start
    assert [p for p, *_ in av.pending.items(b"o" * 16)] == [other.peer_id]  # the other peer's frame stays
    assert av.pending.groups() == [b"o" * 16, b"p" * 16, b"r" * 16]
    av._on_frame(peer.peer_id, frame(b"s" * 16, signer=peer))
    assert av.pending.groups() == [b"o" * 16, b"r" * 16, b"s" * 16]
    assert av.pending.peer_bytes(peer.peer_id) == 2 * size and av.pending.peer_bytes(other.peer_id) == size


def test_one_flooding_peer_cannot_crowd_out_an_honest_peers_early_frames():
    """A validly signed peer sends frames for many groups that do not exist: it gets its share
    of the buffer (2 of 8 groups, a quarter of the bytes: the defaults) and the honest peer's
    early frames stay."""
    size = 8 + len(frame(b"x" * 16)) + ITEM_OVERHEAD
    av = averager()
    honest, liar = SENDER, Identity.from_seed(b"\x09" * 32)
    av._on_frame(honest.peer_id, frame(b"h" * 16))
    for k in range(50):
        av._on_frame(liar.peer_id, frame(bytes([k]) * 16, signer=liar))
        av._on_frame(liar.peer_id, frame(b"h" * 16, signer=liar))  # also into the honest peer's group
    assert b"h" * 16 in av.pending.groups() and av.pending.peer_bytes(honest.peer_id) == size
    liars = [g for g in av.pending.groups() if liar.peer_id in {p for p, *_ in av.pending.items(g)}]
    assert len(liars) <= 2 and len(av.pending.groups()) <= 3  # the honest peer's group, and the liar's share
    assert 0 < av.pending.peer_bytes(liar.peer_id) <= av.pending.max_bytes // 4
    av._on_frame(honest.peer_id, frame(b"i" * 16))  # honest frames still find room
    assert av.pending.peer_bytes(honest.peer_id) == 2 * size


class Info:
    def __init__(self, ident: Identity):
        from hivemind.p2p import PeerID

        self.peer_id = PeerID.from_base58(ident.peer_id)


class Writer:
    """The stream's way back: the acknowledgements written (nobody reads them here)."""

    def __init__(self, unread: int = 0):
        self.closed, self.acks, self.unread = False, b"", unread
        self.transport = self

    def write(self, data: bytes) -> None:
        self.acks += data

    def get_write_buffer_size(self) -> int:
        return self.unread + len(self.acks)

    def close(self):
        self.closed = True


def test_a_peer_gets_a_bounded_number_of_streams_and_a_stream_that_ends_releases_its_slot():
    av = averager(max_streams_per_peer=2)
    liar, other = Identity.from_seed(b"\x09" * 32), Identity.from_seed(b"\x0a" * 32)

    async def main():
        readers = [asyncio.StreamReader() for _ in range(3)]  # held open: nothing arrives
        writers = [Writer() for _ in readers]
        tasks = [asyncio.create_task(av._handle_stream(Info(liar), r, w)) for r, w in zip(readers, writers)]
        await asyncio.wait_for(tasks[2], 1)  # the first two hold their slots; the third is refused at once...
        assert writers[2].closed and not writers[0].closed and av._gate.streams(liar.peer_id) == 2
        r = asyncio.StreamReader()  # ...while another peer's stream is served
        data = frame(b"o" * 16, signer=other)
        r.feed_data(len(data).to_bytes(8, "big") + data)
        r.feed_eof()
        w = Writer()
        await asyncio.wait_for(av._handle_stream(Info(other), r, w), 1)
        assert w.acks == ACK  # the frame was read: acknowledged (peer.outbox)
        assert av.pending.peer_bytes(other.peer_id) == 8 + len(data) + 2 * ITEM_OVERHEAD  # the frame, its stream's end
        readers[0].feed_eof()  # a stream that ends frees its slot
        await asyncio.wait_for(tasks[0], 1)
        assert av._gate.streams(liar.peer_id) == 1
        readers[1].feed_eof()
        await asyncio.wait_for(tasks[1], 1)
        assert av._gate.streams(liar.peer_id) == 0

    asyncio.run(main())


def test_a_sender_that_does_not_read_its_acknowledgements_gets_its_stream_closed():
    """Each frame read is answered with a byte; a sender that never reads them would grow our
    write buffer without bound, so past MAX_UNREAD_ACKS its stream is closed."""
    av = averager()

    async def main():
        r = asyncio.StreamReader()
        for i in range(3):
            data = frame(bytes([i]) * 16)
            r.feed_data(len(data).to_bytes(8, "big") + data)
        w = Writer(unread=MAX_UNREAD_ACKS)  # what it left unread so far
        await asyncio.wait_for(av._handle_stream(Info(SENDER), r, w), 1)  # returns with frames left unread
        assert w.closed and w.acks == ACK and len(r._buffer) > 0

    asyncio.run(main())


def test_a_group_that_gave_way_to_a_newer_one_takes_no_more_of_its_frames():
    """A peer writing chunks of three groups in turn, with a share of two: its first group gives
    way to the third and stays out (its later chunks and its stream's end are refused), so it
    cannot come back partial, evict the next group in turn, and take a marker that would drop
    the sender as short when the round starts."""
    pending = PendingFrames(max_groups=8, max_bytes=1 << 20, max_groups_per_peer=2, max_bytes_per_peer=1 << 20,
                            ttl_s=60.0)
    groups = [bytes([k]) * 16 for k in range(3)]
    for chunk in range(3):
        for g in groups:
            pending.add(g, "p", ("chunk", chunk), 100)
        if chunk == 0:  # another peer's frames for 40 made-up groups do not make the memory forget p's
            for k in range(40):
                pending.add(b"x" + k.to_bytes(15, "big"), "x", ("junk", k), 10)
    for g in groups:
        pending.note(g, "p", StreamEnded(PushSlice))
    assert [g for g in pending.groups() if g in groups] == groups[1:]
    for g in groups[1:]:
        assert [item for _, item, *_ in pending.items(g)] == [("chunk", 0), ("chunk", 1), ("chunk", 2),
                                                              StreamEnded(PushSlice)]


def test_early_frames_expire_and_unverifiable_ones_are_never_buffered():
    av = averager(pending_ttl_s=0.0)
    peer = SENDER.peer_id
    av._on_frame(peer, frame(b"a" * 16))
    av._on_frame(peer, frame(b"b" * 16))  # by now the first one has expired
    assert av.pending.groups() == [b"b" * 16]
    av = averager()
    av._on_frame(peer, frame(b"a" * 16, run_id=b"\x08" * 20))  # another run
    av._on_frame(Identity.from_seed(b"\x03" * 32).peer_id, frame(b"b" * 16))  # not the stream's peer
    # a frame that does not verify is never buffered; its blame is, once per group and peer,
    # charged as a small item
    assert av.pending.nbytes == 2 * ITEM_OVERHEAD
    for _ in range(100):
        av._on_frame(peer, frame(b"a" * 16, run_id=b"\x08" * 20))
    assert av.pending.nbytes == 2 * ITEM_OVERHEAD


def test_how_long_early_frames_waited_counts_from_when_half_the_members_had_sent(monkeypatch):
    import peer.inbox
    from peer.inbox import PendingFrames

    now = [100.0]
    monkeypatch.setattr(peer.inbox.time, "monotonic", lambda: now[0])
    pending = PendingFrames(max_groups=4, max_bytes=1 << 20, max_groups_per_peer=4, max_bytes_per_peer=1 << 20,
                            ttl_s=60.0)
    gid, members = b"g" * 16, ["a", "b", "c"]
    assert pending.waited(gid, members) == 0.0  # nothing buffered: nobody waits for us
    pending.add(gid, "a", "frame", 10, waits=True)
    now[0] = 103.0
    assert pending.waited(gid, members) == 0.0  # one of three (a liar, say) decides nothing
    pending.add(gid, "z", "frame", 10, waits=True)  # not a member of the group
    assert pending.waited(gid, members) == 0.0
    pending.add(gid, "b", "frame", 10, waits=True)
    pending.add(gid, "b", "frame", 10, waits=True)  # its second frame changes nothing
    now[0] = 105.0
    assert pending.waited(gid, members) == 2.0  # since the second of three members sent
    assert pending.waited(gid, ["a", "b"]) == 5.0  # of two, since the first


def test_only_pushes_of_members_that_started_at_their_step_count_as_waiting_for_us():
    """A member that pauses or finishes starts its rounds before its step (``PushSlice.stopping``):
    its pushes, like a blame or a stream's end, say nothing about our pace. Otherwise an equal
    partner of a pausing member would take itself for the straggler and follow (peer.pace)."""
    av = averager()
    others = [Identity.from_seed(bytes([i]) * 32) for i in (3, 4)]
    ids = [o.peer_id for o in others]
    gid = b"s" * 16
    av._on_frame(ids[0], frame(gid, signer=others[0], stopping=True))
    av._on_frame(ids[1], frame(gid, signer=others[1], stopping=True))
    av._stream_ended(ids[0], {(gid, PushSlice, 0)})  # its stream ended: a note in the buffer
    av._blame(ids[1], gid, "bad")
    assert len(av.pending.items(gid)) == 4  # all kept for the round...
    assert not av.pending.started(gid, ids) and av.pending.waited(gid, ids) == 0.0  # ...none waits for us
    av._on_frame(ids[1], frame(gid, signer=others[1]))
    assert av.pending.started(gid, ids)  # one of two started at its step and waits
    # not more than half: a member behind the group's start does not skip to it for one of two
    assert not av.pending.started(gid, ids, majority=True)
    av._on_frame(ids[0], frame(gid, signer=others[0]))
    assert av.pending.started(gid, ids, majority=True)
    assert not av.pending.started(gid, [], majority=True)  # no other member: nobody started it


def test_a_banned_members_early_pushes_do_not_count_as_waiting_for_us():
    """A member banned for a proven lie may still push first in every group it is in; its
    earliness must not make us follow (``peer.pace``), which would cost our steps, not its."""
    av = averager()
    liar, other = Identity.from_seed(b"\x05" * 32), Identity.from_seed(b"\x06" * 32)
    av.banned = frozenset({liar.peer_id})
    gid = b"b" * 16
    av._on_frame(liar.peer_id, frame(gid, signer=liar))
    assert len(av.pending.items(gid)) == 1  # kept for the round (counted there, not averaged)...
    assert not av.pending.started(gid, [liar.peer_id, other.peer_id])  # ...but it waits for nobody
    av._on_frame(other.peer_id, frame(gid, signer=other))
    assert av.pending.started(gid, [liar.peer_id, other.peer_id])
