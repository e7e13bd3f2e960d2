"""The averager's inbound side without a network: framing limits and the bounded buffer of
frames for groups this member has not started yet."""

import asyncio

import pytest

from peer.allreduce import Averager, _FrameTooLarge, chunk_elements, read_frame
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


def frame(group_id: bytes, numel: int = 256, run_id: bytes = RUN_ID, signer: Identity = SENDER) -> bytes:
    msg = PushSlice(run_id=run_id, fragment=0, round=1, group_id=group_id, part=0, offset=0, numel=numel,
                    shape=(numel,), dtype="float32", codec="fp32", weight=1.0, payload=bytes(4 * numel))
    return seal(msg, signer)


def averager(**kw) -> Averager:
    av = Averager(FakeP2P(), Identity.from_seed(b"\x02" * 32), RUN_ID, max_frame_bytes=8192, **kw)
    asyncio.run(av.start())
    return av


def test_frames_are_length_checked_before_the_body_is_read():
    async def main():
        r = asyncio.StreamReader()
        r.feed_data((1 << 40).to_bytes(8, "big"))  # announces a terabyte, sends nothing more
        with pytest.raises(_FrameTooLarge):
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
    av = averager(max_pending_groups=2, max_pending_bytes=3 * (8 + len(frame(b"x" * 16))))  # 8: length prefix
    peer = SENDER.peer_id
    for g in (b"a", b"b", b"c"):  # three groups: the oldest is evicted
        av._on_frame(peer, frame(g * 16))
    assert list(av._pending) == [b"b" * 16, b"c" * 16]
    for _ in range(3):  # the byte budget allows one more frame, not three
        av._on_frame(peer, frame(b"c" * 16))
    assert av.pending_bytes <= av.max_pending_bytes
    assert len(av._pending[b"c" * 16].items) == 2


def test_early_frames_expire_and_unverifiable_ones_are_never_buffered():
    av = averager(pending_ttl_s=0.0)
    peer = SENDER.peer_id
    av._on_frame(peer, frame(b"a" * 16))
    av._on_frame(peer, frame(b"b" * 16))  # by now the first one has expired
    assert list(av._pending) == [b"b" * 16]
    av = averager()
    av._on_frame(peer, frame(b"a" * 16, run_id=b"\x08" * 20))  # another run
    av._on_frame(Identity.from_seed(b"\x03" * 32).peer_id, frame(b"b" * 16))  # not the stream's peer
    assert av.pending_bytes == 0  # (a blame is remembered, but it holds no bytes)
