"""``peer.network.answering``: which bootstrap peers take a TCP connection now (a node's
relays, ``peer.network.StaticRelaysP2P``)."""

import asyncio

from peer.network import StaticRelaysP2P, answering, peer_of


def test_answering_keeps_one_answering_address_a_peer_and_never_our_own():
    async def go():
        server = await asyncio.start_server(lambda r, w: w.close(), "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        closed = await asyncio.start_server(lambda r, w: w.close(), "127.0.0.1", 0)
        gone = closed.sockets[0].getsockname()[1]
        closed.close()
        await closed.wait_closed()
        live, dead = f"/ip4/127.0.0.1/tcp/{port}/p2p/X", f"/ip4/127.0.0.1/tcp/{gone}/p2p/Y"
        again = f"/dns4/localhost/tcp/{port}/p2p/X"  # a second address of X: X is one relay
        ours = f"/ip4/127.0.0.1/tcp/{port}/p2p/ME"
        quic = "/ip4/127.0.0.1/udp/4001/quic/p2p/Z"  # not TCP: cannot be probed
        try:
            with_tcp = await answering([dead, quic, live, again, ours, "/ip4/127.0.0.1/tcp/70000/p2p/V",
                                        f"/ip4/127.0.0.1/tcp/{port}/ipfs/X/p2p-circuit"], timeout=2.0, own="ME")
            only_unprobed = await answering([dead, quic], timeout=2.0)
            return with_tcp, only_unprobed, [live], [quic]
        finally:
            server.close()
            await server.wait_closed()

    with_tcp, only_unprobed, expected_tcp, expected_unprobed = asyncio.run(go())
    assert with_tcp == expected_tcp  # an unprobed one is a relay only if no probed one answered
    assert only_unprobed == expected_unprobed


def test_the_static_relays_daemon_turns_relay_discovery_off():
    args = StaticRelaysP2P._make_process_args("p2pd", autoRelay=True, trustedRelays="/ip4/1.2.3.4/tcp/1/p2p/X")
    assert args[0] == "p2pd" and "-autoRelay=1" in args and "-relayDiscovery=0" in args
    assert "-trustedRelays=/ip4/1.2.3.4/tcp/1/p2p/X" in args


def test_peer_of_reads_the_peer_id_before_any_circuit():
    assert peer_of("/ip4/1.2.3.4/tcp/1/p2p/R") == "R"
    assert peer_of("/ip4/1.2.3.4/tcp/1/p2p/R/") == "R"
    assert peer_of("/ip4/1.2.3.4/tcp/1/ipfs/R/p2p-circuit/p2p/T") == "R"
    assert peer_of("/ip6/::1/tcp/1/p2p/R") == "R"
    assert peer_of("/ip4/1.2.3.4/tcp/1") == "/ip4/1.2.3.4/tcp/1"
