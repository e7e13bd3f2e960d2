"""The wire of state sync (``peer.statesync``, ``peer.state_server``): the stream protocol's
name, and its frames: ``u32 big-endian length || one sealed envelope``, whose length is
checked against a limit before anything is read."""

from __future__ import annotations

import asyncio
from typing import Any

from protocol.errors import RemoteProtocolError


MAX_REQUEST_BYTES = 4096
"""Largest request frame a donor reads (a sealed RequestStateChunk is ~250 bytes)."""
ENVELOPE_OVERHEAD = 1024  # envelope and StateChunk heads around a payload, generously


def handler_name(run_id: bytes) -> str:
    """The libp2p stream protocol a run's donors serve state on."""
    return f"swarmstream.state.{run_id.hex()}"


class Refused(Exception):
    def __init__(self, code: str, detail: str):
        super().__init__(f"refused: {code} ({detail})" if detail else f"refused: {code}")
        self.code = code


class FrameTooLarge(RemoteProtocolError):
    pass


async def write_frame(writer: asyncio.StreamWriter, parts: list[Any]) -> None:
    writer.write(sum(len(p) for p in parts).to_bytes(4, "big"))
    for p in parts:
        writer.write(p)
    await writer.drain()


async def read_frame(reader: asyncio.StreamReader, limit: int) -> bytes:
    size = int.from_bytes(await reader.readexactly(4), "big")
    if size > limit:
        raise FrameTooLarge(f"frame of {size} bytes is over the {limit}-byte limit")
    return await reader.readexactly(size)


def close_writer(writer: asyncio.StreamWriter) -> None:
    try:
        writer.close()
    except (OSError, RuntimeError):  # already closed, or the loop is going away
        pass


def short_id(peer_id: str) -> str:
    return f"...{peer_id[-6:]}"


