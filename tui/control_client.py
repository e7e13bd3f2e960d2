"""Talking to a running node over its control socket (``peer.control`` serves it).

Async for the dashboard (``ControlConnection``), with ``call`` as a blocking one-shot for the
command line. One connection carries either commands (each answered in order) or, after
``events()``, an event stream; the dashboard opens one of each.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator
from pathlib import Path

from protocol.errors import ProtocolError
from protocol.messages import Message
from protocol.messages_control import (
    FRAME_HEADER_BYTES, CommandAccepted, CommandFailed, GetStatus, StatusReported, SubscribeEvents, frame,
    frame_length, unframe,
)

_ids = itertools.count(1)


class ControlError(Exception):
    """One line for the volunteer: no node, a refused command, a broken connection."""


class NoNodeRunning(ControlError):
    pass


class ControlConnection:
    def __init__(self, path: Path, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.path = path
        self._reader, self._writer = reader, writer

    @classmethod
    async def open(cls, path: Path | str, timeout: float = 5.0) -> ControlConnection:
        path = Path(path)
        try:
            reader, writer = await asyncio.wait_for(asyncio.open_unix_connection(str(path)), timeout)
        except (FileNotFoundError, ConnectionRefusedError):
            raise NoNodeRunning(f"no swarmstream node is running (nothing answers on {path}); "
                                "start one with `swarmstream join RUN_ADDRESS` or `swarmstream demo`") from None
        except PermissionError:
            raise ControlError(f"permission denied on {path}: the node belongs to another user") from None
        except (OSError, asyncio.TimeoutError) as e:
            raise ControlError(f"cannot reach the node at {path}: {e or 'timed out'}") from None
        return cls(path, reader, writer)

    async def _read(self) -> Message:
        try:
            header = await self._reader.readexactly(FRAME_HEADER_BYTES)
            return unframe(await self._reader.readexactly(frame_length(header)))
        except asyncio.IncompleteReadError:
            raise ControlError("the node closed the connection (it stopped, or it restarted)") from None
        except ProtocolError as e:
            raise ControlError(f"the node sent something unreadable ({e}); are both the same version?") from None
        except ConnectionError as e:
            raise ControlError(f"lost the connection to the node: {e}") from None

    async def _send(self, msg: Message) -> None:
        try:
            self._writer.write(frame(msg))
            await self._writer.drain()
        except ConnectionError as e:
            raise ControlError(f"lost the connection to the node: {e}") from None

    async def request(self, cls: type[Message], timeout: float = 10.0, **fields) -> Message:
        """Send a command; return its answer. Raises ControlError if the node refused it."""
        msg = cls(request_id=next(_ids) % 2**32, **fields)
        await self._send(msg)
        reply = await asyncio.wait_for(self._read(), timeout)
        if getattr(reply, "request_id", None) != msg.request_id:
            raise ControlError(f"the node answered {type(reply).__name__} out of turn")
        if isinstance(reply, CommandFailed):
            raise ControlError(reply.reason)
        return reply

    async def status(self, timeout: float = 10.0) -> StatusReported:
        reply = await self.request(GetStatus, timeout)
        if not isinstance(reply, StatusReported):
            raise ControlError(f"the node answered GetStatus with {type(reply).__name__}")
        return reply

    async def events(self) -> AsyncIterator[Message]:
        """Subscribe and yield every event until the node goes away (then ControlError)."""
        ack = await self.request(SubscribeEvents)
        if not isinstance(ack, CommandAccepted):
            raise ControlError(f"the node answered SubscribeEvents with {type(ack).__name__}")
        while True:
            yield await self._read()

    async def close(self) -> None:
        self._writer.close()
        try:
            await self._writer.wait_closed()
        except ConnectionError:
            pass


def call(path: Path | str, cls: type[Message], timeout: float = 10.0, **fields) -> Message:
    """Blocking: open, send one command, return the answer, close."""
    async def once() -> Message:
        conn = await ControlConnection.open(path, timeout)
        try:
            return await conn.request(cls, timeout, **fields)
        finally:
            await conn.close()
    return asyncio.run(once())
