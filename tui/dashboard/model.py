"""What the dashboard knows about the node: its last status and the events since, folded into
bounded series and tables. Pure (no Textual, no sockets), so it is tested on its own."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from protocol.errors import ConfigError
from protocol.messages import Message
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
from protocol.settings import Settings, parse_settings

MAX_POINTS = 600  # loss points kept per series
MAX_SYNCS = 200
MAX_LOG = 2000
STALE_S = 30.0
"""A peer row whose latest heartbeat is older than this is marked stale (heartbeats come every few
seconds; the node sends PeerLeft only when the heartbeat expires, 45 s by default)."""


@dataclass(slots=True)
class SyncRow:
    at: float
    fragment: int
    round: int
    group_size: int
    contributors: int
    bytes: int
    latency_s: float
    waited_s: float
    failed: str = ""
    """Why the sync found no group or failed ("" if it averaged)."""


@dataclass(slots=True)
class DashboardModel:
    status: StatusReported | None = None
    node_up: bool = False
    node_error: str = ""
    """Why the dashboard has no node ("no swarmstream node is running ...")."""
    train: deque[tuple[int, float]] = field(default_factory=lambda: deque(maxlen=MAX_POINTS))
    heldout: deque[tuple[int, float]] = field(default_factory=lambda: deque(maxlen=MAX_POINTS))
    syncs: deque[SyncRow] = field(default_factory=lambda: deque(maxlen=MAX_SYNCS))
    peers: dict[str, PeerUpdated] = field(default_factory=dict)
    log: deque[LogRecorded] = field(default_factory=lambda: deque(maxlen=MAX_LOG))
    log_total: int = 0
    """Log lines received in all (the deque keeps the newest MAX_LOG)."""
    events_seen: int = 0

    @property
    def settings(self) -> Settings | None:
        if self.status is None:
            return None
        try:
            return parse_settings(self.status.settings_toml)
        except ConfigError:  # a node of another version: show the rest
            return None

    def set_status(self, st: StatusReported) -> None:
        self.status, self.node_up, self.node_error = st, True, ""

    def node_gone(self, why: str) -> None:
        self.node_up, self.node_error = False, why

    def apply(self, ev: Message) -> None:
        """Fold one event from the node's stream."""
        self.events_seen += 1
        if isinstance(ev, LossMeasured):
            series = self.train if ev.split == "train" else self.heldout
            if not series or ev.step > series[-1][0]:
                series.append((ev.step, ev.loss))
        elif isinstance(ev, FragmentSynced):
            self.syncs.appendleft(SyncRow(ev.at, ev.fragment, ev.round, ev.group_size, ev.contributors,
                                          ev.bytes_sent + ev.bytes_received, ev.duration_s, ev.waited_s))
        elif isinstance(ev, FragmentSyncFailed):
            self.syncs.appendleft(SyncRow(ev.at, ev.fragment, ev.round, 1, 1, 0, 0.0, 0.0, failed=ev.reason))
        elif isinstance(ev, PeerUpdated):
            self.peers[ev.peer_id] = ev
        elif isinstance(ev, PeerLeft):
            self.peers.pop(ev.peer_id, None)
        elif isinstance(ev, LogRecorded):
            last = self.log[-1] if self.log else None
            if last is not None and (ev.at < last.at or (ev.at, ev.text) == (last.at, last.text)):
                return  # the node's backlog again, after a reconnect: lines come in time order
            self.log.append(ev)
            self.log_total += 1
        elif isinstance(ev, StatusReported):
            self.set_status(ev)
        elif isinstance(ev, (StateChanged, PeerJoined)):
            pass  # the next status shows the state; PeerUpdated fills the table

    @property
    def paused(self) -> bool:
        return self.status is not None and self.status.state == "paused"

    def peer_rows(self, now: float) -> list[tuple[PeerUpdated, bool]]:
        """The peers table, biggest contribution first: (row, stale) with stale meaning no
        heartbeat for STALE_S seconds of ``now`` (the dashboard's clock)."""
        rows = sorted(self.peers.values(), key=lambda p: (-p.tokens, p.peer_id))
        return [(p, now - p.last_seen_at > STALE_S) for p in rows]


def short_peer(peer_id: str) -> str:
    """``12D3KooW...`` IDs share their first 8 characters; show the distinctive tail."""
    return "…" + peer_id[-8:] if len(peer_id) > 10 else peer_id


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} GB"


def human_rate(bits_per_s: float) -> str:
    return f"{bits_per_s / 1e6:.2f} Mbit/s" if bits_per_s >= 1e5 else f"{bits_per_s / 1e3:.1f} kbit/s"


def ago(seconds: float) -> str:
    if seconds < 60:
        return f"{max(0, seconds):.0f} s ago"
    if seconds < 3600:
        return f"{seconds / 60:.0f} min ago"
    return f"{seconds / 3600:.1f} h ago"
