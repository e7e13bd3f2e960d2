"""Asking donors for their current index (``statesync.current_indexes``, every catch-up, repair
and settle download) takes at most its timeout, however slow one donor is. Found by an
adversarial review: a donor slow to open the stream and then silent held the poll for twice
the timeout, past its caller's budget (``state_chunk_timeout_s + 10``), and the download failed."""

import asyncio
import types

from peer.globalstate import snapshot
from peer.state_server import StateServer
from peer.statesync import current_indexes
from protocol.identity import Identity
from test_statesync import RUN, trained_worker

TIMEOUT = 2.0


class _Writer:
    def __init__(self, reader: asyncio.StreamReader):
        self.reader = reader

    def write(self, data) -> None:
        self.reader.feed_data(bytes(data))

    async def drain(self) -> None:
        pass

    def close(self) -> None:
        self.reader.feed_eof()


def test_one_slow_silent_donor_costs_the_poll_its_timeout_not_more():
    honest = [Identity.from_seed(bytes([0x50 + i]) * 32) for i in range(2)]
    liar, me = Identity.from_seed(b"\x5a" * 32), Identity.from_seed(b"\x5b" * 32)

    async def main() -> dict:
        servers = {}
        for ident in honest:
            servers[ident.peer_id] = StateServer(None, ident, RUN, chunk_bytes=1 << 16)
            await servers[ident.peer_id].publish(snapshot(trained_worker(0), rounds=[2, 2]))

        class P2P:  # in-memory streams to the donors' real handlers; the liar's is slow, then silent
            async def call_binary_stream_handler(self, pid, name):
                pid = pid.to_base58()
                if pid == liar.peer_id:
                    await asyncio.sleep(TIMEOUT * 0.95)
                    return None, asyncio.StreamReader(), _Writer(asyncio.StreamReader())
                to_donor, to_us = asyncio.StreamReader(), asyncio.StreamReader()
                info = types.SimpleNamespace(peer_id=types.SimpleNamespace(to_base58=lambda: me.peer_id))
                asyncio.create_task(servers[pid]._handle(info, to_donor, _Writer(to_us)))
                return None, to_us, _Writer(to_donor)

        async with asyncio.timeout(TIMEOUT * 1.5):  # the old poll took 1.95 x TIMEOUT here
            return await current_indexes(P2P(), me, RUN, [i.peer_id for i in honest] + [liar.peer_id],
                                         timeout_s=TIMEOUT)

    got = asyncio.run(main())
    assert set(got) == {i.peer_id for i in honest}
