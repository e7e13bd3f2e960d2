"""What a node is configured with and counts, its identity lock, and test fault injection."""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from peer.shards import SHARD_TARGET
from peer.worker import Worker

log = logging.getLogger("peer.node")  # one logger name for the whole node, also under python -m


# Fault injection for the swarm tests, e.g. "die-after-group:0:1": SIGKILL ourselves right after
# joining our first group of fragment 0 at round 1 or later (a loaded machine may average a round
# alone), so the others see a member vanish mid all-reduce. "alone:1:3": join no group for
# fragment 1's round 3 (average it alone, as a member cut off under load does).
_FAULT = os.environ.get("SWARMSTREAM_FAULT", "")


def _fault_at(kind: str, fragment: int, round_: int, *, exact: bool = False) -> bool:
    k, _, where = _FAULT.partition(":")
    if k != kind:
        return False
    f, _, r = where.partition(":")
    return fragment == int(f) and (round_ == int(r) if exact else round_ >= int(r))


def _fault_due(fragment: int, round_: int) -> bool:
    return _fault_at("die-after-group", fragment, round_)


def _fault_alone(fragment: int, round_: int) -> bool:
    return _fault_at("alone", fragment, round_, exact=True)


CONFIRM_REASON = "waiting for you to confirm in the dashboard (or `swarmstream resume`)"


STATE_INDEX_ATTEMPTS = 4  # asks of the donors' current index before giving up on a state download


@dataclass(kw_only=True, slots=True)
class NodeConfig:
    identity_path: Path
    """The volunteer's key file (libp2p format); its peer ID is the node's."""
    data_dir: Path
    """Where checkpoints go (one folder per run)."""
    host_maddrs: tuple[str, ...] = ("/ip4/0.0.0.0/tcp/0",)
    initial_peers: tuple[str, ...] = ()
    announce_maddrs: tuple[str, ...] = ()
    device: str | None = None
    """cpu, cuda, mps, auto; None: the volunteer's settings say."""
    max_rounds: int | None = None
    """Stop after this many rounds of every fragment (None: train until stopped)."""
    checkpoint_every_s: float = 120.0
    """Write a checkpoint at the first full round after this many seconds (0: every full round)."""
    eval_batches: int = 8
    eval_every_rounds: int = 1
    """Measure the held-out loss of the global model every this many full rounds (0: never)."""
    min_peers: int = 1
    """Wait (announced, not training) until this many peers of the run are live, so a swarm
    that starts together averages from its first round. Gives up after ``min_peers_wait_s``."""
    min_peers_wait_s: float = 120.0
    control_path: Path | None = None
    """The control socket to serve (None: none)."""
    settings_path: Path | None = None
    """The volunteer's settings file (None: the defaults, not persisted)."""
    reachability: str = "auto"
    """auto, public or private (see ``peer.network.NetworkConfig.reachability``)."""
    wait_for_confirm: bool = False
    """Start paused until the volunteer confirms, if the settings say they have not yet."""
    replicas: Any = None
    """Rank 0's handle on the other processes of a multi-device node (``peer.node.replicas``)."""
    shard_target: int = SHARD_TARGET
    """Heartbeats per DHT shard of the run's presence (``peer.shards``); small values, for
    tests and benchmarks, make a few peers behave as a large run does."""


@dataclass(slots=True)
class NodeStats:
    rounds: list[int] = field(default_factory=list)
    bytes_sent: int = 0
    bytes_received: int = 0
    syncs: int = 0
    syncs_alone: int = 0  # no group formed, or the all-reduce failed: applied our own update
    syncs_failed: int = 0  # of those, the all-reduce failed
    dropped_peers: int = 0
    waited_s: float = 0.0
    """Training blocked at a landing step on a sync's result (matchmaking + all-reduce not hidden by tau)."""
    checks_s: float = 0.0
    """Training blocked on the swarm between steps: peer lookups, agreement checks, state downloads."""
    paused_s: float = 0.0
    inner_s: float = 0.0
    tokens: int = 0  # trained by this process (a restart starts again at 0)
    inner_steps: int = 0
    allreduce_s: deque[float] = field(default_factory=lambda: deque(maxlen=1000))
    """Latency of the latest all-reduces (bounded: a node runs for weeks)."""
    settle_s: float = 0.0  # after the last round, comparing final copies with the other finishers
    steps_skipped: int = 0  # steps our counter moved on without training, to keep up with the swarm (peer.pace)
    late_steps: deque[int] = field(default_factory=lambda: deque(maxlen=1000))
    """Steps past its landing step (s + tau) at which each sync landed: its result came late and
    the node trained on (``sync_pipeline.late_allowance``)."""
    waits: deque[tuple[int, int, float]] = field(default_factory=lambda: deque(maxlen=1000))  # (fragment, round, s)
    losses: deque[tuple[int, float]] = field(default_factory=lambda: deque(maxlen=1000))
    heldout: deque[tuple[int, float]] = field(default_factory=lambda: deque(maxlen=1000))
    traffic: deque[tuple[float, int, int]] = field(default_factory=lambda: deque(maxlen=256))
    """(time, bytes sent, bytes received) after each sync, for the dashboard's rates."""
    step_times: deque[float] = field(default_factory=lambda: deque(maxlen=50))
    cycle_times: deque[float] = field(default_factory=lambda: deque(maxlen=50))  # a step and the rest after it


def global_digest(worker: Worker) -> str:
    """SHA-256 over the global copy of every fragment: equal on peers that agree bit for bit."""
    h = hashlib.sha256()
    for frag in worker.outer:
        h.update(frag.global_flat.numpy().tobytes())
    return h.hexdigest()


class NodeAlreadyRunning(Exception):
    """Another node holds this identity (or this control socket)."""


def lock_identity(identity_path: Path) -> int:
    """Hold an exclusive lock next to the key file for the life of this process: two nodes
    with one identity would be one peer ID in two places, and the swarm would mix them up."""
    lock_path = Path(str(identity_path) + ".lock")
    lock_path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "another process"
        os.close(fd)
        raise NodeAlreadyRunning(f"a swarmstream node already runs with the identity {identity_path} "
                                 f"(pid {holder}); stop it with `swarmstream stop`, or pass another --identity") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, str(os.getpid()).encode(), 0)
    return fd
