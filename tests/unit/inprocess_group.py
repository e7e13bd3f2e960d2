"""A group of real ``peer.allreduce.Averager``s in one process, for unit tests of a whole
round: each member runs the real ``Averager.allreduce``; its ``_send_frames`` hands the frames
to the receiver's ``_on_frame`` (and ``_stream_ended``) through ``InProcessGroup.policy``, which lets a
test make one member lie (rewrite, swallow or hold its frames) or add frames signed with its
key (``inject``). No network, no p2p daemon: the wire format and the round code are the real ones."""

from __future__ import annotations

import asyncio
from typing import Any
from collections.abc import Awaitable, Callable

import torch

from peer.allreduce import Averager, Group
from protocol.envelope import seal, verify
from protocol.identity import Identity

RUN = b"\x21" * 20
Policy = Callable[[int, int, bytes, Any], Awaitable[list[bytes]]]


class InProcessGroup:
    def __init__(self, n: int = 3, deadline_s: float = 1.0, numel_per: int = 8, clip: float = 2.0,
                 latency_s: float = 0.005, seed: int = 0):
        self.n, self.latency_s = n, latency_s
        self.keys = [Identity.from_seed(bytes([0x70 + i + 8 * seed]) * 32) for i in range(n)]
        self.index = {k.peer_id: i for i, k in enumerate(self.keys)}
        self.averagers = [Averager(p2p=None, identity=k, run_id=RUN, clip=clip) for k in self.keys]
        for i, av in enumerate(self.averagers):
            av._started = True
            av._send_frames = self._sender(i)
        self.group = Group(run_id=RUN, fragment=0, round=1, group_id=b"g" * 16,
                           members=tuple(k.public_key for k in self.keys), weights=(1.0,) * n,
                           numel=numel_per * n, codec="fp32", deadline_s=deadline_s)
        gen = torch.Generator().manual_seed(99 + seed)
        self.vectors = [torch.randn(numel_per * n, generator=gen) for _ in range(n)]
        self.policy: Policy | None = None
        self.sent: list[tuple[int, int, Any]] = []  # (from, to, message) as delivered
        self.delivered = asyncio.Event()

    def _sender(self, src: int):
        async def send(peer_id: str, frames: list[list[Any]]) -> int:
            dst, total, carried = self.index[peer_id], 0, set()
            for parts in frames:
                data = b"".join(bytes(p) for p in parts)
                out = [data] if self.policy is None else await self.policy(src, dst, data, verify(data))
                await asyncio.sleep(self.latency_s)
                for frame in out:
                    key = self.deliver(src, dst, frame)
                    if key is not None:
                        carried.add(key)
                total += len(data)
            self.averagers[dst]._stream_ended(self.keys[src].peer_id, carried)
            await asyncio.sleep(self.latency_s)  # the acknowledgements' way back
            return total
        return send

    def deliver(self, src: int, dst: int, frame: bytes) -> Any:
        self.sent.append((src, dst, verify(frame).message))
        key = self.averagers[dst]._on_frame(self.keys[src].peer_id, frame)
        self.delivered.set()
        return key

    def inject(self, src: int, dst: int, msg: Any) -> None:
        """A frame signed by member ``src``, delivered to ``dst`` now."""
        key = self.deliver(src, dst, seal(msg, self.keys[src]))
        if key is not None:
            self.averagers[dst]._stream_ended(self.keys[src].peer_id, {key})

    def round_of(self, i: int):
        gid = self.group.group_id
        return self.averagers[i]._active.get(gid) or self.averagers[i]._recent.get(gid)

    async def until(self, cond: Callable[[], bool], timeout: float = 10.0) -> None:
        end = asyncio.get_running_loop().time() + timeout
        while not cond():
            assert asyncio.get_running_loop().time() < end, "timed out"
            self.delivered.clear()
            try:
                await asyncio.wait_for(self.delivered.wait(), 0.05)
            except asyncio.TimeoutError:
                pass

    async def run(self, members: list[int], beside: Callable[[], Awaitable[None]] | None = None) -> dict[int, Any]:
        """One round of ``self.group`` on ``members`` (each its own vector); -> member -> outcome.
        ``beside``: a coroutine run meanwhile (a liar's extra frames)."""
        task = asyncio.ensure_future(beside()) if beside else None
        try:
            outs = await asyncio.wait_for(asyncio.gather(*(
                self.averagers[i].allreduce(self.group, self.vectors[i], self.group.weights[i]) for i in members)),
                timeout=10 * self.group.deadline_s)
        finally:
            if task is not None:
                task.cancel()
        # the finals on their way to rounds that finished already (each a side task of its sender)
        await self.until(lambda: not any(av._side_tasks for av in self.averagers))
        return dict(zip(members, outs))
