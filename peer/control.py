"""The node's control socket: how the dashboard and ``swarmstream status|pause|resume|stop``
reach a node that runs in the background (BOINC's client/manager split).

A Unix socket (``peer.paths.control_path()``, or ``--control``) in an owner-only directory,
mode 0600, served by its own thread and event loop so that it answers while the node trains,
downloads state or waits on the network. Frames are ``protocol.messages_control``'s: a 4-byte
length and one strictly decoded message; anything else closes the connection.

Per connection: a command gets ``CommandAccepted`` or ``CommandFailed`` (same request_id),
``GetStatus`` gets a ``StatusReported``, and ``SubscribeEvents`` turns the connection into an
event stream: first a snapshot (``ControlTarget.snapshot_events``: the peers table, recent
syncs and log lines), then every event ``publish`` sees, in order. A subscriber that does not
read keeps the newest ``QUEUE_LIMIT`` events; older ones are dropped, never the node's time.

Two nodes on one socket path cannot both run: binding finds the first one answering and
refuses with ``ControlError``; a socket file nobody answers on (a crash) is replaced.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import threading
from pathlib import Path
from typing import Any, Protocol

from peer.paths import MAX_SOCKET_PATH
from protocol.errors import ProtocolError
from protocol.messages import Message
from protocol.messages_control import (
    COMMANDS, FRAME_HEADER_BYTES, CommandAccepted, CommandFailed, GetStatus, StatusReported, SubscribeEvents, frame,
    frame_length, unframe,
)

log = logging.getLogger(__name__)

QUEUE_LIMIT = 2000  # events buffered per subscriber
READ_TIMEOUT_S = 3600.0  # an idle command connection is closed after this


class ControlError(Exception):
    """The control socket cannot be served (path too long, another node is running...)."""


class CommandError(Exception):
    """Raised by a ControlTarget to refuse a command; its text goes to the dashboard as is."""


class ControlTarget(Protocol):
    """What the socket controls: the node (``peer.node.Node``) or a fake one in tests."""

    def status(self) -> dict[str, Any]:
        """The fields of ``StatusReported`` except ``request_id``. Called from the socket's thread."""

    def command(self, msg: Message) -> None:
        """Carry out a command (pause, resume, finish, leave, settings) or raise CommandError."""

    def snapshot_events(self) -> list[Message]:
        """Events that bring a new subscriber up to date."""


def check_socket_path(path: Path) -> None:
    if len(os.fsencode(path)) > MAX_SOCKET_PATH:
        raise ControlError(f"control socket path {path} is longer than {MAX_SOCKET_PATH} bytes; "
                           "pass a shorter --control path (or set SWARMSTREAM_HOME to a short folder)")


def node_answers(path: Path, timeout: float = 2.0) -> bool:
    """Whether a live process accepts connections on the socket at ``path``."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout)
    try:
        s.connect(str(path))
        return True
    except OSError:
        return False
    finally:
        s.close()


class ControlServer:
    def __init__(self, path: Path, target: ControlTarget):
        self.path = Path(path)
        self.target = target
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="control-socket", daemon=True)
        self._server: asyncio.AbstractServer | None = None
        self._subscribers: set[asyncio.Queue] = set()
        self._connections: dict[asyncio.Task, asyncio.StreamWriter] = {}

    # --- life cycle (called from the node's thread) --------------------------------------

    def start(self) -> None:
        check_socket_path(self.path)
        self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        os.chmod(self.path.parent, 0o700)  # the socket's folder is the first line of access control
        if self.path.exists() or self.path.is_symlink():
            if node_answers(self.path):
                raise ControlError(f"a swarmstream node is already running (control socket {self.path}); "
                                   "use `swarmstream status`, or stop it with `swarmstream stop`")
            self.path.unlink()  # left behind by a node that crashed
        self._thread.start()
        try:
            asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(10)
        except BaseException:
            self.close()
            raise

    async def _start(self) -> None:
        old = os.umask(0o177)  # the socket is born 0600 (no window where others can connect)
        try:
            self._server = await asyncio.start_unix_server(self._serve, path=str(self.path))
        finally:
            os.umask(old)
        os.chmod(self.path, 0o600)

    def close(self) -> None:
        if self._thread.is_alive():
            async def stop() -> None:
                if self._server is not None:
                    self._server.close()
                for q in list(self._subscribers):
                    q.put_nowait(None)  # ends each subscriber's stream
                for writer in list(self._connections.values()):  # and every other connection
                    writer.close()
                if self._connections:
                    await asyncio.wait(list(self._connections), timeout=2)
            try:
                asyncio.run_coroutine_threadsafe(stop(), self._loop).result(5)
            except Exception as e:  # closing must not raise over the node's own shutdown
                log.warning("control socket did not close cleanly reason=%r", e)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(5)
        try:
            if self._server is not None:
                self.path.unlink(missing_ok=True)
        except OSError:
            pass

    def publish(self, msg: Message) -> None:
        """Send an event to every subscriber; safe from any thread, never blocks."""
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._fan_out, msg)

    # --- on the socket's loop ---------------------------------------------------------------

    def _fan_out(self, msg: Message) -> None:
        for q in self._subscribers:
            if q.full():
                q.get_nowait()  # a slow reader loses the oldest event, not the newest
            q.put_nowait(msg)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._connections[task] = writer
        try:
            while True:
                try:
                    header = await asyncio.wait_for(reader.readexactly(FRAME_HEADER_BYTES), READ_TIMEOUT_S)
                except (asyncio.IncompleteReadError, asyncio.TimeoutError):
                    return
                msg = unframe(await reader.readexactly(frame_length(header)))
                if not isinstance(msg, COMMANDS):
                    raise ProtocolError(f"{type(msg).__name__} is not a command")
                if isinstance(msg, SubscribeEvents):
                    await self._stream(msg, writer)
                    return
                writer.write(frame(self._answer(msg)))
                await writer.drain()
        except (ProtocolError, asyncio.IncompleteReadError, ConnectionError) as e:
            log.debug("control connection closed reason=%r", e)
        finally:
            writer.close()
            self._connections.pop(task, None)

    def _answer(self, msg: Message) -> Message:
        rid = msg.request_id  # type: ignore[attr-defined]
        try:
            if isinstance(msg, GetStatus):
                return StatusReported(request_id=rid, **self.target.status())
            self.target.command(msg)
            return CommandAccepted(request_id=rid)
        except CommandError as e:
            return CommandFailed(request_id=rid, reason=str(e)[:256])
        except Exception as e:  # a bug of ours: say so on the socket and in the log, keep serving
            log.exception("control command failed command=%s", type(msg).__name__)
            return CommandFailed(request_id=rid, reason=f"internal error: {e!r}"[:256])

    async def _stream(self, msg: SubscribeEvents, writer: asyncio.StreamWriter) -> None:
        q: asyncio.Queue = asyncio.Queue(QUEUE_LIMIT)
        self._subscribers.add(q)  # from now on nothing published is missed
        try:
            writer.write(frame(CommandAccepted(request_id=msg.request_id)))
            for ev in self.target.snapshot_events():
                writer.write(frame(ev))
            await writer.drain()
            while (ev := await q.get()) is not None:
                writer.write(frame(ev))
                if q.empty():
                    await writer.drain()
        finally:
            self._subscribers.discard(q)
