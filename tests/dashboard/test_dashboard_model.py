"""DashboardModel on its own: how events and status snapshots fold into bounded series and tables;
and the run's progress and ETA that the dashboard and `swarmstream status` show."""

import pytest

from protocol.messages_control import (
    FragmentSynced,
    FragmentSyncFailed,
    LogRecorded,
    LossMeasured,
    PeerJoined,
    PeerLeft,
    PeerUpdated,
    StateChanged,
    StatusReported,
)
from protocol.settings import Settings, render_settings
from tests.fake_node import PEER_ID
from tui.dashboard.model import (
    MAX_LOG,
    MAX_POINTS,
    MAX_SYNCS,
    STALE_S,
    DashboardModel,
    ago,
    human_bytes,
    human_rate,
    short_peer,
)
from tui.node_commands import format_status
from tui.run_progress import human_duration, run_progress

OTHER = "12D3KooWGzNJhy6ehyTJDtk1ymd2PvvZ6rfpeDwNN8ekgyQCpQXP"


def peer(peer_id: str, tokens: int, last_seen_at: float = 100.0) -> PeerUpdated:
    return PeerUpdated(at=100.0, peer_id=peer_id, state="training", device="cpu", tokens=tokens, tokens_per_s=10.0,
                       rounds_done=1, last_seen_at=last_seen_at)


# the fields of a fresh node's status (all of them: only fields added later have defaults)
FAKE_FIELDS = {
    "at": 100.0, "run_id": b"\x01" * 20, "run_name": "r", "peer_id": PEER_ID, "state": "training",
    "pause_reason": "", "step": 1, "tokens": 1, "tokens_per_s": 1.0, "loss": None, "heldout_loss": None, "peers": 1,
    "rounds_done": 0, "upload_bps": 0.0, "download_bps": 0.0, "uptime_s": 1.0, "device": "cpu",
    "reachability": "direct", "inner_step_s": 0.1, "progress": None, "progress_label": "",
    "settings_path": "/x.toml", "settings_toml": render_settings(Settings()), "tokens_contributed": 0,
    "fragments_contributed": 0, "fragments_alone": 0, "rounds_joined": 0, "steps_dropped": 0, "total_steps": 1000,
}


def status(**fields) -> StatusReported:
    return StatusReported(request_id=1, **{**FAKE_FIELDS, **fields})


def test_loss_series_are_split_bounded_and_ignore_replayed_points():
    m = DashboardModel()
    for i in range(MAX_POINTS + 400):
        m.apply(LossMeasured(at=1.0, step=i, split="train", loss=1.0))
    m.apply(LossMeasured(at=1.0, step=5, split="train", loss=9.0))  # a resubscribe replays old points
    m.apply(LossMeasured(at=1.0, step=50, split="heldout", loss=2.0))
    assert len(m.train) == MAX_POINTS and m.train[-1] == (MAX_POINTS + 399, 1.0)
    assert list(m.heldout) == [(50, 2.0)]


def test_sync_timeline_is_newest_first_bounded_and_counts_both_directions():
    m = DashboardModel()
    m.apply(FragmentSynced(at=1.0, fragment=1, round=3, group_size=4, contributors=3, weight=1.0, duration_s=0.5,
                           waited_s=0.1, bytes_sent=700, bytes_received=300))
    row = m.syncs[0]
    assert (row.fragment, row.round, row.group_size, row.contributors, row.bytes) == (1, 3, 4, 3, 1000)
    assert (row.latency_s, row.waited_s, row.failed) == (0.5, 0.1, "")
    for i in range(MAX_SYNCS + 50):
        m.apply(FragmentSyncFailed(at=2.0, fragment=0, round=i, reason="no group formed"))
    assert len(m.syncs) == MAX_SYNCS and m.syncs[0].round == MAX_SYNCS + 49
    assert m.syncs[0].failed == "no group formed"


def test_peers_are_keyed_by_id_removed_on_leave_and_marked_stale():
    m = DashboardModel()
    m.apply(PeerJoined(at=1.0, peer_id=OTHER, device="cpu"))  # a row comes with its first heartbeat
    assert not m.peers
    m.apply(peer(OTHER, 10))
    m.apply(peer(OTHER, 20))  # the newest heartbeat replaces the row
    m.apply(peer(PEER_ID, 30, last_seen_at=100.0 - STALE_S - 1))
    assert len(m.peers) == 2 and m.peers[OTHER].tokens == 20
    assert [(p.peer_id, stale) for p, stale in m.peer_rows(now=100.0)] == [(PEER_ID, True), (OTHER, False)]
    m.apply(PeerLeft(at=2.0, peer_id=OTHER, reason="heartbeat expired"))
    m.apply(PeerLeft(at=2.0, peer_id=OTHER, reason="again"))  # unknown: ignored
    assert list(m.peers) == [PEER_ID]


def test_log_keeps_the_newest_lines_and_counts_all():
    m = DashboardModel()
    for i in range(MAX_LOG + 10):
        m.apply(LogRecorded(at=1.0, level="INFO", logger="peer.node", text=f"line {i}"))
    assert len(m.log) == MAX_LOG and m.log_total == MAX_LOG + 10 and m.log[-1].text == f"line {MAX_LOG + 9}"


def test_the_nodes_log_backlog_after_a_reconnect_is_not_shown_twice():
    m = DashboardModel()
    lines = [LogRecorded(at=float(t), level="INFO", logger="peer.node", text=f"line {t}") for t in (1, 2, 2, 3)]
    lines[2] = LogRecorded(at=2.0, level="INFO", logger="peer.node", text="another line at 2")
    for ev in lines + lines:  # the snapshot a node sends again when the dashboard reconnects
        m.apply(ev)
    assert [ev.text for ev in m.log] == ["line 1", "line 2", "another line at 2", "line 3"] and m.log_total == 4


def test_status_node_gone_and_settings():
    m = DashboardModel()
    assert m.settings is None and not m.paused and not m.node_up
    m.set_status(status(state="paused"))
    assert m.node_up and m.paused and m.settings == Settings()
    m.apply(StateChanged(at=1.0, old="paused", new="training", reason="x"))  # the next status tells
    assert m.paused
    m.node_gone("no swarmstream node is running")
    assert not m.node_up and m.node_error.startswith("no swarmstream node")
    m.set_status(status(settings_toml="[compute]\ndevice = 'tpu'\n"))  # a node of another version
    assert m.node_up and m.node_error == "" and m.settings is None


def test_formatting_helpers():
    assert short_peer(PEER_ID) == "…" + PEER_ID[-8:] and short_peer("abc") == "abc"
    assert human_bytes(512) == "512 B" and human_bytes(154_000) == "154.0 KB" and human_bytes(3e12) == "3000.0 GB"
    assert human_rate(2.5e6) == "2.50 Mbit/s" and human_rate(5e4) == "50.0 kbit/s"
    assert ago(3.2) == "3 s ago" and ago(-5) == "0 s ago" and ago(600) == "10 min ago" and ago(5400) == "1.5 h ago"


# --- the run's progress toward its step target (issue 11) ------------------------------------


def test_progress_and_eta_from_the_step_the_target_and_the_mean_step_time():
    p = run_progress(status(step=120, total_steps=2000, inner_step_s=0.25))
    assert (p.fraction, p.steps_left, p.eta_s) == (0.06, 1880, 470.0)
    assert p.text() == "step 120 of 2,000 (6%) · ETA 7 min 50 s"
    assert p.text(paused=True) == "step 120 of 2,000 (6%) · ETA 7 min 50 s once resumed"
    # the percentage is floored: 100% means the target is reached
    assert run_progress(status(step=1999, total_steps=2000, inner_step_s=0.5)).text() == \
        "step 1,999 of 2,000 (99%) · ETA 1 s"
    done = run_progress(status(step=2100, total_steps=2000, inner_step_s=0.5))
    assert (done.fraction, done.steps_left, done.eta_s) == (1.0, 0, 0.0)
    assert done.text() == "step 2,100 of 2,000: target reached"
    # no step timed yet: no ETA rather than "0 s"
    assert run_progress(status(step=0, total_steps=2000, inner_step_s=0.0)).text() == \
        "step 0 of 2,000 (0%) · ETA after the first steps"
    # a node older than total_steps, or not in a run yet, reports none
    assert run_progress(status(total_steps=0)) is None


@pytest.mark.parametrize("seconds, text", [(0.2, "1 s"), (45, "45 s"), (59.6, "1 min 0 s"), (470, "7 min 50 s"),
                                           (3600, "1 h 0 min"), (12_000, "3 h 20 min"), (187_200, "2 d 4 h")])
def test_durations_read_in_their_two_largest_units(seconds, text):
    assert human_duration(seconds) == text


def test_status_text_has_the_target_line_only_when_the_node_reports_one():
    text = format_status(status(step=120, total_steps=2000, inner_step_s=0.25))
    assert "target    step 120 of 2,000 (6%) · ETA 7 min 50 s" in text.splitlines()
    assert "target" not in format_status(status(total_steps=0))
    paused = format_status(status(state="paused", pause_reason="paused by you", step=120, total_steps=2000,
                                  inner_step_s=0.25))
    assert "ETA 7 min 50 s once resumed" in paused


def test_status_text_lists_the_peers_this_node_banned_and_why():
    line = "12D3KooWGzNJhy6ehyTJDtk1ymd2PvvZ6rfpeDwNN8ekgyQCpQXP PushSlice: values are NaN"
    assert f"banned    {line}" in format_status(status(banned=(line,))).splitlines()
    assert "banned" not in format_status(status())
