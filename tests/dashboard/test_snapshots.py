"""Snapshots of each screen (pytest-textual-snapshot), with the node's data, the clock and the
time zone fixed. After an intended UI change: python -m pytest tests/dashboard --snapshot-update"""

import tempfile
import time
from pathlib import Path

import pytest

from protocol.messages_control import (
    FragmentSynced,
    FragmentSyncFailed,
    LogRecorded,
    LossMeasured,
    PeerUpdated,
)
from protocol.settings import NetworkSettings, Settings, render_settings
from tests.fake_node import FakeNode
from tui.dashboard.app import SwarmstreamApp

NOW = 1_800_000_000.0
PEERS = ["12D3KooWGzNJhy6ehyTJDtk1ymd2PvvZ6rfpeDwNN8ekgyQCpQXP", "12D3KooWD3eckifWpRn9wQpMG9R9hX3sD158z7EqHWmweQAJU5SA"]
SIZE = (130, 44)


@pytest.fixture(autouse=True)
def utc(monkeypatch):
    monkeypatch.setenv("TZ", "UTC")
    time.tzset()
    yield
    monkeypatch.undo()
    time.tzset()


@pytest.fixture
def node():
    with FakeNode(Path(tempfile.mkdtemp(prefix="ss-snap-", dir="/tmp")) / "node.sock", uptime_s=5400.0) as n:
        n.snapshot = [LossMeasured(at=NOW, step=10 * i, split="train", loss=5.5 - 3.2 * (1 - 0.93 ** i))
                      for i in range(60)]
        n.snapshot += [LossMeasured(at=NOW, step=100 * i, split="heldout", loss=5.4 - 2.9 * (1 - 0.6 ** i))
                       for i in range(1, 7)]
        n.snapshot.append(FragmentSyncFailed(at=NOW - 200, fragment=1, round=37, reason="no group formed"))
        n.snapshot += [FragmentSynced(at=NOW - 30 * i, fragment=i % 2, round=40 - i // 2, group_size=4,
                                      contributors=4 - (i == 3), weight=8192.0, duration_s=0.41 + 0.01 * i,
                                      waited_s=0.0, bytes_sent=77_000, bytes_received=77_000) for i in reversed(range(6))]
        n.snapshot += [PeerUpdated(at=NOW, peer_id=p, state="training", device="cuda NVIDIA RTX 4090",
                                   tokens=9_000_000 + 1000 * i, tokens_per_s=41000.0 - 900 * i, rounds_done=40,
                                   last_seen_at=NOW - 2 - i) for i, p in enumerate(PEERS)]
        n.snapshot.append(LogRecorded(at=NOW, level="INFO", logger="peer.node", text="fragment synced fragment=1 round=40"))
        yield n


def app_for(node, **kw):
    return SwarmstreamApp(node.server.path, poll_s=0.2, clock=lambda: NOW, **kw)


async def settled(pilot):
    app = pilot.app
    for _ in range(200):
        if app.model.node_up and len(app.model.train) == 60 and app.model.peers and len(app.model.log) == 1:
            break
        await pilot.pause(0.05)
    await redrawn(pilot)  # one redraw after the data arrived


async def redrawn(pilot, times: int = 1):
    """Wait (bounded) for ``times`` redraws begun after this call: they show the model as it is."""
    app, n = pilot.app, pilot.app.redraws
    for _ in range(200):
        if app.redraws >= n + times:
            return
        await pilot.pause(0.05)
    raise AssertionError("no redraw within 10 s")


async def switched(pilot, mode: str):
    """Switch to a screen and wait (bounded) until it is drawn from the model."""
    await pilot.press(mode[0])
    for _ in range(200):
        if pilot.app.current_mode == mode:
            return await redrawn(pilot)
        await pilot.pause(0.05)
    raise AssertionError(f"no {mode} screen within 10 s")


def test_dashboard_screen(snap_compare, node):
    assert snap_compare(app_for(node), terminal_size=SIZE, run_before=settled)


def test_settings_screen(snap_compare, node):
    async def go(pilot):
        await settled(pilot)
        await switched(pilot, "settings")
    assert snap_compare(app_for(node), terminal_size=SIZE, run_before=go)


def test_log_screen(snap_compare, node):
    async def go(pilot):
        await settled(pilot)
        await switched(pilot, "log")
    assert snap_compare(app_for(node), terminal_size=SIZE, run_before=go)


def test_runs_screen_without_a_node(snap_compare):
    async def list_runs():
        return [{"run_id": "4xk2m7qxv3hq6uzp5bg2w4aa3cjd7ne2", "name": "wiki-150m", "num_params": 151_234_560,
                 "peers": 37, "step": 12800, "address": "swarmstream:4xk2m7qxv3hq6uzp5bg2w4aa3cjd7ne2@/ip4/1.2.3.4"}]

    async def go(pilot):
        for _ in range(100):
            if pilot.app.screen.query("#runs") and pilot.app.screen.query_one("#runs").row_count:
                break
            await pilot.pause(0.05)
        await redrawn(pilot)
    sock = Path(tempfile.mkdtemp(prefix="ss-snap-", dir="/tmp")) / "none.sock"
    app = SwarmstreamApp(sock, list_runs=list_runs, poll_s=0.2, clock=lambda: NOW)
    assert snap_compare(app, terminal_size=SIZE, run_before=go)


def test_first_run_dialog(snap_compare):
    """A fresh install: the node waits, paused, until the volunteer confirms (issue 6)."""
    sock = Path(tempfile.mkdtemp(prefix="ss-snap-", dir="/tmp")) / "node.sock"

    async def go(pilot):
        for _ in range(200):
            if pilot.app.screen.id == "first-run" and pilot.app.screen.query("Button"):
                return  # the dashboard under it was drawn from the first status when it mounted
            await pilot.pause(0.05)
        raise AssertionError("no first-run dialog within 10 s")

    with FakeNode(sock, state="paused", pause_reason="waiting for you to confirm in the dashboard",
                  awaiting_confirm=True, settings_path="/home/v/.config/swarmstream/settings.toml",
                  settings_toml=render_settings(Settings(network=NetworkSettings(max_upload_mbps=20.0)))):
        app = SwarmstreamApp(sock, poll_s=0.2, clock=lambda: NOW, data_dir="/home/v/.local/share/swarmstream")
        assert snap_compare(app, terminal_size=SIZE, run_before=go)
