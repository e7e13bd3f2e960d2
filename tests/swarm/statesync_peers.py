"""Donor processes for the state-sync swarm tests (spawned, so importable here)."""

from __future__ import annotations

import asyncio
import dataclasses
import queue

import torch

RUN_ID = b"s" * 20
CHUNK_BYTES = 64 << 10
MAX_CONCURRENT = 2


def expected_state():
    """The state every donor serves: ~3.2 MB of fixed random numbers, ~50 chunks of 64 KiB."""
    from peer.statesync import GlobalState

    gen = torch.Generator().manual_seed(7)
    tensors = {"global/0": torch.randn(300_000, generator=gen), "global/1": torch.randn(200_000, generator=gen),
               "outer_momentum/0": torch.randn(300_000, generator=gen)}
    return GlobalState(tensors=tensors, rounds=(5, 4), step=40)


def donor(identity_path: str, out_q, cmd_q) -> None:
    """Serve ``expected_state()`` until told ``("stop",)``; ``("corrupt", on)`` flips a bit in
    every chunk served from now on (or stops doing so), ``("stall", on)`` leaves chunk requests
    unanswered; both are answered by ``("ok",)``."""
    from swarm_util import own_process_group

    own_process_group()
    asyncio.run(_donor(identity_path, out_q, cmd_q))


async def _donor(identity_path: str, out_q, cmd_q) -> None:
    from hivemind.p2p import P2P

    from peer.identity_store import load_or_create_identity
    from peer.statesync import StateServer

    ident = load_or_create_identity(identity_path)
    p2p = await P2P.create(identity_path=identity_path, host_maddrs=["/ip4/127.0.0.1/tcp/0"],
                           check_if_identity_free=False)
    server = StateServer(p2p, ident, RUN_ID, chunk_bytes=CHUNK_BYTES, max_concurrent=MAX_CONCURRENT)
    try:
        await server.start()
        digest = await server.publish(expected_state())
        maddrs = [str(m) for m in await p2p.get_visible_maddrs()]
        out_q.put(("ready", ident.peer_id, maddrs, digest))
        loop = asyncio.get_running_loop()
        while True:
            try:  # bounded, so an orphaned donor ends by itself
                cmd = await loop.run_in_executor(None, cmd_q.get, True, 120)
            except queue.Empty:
                break
            if cmd[0] == "stop":
                break
            if cmd[0] == "corrupt":
                server.corrupt_chunks = set(range(100_000)) if cmd[1] else set()
                out_q.put(("ok",))
            elif cmd[0] == "stall":
                server.stall_chunks = set(range(100_000)) if cmd[1] else set()
                out_q.put(("ok",))
            elif cmd[0] == "stats":
                out_q.put(("stats", dataclasses.asdict(server.stats)))
    finally:
        await server.shutdown()
        await p2p.shutdown()
