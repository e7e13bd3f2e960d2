"""``peer.network.answering``: which bootstrap peers take a TCP connection now (a node's
relays, ``peer.network._static_relays_p2p``)."""

import asyncio

from peer.network import _static_relays_p2p, answering


def test_answering_keeps_the_addresses_that_take_a_connection_and_those_it_cannot_probe():
    async def go():
        server = await asyncio.start_server(lambda r, w: w.close(), "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        closed = await asyncio.start_server(lambda r, w: w.close(), "127.0.0.1", 0)
        gone = closed.sockets[0].getsockname()[1]
        closed.close()
        await closed.wait_closed()
        live, dead = f"/ip4/127.0.0.1/tcp/{port}/p2p/X", f"/ip4/127.0.0.1/tcp/{gone}/p2p/Y"
        quic = "/ip4/127.0.0.1/udp/4001/quic/p2p/Z"  # not TCP: cannot be probed, kept
        try:
            return await answering([dead, live, quic, "/ip4/999.1.1.1/tcp/1/p2p/W"], timeout=2.0), [live, quic]
        finally:
            server.close()
            await server.wait_closed()

    found, expected = asyncio.run(go())
    assert found == expected


def test_the_static_relays_daemon_turns_relay_discovery_off():
    args = _static_relays_p2p()._make_process_args("p2pd", autoRelay=True, trustedRelays="/ip4/1.2.3.4/tcp/1/p2p/X")
    assert args[0] == "p2pd" and "-autoRelay=1" in args and "-relayDiscovery=0" in args
    assert "-trustedRelays=/ip4/1.2.3.4/tcp/1/p2p/X" in args
