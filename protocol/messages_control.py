"""Messages of the local control socket between the node and the dashboard.

The dashboard sends commands (imperative names, each with a ``request_id`` it picks); the
node answers each with ``CommandAccepted`` or ``CommandFailed`` carrying the same id, replies
to ``GetStatus`` with a ``StatusReported``, and after ``SubscribeEvents`` pushes events (past
tense) as they happen. These frames never leave the machine (the socket is the user's own,
mode 0600), so they are not signed; they still go through the same strict decoder, because
a crashed or foreign process can write anything to a socket.

Times (``at``) are the node's clock in seconds since the epoch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from protocol.messages import (
    RUN_ID_BYTES, U32, U64, Bool, Bytes, Float, Int, Line, Message, Opt, PeerIdText, Rate, Seconds, Str, Tag,
    UnixTime, Weight, message,
)
from protocol.messages_swarm import PEER_STATES, Fragment, Round

RequestId = U32
"""Chosen by the dashboard; 0 marks a status the node pushed on its own."""
NodeState = Annotated[str, Str(choices=PEER_STATES)]
Loss = Annotated[float, Float(0.0, 1e9)]
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
LOSS_SPLITS = ("train", "heldout")


# ---------------------------------------------------------------------------------------
# Commands: dashboard -> node.


@message(Tag.GET_STATUS)
@dataclass(frozen=True, kw_only=True, slots=True)
class GetStatus(Message):
    """Ask for one ``StatusReported`` snapshot."""

    request_id: RequestId


@message(Tag.SUBSCRIBE_EVENTS)
@dataclass(frozen=True, kw_only=True, slots=True)
class SubscribeEvents(Message):
    """Start receiving events on this connection until it closes."""

    request_id: RequestId


@message(Tag.PAUSE_TRAINING)
@dataclass(frozen=True, kw_only=True, slots=True)
class PauseTraining(Message):
    """Stop computing after the current inner step; stay in the swarm (heartbeats say paused)."""

    request_id: RequestId


@message(Tag.RESUME_TRAINING)
@dataclass(frozen=True, kw_only=True, slots=True)
class ResumeTraining(Message):
    """Resume after a pause; the node syncs state first if it fell behind."""

    request_id: RequestId


@message(Tag.FINISH_AND_STOP)
@dataclass(frozen=True, kw_only=True, slots=True)
class FinishAndStop(Message):
    """Finish the rounds in flight so no contribution is wasted, then leave and exit."""

    request_id: RequestId


@message(Tag.LEAVE_RUN)
@dataclass(frozen=True, kw_only=True, slots=True)
class LeaveRun(Message):
    """Leave now, abandoning rounds in flight, and exit."""

    request_id: RequestId


@message(Tag.UPDATE_SETTINGS)
@dataclass(frozen=True, kw_only=True, slots=True)
class UpdateSettings(Message):
    """Change volunteer limits; a field left ``None`` stays as it is."""

    request_id: RequestId
    max_upload_mbps: Annotated[float | None, Opt(Float(0.0, 1e6))] = None
    """Upload cap in megabits per second; 0 removes the cap."""
    max_download_mbps: Annotated[float | None, Opt(Float(0.0, 1e6))] = None
    only_when_idle: Annotated[bool | None, Opt(Bool())] = None
    only_on_ac_power: Annotated[bool | None, Opt(Bool())] = None
    device: Annotated[str | None, Opt(Str(max_len=32))] = None
    """``cpu``, ``cuda``, ``cuda:1``...; takes effect at the next resume."""
    gpu_memory_fraction: Annotated[float | None, Opt(Float(0.05, 1.0))] = None


# ---------------------------------------------------------------------------------------
# Replies and events: node -> dashboard.


@message(Tag.COMMAND_ACCEPTED)
@dataclass(frozen=True, kw_only=True, slots=True)
class CommandAccepted(Message):
    request_id: RequestId


@message(Tag.COMMAND_FAILED)
@dataclass(frozen=True, kw_only=True, slots=True)
class CommandFailed(Message):
    request_id: RequestId
    reason: Line
    """One line the dashboard shows as is."""


@message(Tag.STATUS_REPORTED)
@dataclass(frozen=True, kw_only=True, slots=True)
class StatusReported(Message):
    """A snapshot of the node for the dashboard's main screen."""

    request_id: RequestId
    at: UnixTime
    run_id: Annotated[bytes, Bytes((0, RUN_ID_BYTES))]
    """b"" before the node has joined a run."""
    run_name: Annotated[str, Str(max_len=64)]
    peer_id: PeerIdText
    state: NodeState
    pause_reason: Line
    """Why the node is paused ("paused by you", "on battery"...), or ""."""
    step: U64
    tokens: U64
    tokens_per_s: Rate
    loss: Annotated[float | None, Opt(Float(0.0, 1e9))]
    heldout_loss: Annotated[float | None, Opt(Float(0.0, 1e9))]
    peers: U32
    """Live peers of the run, this one included."""
    rounds_done: U64
    upload_bps: Rate
    download_bps: Rate
    uptime_s: Seconds
    device: Annotated[str, Str(max_len=64)]
    max_upload_mbps: Annotated[float | None, Opt(Float(0.0, 1e6))]
    max_download_mbps: Annotated[float | None, Opt(Float(0.0, 1e6))]
    only_when_idle: Annotated[bool, Bool()]
    only_on_ac_power: Annotated[bool, Bool()]


@message(Tag.STATE_CHANGED)
@dataclass(frozen=True, kw_only=True, slots=True)
class StateChanged(Message):
    at: UnixTime
    old: NodeState
    new: NodeState
    reason: Line


@message(Tag.PEER_JOINED)
@dataclass(frozen=True, kw_only=True, slots=True)
class PeerJoined(Message):
    at: UnixTime
    peer_id: PeerIdText
    device: Annotated[str, Str(max_len=64)]


@message(Tag.PEER_LEFT)
@dataclass(frozen=True, kw_only=True, slots=True)
class PeerLeft(Message):
    at: UnixTime
    peer_id: PeerIdText
    reason: Line
    """"heartbeat expired", "dropped from round: timed out", "sent an invalid slice"..."""


@message(Tag.FRAGMENT_SYNCED)
@dataclass(frozen=True, kw_only=True, slots=True)
class FragmentSynced(Message):
    """One fragment's all-reduce finished and its outer step was applied."""

    at: UnixTime
    fragment: Fragment
    round: Round
    group_size: Annotated[int, Int(1, 256)]
    contributors: Annotated[int, Int(1, 256)]
    """Members whose slices made it into the average (group_size minus the dropped)."""
    weight: Weight
    duration_s: Seconds
    bytes_sent: U64
    bytes_received: U64


@message(Tag.FRAGMENT_SYNC_FAILED)
@dataclass(frozen=True, kw_only=True, slots=True)
class FragmentSyncFailed(Message):
    """A fragment's round ended without an average; training went on with the local update."""

    at: UnixTime
    fragment: Fragment
    round: Round
    reason: Line


@message(Tag.LOSS_MEASURED)
@dataclass(frozen=True, kw_only=True, slots=True)
class LossMeasured(Message):
    at: UnixTime
    step: U64
    split: Annotated[str, Str(choices=LOSS_SPLITS)]
    loss: Loss


@message(Tag.LOG_RECORDED)
@dataclass(frozen=True, kw_only=True, slots=True)
class LogRecorded(Message):
    """A log line of the node, for the dashboard's log panel."""

    at: UnixTime
    level: Annotated[str, Str(choices=LOG_LEVELS)]
    logger: Annotated[str, Str(max_len=128)]
    text: Annotated[str, Str(max_len=4096, multiline=True)]
