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
    RUN_ID_BYTES, U32, U64, Bool, Bytes, DecodeError, Float, Int, InvalidMessage, Line, Message, Opt, PeerIdText, Rate,
    Seconds, Seq, Str, Tag,
    UnixTime, Weight, decode, encode, message,
)
from protocol.messages_swarm import PEER_STATES, Fragment, Round

RequestId = U32
"""Chosen by the dashboard; 0 marks a status the node pushed on its own."""
MAX_BANS_SHOWN = 32
"""Bans a status lists (each line at most 400 characters: it fits a control frame)."""
NODE_STATES = (*PEER_STATES, "pausing")
"""A node's states as the control socket reports them: a peer's, and ``pausing`` (a pause was
asked for; the syncs in flight land first). Heartbeats say ``averaging`` then."""
NodeState = Annotated[str, Str(choices=NODE_STATES)]
Loss = Annotated[float, Float(0.0, 1e9)]
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
LOSS_SPLITS = ("train", "heldout")
REACHABILITY = ("unknown", "direct", "relayed", "unreachable")
SettingsText = Annotated[str, Str(max_len=8192, multiline=True)]
"""A settings file's TOML text (``protocol.settings``)."""


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
    """Replace the volunteer's settings (the whole file, as ``protocol.settings`` renders it).
    The node validates them, writes the file atomically, and applies what it can at once
    (bandwidth caps, threads, schedule); the device applies at the next resume."""

    request_id: RequestId
    settings_toml: SettingsText


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
    reachability: Annotated[str, Str(choices=REACHABILITY)]
    inner_step_s: Seconds
    """Mean wall time of the latest inner steps."""
    progress: Annotated[float | None, Opt(Float(0.0, 1.0))]
    """Progress of long work (a state download, a checkpoint write), or None."""
    progress_label: Line
    settings_path: Annotated[str, Str(max_len=4096)]
    settings_toml: SettingsText
    # the credit ledger (peer.credit): what we gave and what the swarm took
    tokens_contributed: U64
    """Tokens behind pseudo-gradients that made it into a group's average."""
    fragments_contributed: U64
    """Fragment syncs whose average included our slices (acknowledged by the group)."""
    fragments_alone: U64
    """Fragment syncs that found no group or failed: applied locally, not acknowledged."""
    rounds_joined: U64
    steps_dropped: U64
    """Inner steps trained and then dropped because the run moved on (we were told so)."""
    # Fields added later have defaults, so a dashboard reads a node that predates them
    # (protocol.messages: a sender may leave off the defaulted tail). New fields go below.
    join_address: Annotated[str, Str(max_len=4096)] = ""
    """What others paste into ``swarmstream join`` to join this run through this node ("" while
    the node has not joined a run yet)."""
    total_steps: U64 = 0
    """The run's step target (its manifest's ``train.inner.total_steps``): with ``step`` and
    ``inner_step_s`` it gives the progress and an ETA. 0: unknown (no run yet, or an older node)."""
    awaiting_confirm: Annotated[bool, Bool()] = False
    """The node waits for the volunteer's go-ahead (a first run); ``ResumeTraining`` gives it."""
    banned: Annotated[tuple[str, ...], Seq(Str(max_len=400), max_len=MAX_BANS_SHOWN)] = ()
    """Peers this node banned from the run for a proven lie, each as ``<peer ID> <reason>``
    (the newest ``MAX_BANS_SHOWN``; the evidence is in the data dir, ``peer.bans``)."""


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


@message(Tag.PEER_UPDATED)
@dataclass(frozen=True, kw_only=True, slots=True)
class PeerUpdated(Message):
    """A row of the peers table, from a peer's latest heartbeat (our own included)."""

    at: UnixTime
    peer_id: PeerIdText
    state: NodeState
    device: Annotated[str, Str(max_len=64)]
    tokens: U64
    """Tokens this peer trained in the run: its contribution."""
    tokens_per_s: Rate
    rounds_done: U64
    last_seen_at: UnixTime
    """When its heartbeat was sent (its clock)."""
    banned: Line = ""
    """Why this node banned the peer (a proven lie, ``peer.bans``), or ""."""


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
    waited_s: Seconds
    """How long training waited for this result (0 when it landed within tau steps)."""
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


# ---------------------------------------------------------------------------------------
# Framing on the socket: a 4-byte big-endian length, then one encoded message.

FRAME_HEADER_BYTES = 4
MAX_CONTROL_FRAME = 64 << 10
"""Largest control frame; a status with its settings text is about 10 KB."""
COMMANDS = (GetStatus, SubscribeEvents, PauseTraining, ResumeTraining, FinishAndStop, LeaveRun, UpdateSettings)
EVENTS = (StatusReported, StateChanged, PeerJoined, PeerLeft, PeerUpdated, FragmentSynced, FragmentSyncFailed,
          LossMeasured, LogRecorded)


def frame(msg: Message) -> bytes:
    body = encode(msg)
    if len(body) > MAX_CONTROL_FRAME:
        raise InvalidMessage(f"a {type(msg).__name__} of {len(body)} bytes is over the control frame limit")
    return len(body).to_bytes(FRAME_HEADER_BYTES, "big") + body


def frame_length(header: bytes) -> int:
    """The body length a frame header announces; refuses one over the limit before reading it."""
    n = int.from_bytes(header, "big")
    if n > MAX_CONTROL_FRAME:
        raise DecodeError(f"control frame of {n} bytes announced; the limit is {MAX_CONTROL_FRAME}")
    return n


def unframe(body: bytes) -> Message:
    return decode(body, max_size=MAX_CONTROL_FRAME)
