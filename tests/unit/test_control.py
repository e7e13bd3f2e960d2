"""The control socket: a real Unix socket served by peer.control, used by tui.control_client."""

import asyncio
import os
import socket
import stat
import tempfile
from pathlib import Path

import pytest

from peer.control import ControlError as ServerControlError
from peer.control import ControlServer
from protocol.messages_control import (
    LossMeasured, PauseTraining, PeerUpdated, ResumeTraining, StateChanged, UpdateSettings,
)
from protocol.settings import Settings, parse_settings, render_settings
from tests.fake_node import PEER_ID, FakeNode
from tui.control_client import ControlConnection, ControlError, NoNodeRunning, call


@pytest.fixture
def sock():
    d = Path(tempfile.mkdtemp(prefix="ss-", dir="/tmp"))  # unix socket paths must be short
    yield d / "run" / "node.sock"


def test_status_and_commands_round_trip_with_owner_only_permissions(sock):
    with FakeNode(sock) as node:
        assert stat.S_IMODE(sock.stat().st_mode) == 0o600
        assert stat.S_IMODE(sock.parent.stat().st_mode) == 0o700
        st = call(sock, __import__("protocol.messages_control", fromlist=["GetStatus"]).GetStatus)
        assert st.state == "training" and st.peer_id == PEER_ID
        call(sock, PauseTraining)
        assert node.fields["state"] == "paused"
        with pytest.raises(ControlError, match="already paused"):
            call(sock, PauseTraining)
        call(sock, ResumeTraining)
        assert [type(c) for c in node.commands] == [PauseTraining, PauseTraining, ResumeTraining]


def test_settings_are_validated_by_the_node(sock):
    with FakeNode(sock) as node:
        new = render_settings(Settings().replace(network_max_upload_mbps=8.0))
        call(sock, UpdateSettings, settings_toml=new)
        assert node.settings.network.max_upload_mbps == 8.0
        with pytest.raises(ControlError, match="compute.device"):
            call(sock, UpdateSettings, settings_toml='[compute]\ndevice = "gpu"\n')
        assert parse_settings(node.fields["settings_toml"]).network.max_upload_mbps == 8.0  # kept


def test_subscribers_get_the_snapshot_then_every_event_in_order(sock):
    async def go(node):
        conn = await ControlConnection.open(sock)
        events = conn.events()
        first = await anext(events)
        assert isinstance(first, PeerUpdated)
        for i in range(50):
            node.emit(LossMeasured(at=1.0, step=i, split="train", loss=float(i)))
        got = [await anext(events) for _ in range(50)]
        assert [e.step for e in got] == list(range(50))
        cmd = await ControlConnection.open(sock)
        await cmd.request(PauseTraining)
        changed = await anext(events)
        assert isinstance(changed, StateChanged) and changed.new == "paused"
        await cmd.close()
        await conn.close()

    with FakeNode(sock) as node:
        node.snapshot = [PeerUpdated(at=1.0, peer_id=PEER_ID, state="training", device="cpu", tokens=5,
                                     tokens_per_s=1.0, rounds_done=1, last_seen_at=1.0)]
        asyncio.run(go(node))


def test_a_second_node_on_the_same_socket_is_refused_and_a_stale_socket_replaced(sock):
    with FakeNode(sock):
        with pytest.raises(ServerControlError, match="already running"):
            FakeNode(sock).server.start()
    # a crashed node leaves its socket file behind: nobody answers, so it is replaced
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(sock))
    s.close()
    assert sock.exists()
    with FakeNode(sock):
        assert call(sock, __import__("protocol.messages_control", fromlist=["GetStatus"]).GetStatus).state == "training"
    assert not sock.exists()  # removed on a clean close


def test_no_node_and_junk_give_one_line_errors(sock):
    with pytest.raises(NoNodeRunning, match="no swarmstream node is running"):
        call(sock, PauseTraining)
    with FakeNode(sock):
        raw = socket.socket(socket.AF_UNIX)
        raw.connect(str(sock))
        raw.sendall(b"\x00\x00\x00\x05hello")  # not a message: the node hangs up, keeps serving
        assert raw.recv(10) == b""
        raw.close()
        raw = socket.socket(socket.AF_UNIX)
        raw.connect(str(sock))
        raw.sendall(b"\xff\xff\xff\xff")  # a 4 GiB frame announced: refused before reading it
        assert raw.recv(10) == b""
        raw.close()
        call(sock, PauseTraining)


def test_a_socket_path_that_is_too_long_is_refused_with_what_to_do():
    with pytest.raises(ServerControlError, match="--control"):
        ControlServer(Path("/tmp/" + "x" * 120) / "node.sock", None).start()  # type: ignore[arg-type]
    assert os.path.exists("/tmp")


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another user (CI runs as root)")
def test_another_user_cannot_connect(sock):
    with FakeNode(sock):
        pid = os.fork()
        if pid == 0:  # the child becomes user "nobody" and tries the socket
            code = 3
            try:
                os.setgid(65534)
                os.setuid(65534)
                s = socket.socket(socket.AF_UNIX)
                try:
                    s.connect(str(sock))
                    code = 1  # connected: the permissions failed
                except PermissionError:
                    code = 0
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0, "another user could connect to the control socket"
        assert call(sock, PauseTraining).__class__.__name__ == "CommandAccepted"  # the owner still can
