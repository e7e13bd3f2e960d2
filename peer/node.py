"""A swarm peer: trains with the engine and averages fragments with other peers.

One process, two threads. The main thread runs the plain training loop of ``peer.worker``;
the network thread (``peer.network``) runs hivemind's P2P and DHT, the matchmaker and the
averager. When fragment p's sync starts after step s, its pseudo-gradient is handed to the
network thread and training goes on; after step s + tau the node waits for the average only
if it is late, and measures that wait (``waited_s``). A sync whose group never formed or
whose all-reduce failed lands the node's *own* pseudo-gradient, so a lone or cut-off peer
keeps training on its own outer steps (and is counted in ``syncs_alone``).

The node also serves its control socket (``peer.control``): status, events for the dashboard,
and the volunteer's commands. Pause lands the syncs in flight, writes a checkpoint and drops
the model (freeing the accelerator), and keeps announcing itself as paused, so no group waits
for it; resume rebuilds the model from the checkpoint, catches up with the swarm if it moved
on (and says how many local steps that dropped), and trains on. Finish-then-stop trains to
the end of the current round, contributes it and exits. The volunteer's settings
(``protocol.settings``) apply at once where they can: bandwidth caps, threads, schedule.

Rounds are counted per fragment from the schedule: round r of fragment p starts after step
``offset_p + r*H``. Peers meet in matchmaking by (fragment, round), so peers that train at
similar speed average together; a much slower peer finds no group and averages alone.
"""

from __future__ import annotations

import asyncio
import datetime
import fcntl
import gc
import hashlib
import json
import logging
import os
import signal
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from collections.abc import Callable

import torch

from peer.allreduce import Averager
from peer import conditions, paths
from peer.checkpoint import CheckpointError, NonFiniteState, checkpoint_exists, load_checkpoint, save_checkpoint
from peer.control import CommandError, ControlError, ControlServer
from peer.credit import CreditLedger
from peer.data import DataError, ShardSampler, heldout_batches, load_corpus
from peer.identity_store import load_or_create_identity
from peer.matchmaking import Matchmaker
from peer.model import Transformer
from peer.network import Network, NetworkConfig, NetworkError
from peer.presence import Presence, RunNotFound
from peer.ratelimit import RateLimiter, mbps_to_bytes_per_s
from peer.settings_store import load_settings, save_settings
from peer.globalstate import StateSyncError, apply, choose_digest, snapshot
from peer.sync_pipeline import InFlight, SyncPipeline
from peer.statesync import StateServer, current_indexes, fetch_state
from peer.worker import Worker, evaluate, pick_device
from protocol.butterfly import slice_bounds
from protocol.identity import peer_id_from_public_key
from protocol import __version__
from protocol.errors import ConfigError, ProtocolError
from protocol.manifest import RunAddress, SignedManifest, open_manifest
from protocol.messages import Message
from protocol.messages_control import (
    FinishAndStop, FragmentSynced, FragmentSyncFailed, LeaveRun, LogRecorded, LossMeasured, PauseTraining, PeerJoined,
    PeerLeft, PeerUpdated, ResumeTraining, StateChanged, UpdateSettings,
)
from protocol.messages_swarm import Heartbeat, RunAdvertised
from protocol.settings import Settings, parse_settings, render_settings

log = logging.getLogger("peer.node" if __name__ == "__main__" else __name__)  # also under python -m

# Fault injection for the swarm tests, e.g. "die-after-group:0:1": SIGKILL ourselves right after
# joining our first group of fragment 0 at round 1 or later (a loaded machine may average a round
# alone), so the others see a member vanish mid all-reduce.
_FAULT = os.environ.get("SWARMSTREAM_FAULT", "")


def _fault_due(fragment: int, round_: int) -> bool:
    kind, _, where = _FAULT.partition(":")
    if kind != "die-after-group":
        return False
    f, _, r = where.partition(":")
    return fragment == int(f) and round_ >= int(r)


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


@dataclass(slots=True)
class NodeStats:
    rounds: list[int] = field(default_factory=list)
    bytes_sent: int = 0
    bytes_received: int = 0
    syncs: int = 0
    syncs_alone: int = 0
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
    losses: deque[tuple[int, float]] = field(default_factory=lambda: deque(maxlen=1000))
    heldout: deque[tuple[int, float]] = field(default_factory=lambda: deque(maxlen=1000))
    traffic: deque[tuple[float, int, int]] = field(default_factory=lambda: deque(maxlen=256))
    """(time, bytes sent, bytes received) after each sync, for the dashboard's rates."""
    step_times: deque[float] = field(default_factory=lambda: deque(maxlen=50))


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


class _LogToControl(logging.Handler):
    """Forwards the node's INFO and louder log records to the dashboard as LogRecorded."""

    def __init__(self, node: Node):
        super().__init__(logging.INFO)
        self.node = node

    def emit(self, record: logging.LogRecord) -> None:
        try:
            text = "".join(c if c.isprintable() or c == "\n" else "?" for c in record.getMessage())[:4096]
            msg = LogRecorded(at=record.created, level=record.levelname, logger=record.name[:128], text=text)
            self.node._log_history.append(msg)  # a dashboard that attaches later sees it too
            self.node._emit(msg)
        except Exception:  # a log line must never break the node
            pass


class Node:
    def __init__(self, cfg: NodeConfig, *, manifest_bytes: bytes | None = None, run_id: bytes | None = None,
                 on_event: Callable[[dict], None] | None = None):
        if manifest_bytes is None and run_id is None:
            raise ValueError("a node needs a manifest or a run ID")
        self.cfg = cfg
        self.on_event = on_event or (lambda event: None)
        self.settings = load_settings(cfg.settings_path) if cfg.settings_path else Settings()
        self.identity = load_or_create_identity(cfg.identity_path)
        self._lock_fd = lock_identity(cfg.identity_path)
        self.stop_event = threading.Event()
        self._wake = threading.Event()  # pauses and waits end early on a command
        self.stats = NodeStats()
        self._state = "joining"
        self.started_at = time.time()
        self.worker: Worker | None = None
        self.sampler: Any = None
        self.ledger: CreditLedger | None = None
        self.signed: SignedManifest | None = None
        # what the volunteer asked for (set from the control thread, read by the training thread)
        self._user_paused = False
        self._pause_reason = CONFIRM_REASON if self._awaiting_confirm() else ""
        self._finish_requested = False
        self._leave_requested = False
        self._settings_changed = True
        self._progress: tuple[float, str] | None = None
        self._loop_t0 = 0.0  # when the training loop started (perf_counter)
        self._pipeline: SyncPipeline | None = None  # the fragment syncs in flight (run() makes it)
        # what the dashboard sees on subscribing
        self._peers: dict[bytes, Heartbeat] = {}
        self._peers_future: Any = None
        self._reconnecting: Any = None
        self._relay_routes: dict[str, list[str]] = {}  # peer ID -> its circuit addresses (peers behind NAT)
        self._recent: deque[Message] = deque(maxlen=300)
        self._loss_history: deque[Message] = deque(maxlen=400)
        self._log_history: deque[Message] = deque(maxlen=200)
        self.upload_limiter, self.download_limiter = RateLimiter(), RateLimiter()
        self._apply_caps()
        self._maddrs: list[str] = []  # our dialable addresses (status reads them from the first request on)
        self.control: ControlServer | None = None
        self._log_handler: logging.Handler | None = None
        try:
            if cfg.control_path is not None:
                self.control = ControlServer(cfg.control_path, self)
                self.control.start()
                self._log_handler = _LogToControl(self)
                logging.getLogger().addHandler(self._log_handler)
            self.net = Network(NetworkConfig(identity_path=str(cfg.identity_path), host_maddrs=cfg.host_maddrs,
                                             initial_peers=cfg.initial_peers, announce_maddrs=cfg.announce_maddrs,
                                             reachability=cfg.reachability))
        except BaseException:
            self._release()
            raise
        try:
            assert self.net.dht is not None and self.net.p2p is not None
            self.presence = Presence(self.net.dht, self.identity)
            if manifest_bytes is not None:
                self.signed = open_manifest(manifest_bytes, run_id=run_id)
                self.manifest_bytes = manifest_bytes
            else:
                self.signed, self.manifest_bytes = self.net.call(self.presence.fetch_manifest(run_id), timeout=60)
            self.run_id = self.signed.run_id
            self.net.call(self.presence.publish_manifest(self.manifest_bytes, self.run_id), timeout=30)
            swarm = self.signed.manifest.swarm
            self.averager = Averager(self.net.p2p, self.identity, self.run_id, upload=self.upload_limiter,
                                     download=self.download_limiter)
            self.averager.reconnect = self._reconnect_relayed
            self.net.call(self.averager.start(), timeout=30)
            self.matchmaker = Matchmaker(self.net.dht, self.identity, self.run_id, swarm)
            self.state_server = StateServer(self.net.p2p, self.identity, self.run_id,
                                            chunk_bytes=swarm.state_chunk_bytes)
            self.net.call(self.state_server.start(), timeout=30)
            self.ledger = CreditLedger(self.cfg.data_dir / self.signed.run_id_text / "credit.json")
            self.state_digest = b""
            self._publishing = None
            self._alone_this_round = False  # averaged alone since our last full round
            self._repair_due = False  # the last full round had a lone sync: compare with the majority
            self._caught_up = False  # joined the swarm's state (or found nobody ahead); until then lag 1
            self._sync_started_at: list[int] = []  # step of each fragment's latest contribution
            self._maddrs = self.net.visible_maddrs()
        except BaseException:
            self.net.close()
            self._release()
            raise

    # --- state, events, the control socket ----------------------------------------------

    @property
    def state(self) -> str:
        return self._state

    @state.setter
    def state(self, new: str) -> None:
        old, self._state = self._state, new
        if new != old:
            reason = self._pause_reason if new == "paused" else ""
            self._emit(StateChanged(at=time.time(), old=old, new=new, reason=reason))
            self.on_event({"event": "state", "state": new, "reason": reason})

    def _emit(self, msg: Message) -> None:
        if self.control is not None:
            self.control.publish(msg)

    def _remember(self, msg: Message) -> None:
        self._recent.append(msg)
        self._emit(msg)

    def join_address(self) -> str:
        """The address others paste into ``swarmstream join``: the run ID and our dialable
        addresses (others' loopback is not ours, so loopback only when there is nothing else)."""
        maddrs = [m for m in self._maddrs if "/p2p-circuit" not in m] or list(self._maddrs)
        outside = [m for m in maddrs if not m.startswith(("/ip4/127.", "/ip6/::1/"))]
        return str(RunAddress(self.run_id, tuple((outside or maddrs)[:4])))

    def reachability(self) -> str:
        if not self._maddrs:
            return "unreachable"
        return "relayed" if any("/p2p-circuit" in m for m in self._maddrs) else "direct"

    def status(self) -> dict[str, Any]:
        """The fields of the control socket's StatusReported (called from its thread)."""
        w, st = self.worker, self.stats
        c = self.ledger.credit if self.ledger else None
        now = time.monotonic()
        up = down = 0.0
        recent = [t for t in st.traffic if now - t[0] <= 60.0]
        if len(recent) >= 2:
            (t0, s0, r0), (t1, s1, r1) = recent[0], recent[-1]
            if t1 > t0:
                up, down = (s1 - s0) / (t1 - t0), (r1 - r0) / (t1 - t0)
        progress = self._progress
        return dict(
            at=time.time(), run_id=self.signed.run_id if self.signed else b"",
            run_name=self.signed.manifest.name if self.signed else "", peer_id=self.identity.peer_id,
            state=self._reported_state(),
            pause_reason=self._pause_reason if self._reported_state() in ("paused", "pausing") else "",
            step=w.step if w else self._last_step(), tokens=c.tokens_trained if c else 0,
            tokens_per_s=self._tokens_per_s(),
            loss=st.losses[-1][1] if st.losses else None, heldout_loss=st.heldout[-1][1] if st.heldout else None,
            peers=len(self._peers) + 1, rounds_done=min(st.rounds, default=0), upload_bps=up * 8,
            download_bps=down * 8, uptime_s=time.time() - self.started_at, device=self._device_name(),
            reachability=self.reachability(),
            inner_step_s=sum(st.step_times) / len(st.step_times) if st.step_times else 0.0,
            progress=progress[0] if progress else None, progress_label=progress[1] if progress else "",
            settings_path=str(self.cfg.settings_path or ""), settings_toml=render_settings(self.settings),
            tokens_contributed=c.tokens_contributed if c else 0,
            fragments_contributed=c.fragments_contributed if c else 0,
            fragments_alone=c.fragments_alone if c else 0, rounds_joined=c.rounds_joined if c else 0,
            steps_dropped=c.steps_dropped if c else 0,
            join_address=self.join_address() if self._maddrs else "",
            total_steps=self.signed.manifest.train.inner.total_steps if self.signed else 0,
            awaiting_confirm=self._awaiting_confirm())

    def _tokens_per_s(self) -> float:
        """Tokens per second of training time (time blocked on the network included, pauses
        not), not per second of compute: a step slowed by a shared core or a wait lowers it."""
        if self.worker is None or self.state == "paused" or not self._loop_t0:
            return 0.0
        training_s = time.perf_counter() - self._loop_t0 - self.stats.paused_s
        return self.stats.tokens / training_s if training_s > 0 else 0.0

    def _last_step(self) -> int:
        return self._paused_step if hasattr(self, "_paused_step") else 0

    def _device_name(self) -> str:
        w = self.worker
        if w is None:
            return "released (paused)" if self.state == "paused" else ""
        if w.device.type == "cuda":
            return f"cuda {torch.cuda.get_device_name(w.device)}"[:64]
        return str(w.device)

    def command(self, msg: Message) -> None:
        """A volunteer's command from the control socket (runs on its thread)."""
        if isinstance(msg, PauseTraining):
            if self._user_paused:
                raise CommandError("already paused; resume with `swarmstream resume` or p in the dashboard")
            if self._finish_requested or self.stop_event.is_set():
                raise CommandError("the node is finishing; it will stop after this round")
            self._user_paused, self._pause_reason = True, "paused by you"  # status says pausing until it lands
        elif isinstance(msg, ResumeTraining):
            if self._awaiting_confirm():
                self._confirm()  # resuming a node that never started is the volunteer's go-ahead
            elif not self._user_paused:
                why = f" (it waits: {self._pause_reason})" if self.state == "paused" else ""
                raise CommandError(f"not paused by you{why}")
            self._user_paused, self._pause_reason = False, ""
        elif isinstance(msg, FinishAndStop):
            self._finish_requested = True
        elif isinstance(msg, LeaveRun):
            self._leave_requested = True
            self.stop_event.set()
        elif isinstance(msg, UpdateSettings):
            try:
                new = parse_settings(msg.settings_toml, where="the new settings")
                if self.cfg.settings_path is not None:
                    save_settings(self.cfg.settings_path, new)
            except (ConfigError, OSError) as e:
                raise CommandError(str(e)) from None
            self.settings = new
            if not self._awaiting_confirm() and self._pause_reason == CONFIRM_REASON:
                self._pause_reason = ""  # confirmed through the settings (the dashboard's first-run dialog)
            self._apply_caps()
            self._settings_changed = True
            log.info("settings updated path=%s", self.cfg.settings_path)
        else:
            raise CommandError(f"{type(msg).__name__} is not a command this node takes")
        self._wake.set()

    def _reported_state(self) -> str:
        """The state the volunteer sees: ``pausing`` from the pause command until the loop has
        landed what was in flight. Derived, never stored: only the training thread sets state."""
        if self._user_paused and self._state in ("training", "averaging", "syncing"):
            return "pausing"
        return self._state

    def _awaiting_confirm(self) -> bool:
        """A first run started with --wait-for-confirm trains only once the volunteer agreed.
        The settings file is the one record of that agreement, shared by node and dashboard."""
        return self.cfg.wait_for_confirm and not self.settings.client.confirmed

    def _confirm(self) -> None:
        new = self.settings.replace(client_confirmed=True)
        if self.cfg.settings_path is not None:
            try:
                save_settings(self.cfg.settings_path, new)
            except OSError as e:
                raise CommandError(f"could not save the confirmation to {self.cfg.settings_path}: {e.strerror}") from None
        self.settings = new
        log.info("the volunteer confirmed contributing; saved client.confirmed=true path=%s", self.cfg.settings_path)

    def snapshot_events(self) -> list[Message]:
        now = time.time()
        rows = [self._peer_row(k, hb, now) for k, hb in list(self._peers.items())]
        return list(self._loss_history) + list(self._log_history) + list(self._recent) + rows

    def _peer_row(self, key: bytes, hb: Heartbeat, now: float) -> PeerUpdated:
        return PeerUpdated(at=now, peer_id=peer_id_from_public_key(key), state=hb.state, device=hb.device,
                           tokens=hb.tokens, tokens_per_s=hb.tokens_per_s, rounds_done=min(hb.rounds, default=0),
                           last_seen_at=hb.sent_at)

    def _apply_caps(self) -> None:
        net = self.settings.network
        self.upload_limiter.set_rate(mbps_to_bytes_per_s(net.max_upload_mbps))
        self.download_limiter.set_rate(mbps_to_bytes_per_s(net.max_download_mbps))

    def _refresh_peers(self, swarm) -> None:
        """Diff the run's live peers against the last view (without blocking training: the DHT
        read runs on the network thread and is picked up at the next heartbeat)."""
        fut = self._peers_future
        if fut is not None and fut.done():
            try:
                live = fut.result()
            except Exception as e:
                log.info("could not read the peers reason=%r", e)
                live = None
            if live is not None:
                self._update_peers(live)
            self._peers_future = None
        if self._peers_future is None:
            self._peers_future = self.net.submit(self.presence.peers(self.run_id, swarm.heartbeat_ttl_s))
        if not self._peers and (self._reconnecting is None or self._reconnecting.done()):
            self._reconnecting = self.net.submit(self.net.reconnect())  # alone: maybe we lost the network

    def _update_peers(self, live: dict[bytes, Heartbeat]) -> None:
        """Take a read of the run's heartbeats as the new view. A peer leaves the view when its
        last heartbeat expires, not when one read misses it: a DHT read under load can come back
        short or empty, and that is no reason to show every peer as gone."""
        now = time.time()
        ttl = self.signed.manifest.swarm.heartbeat_ttl_s if self.signed else 0.0
        live = {k: hb for k, hb in live.items() if k != self.identity.public_key}
        for k, hb in self._peers.items():
            if k not in live and now - hb.sent_at <= ttl:
                live[k] = hb  # not in this read, but its last heartbeat is still fresh
        for k in self._peers.keys() - live.keys():
            self._remember(PeerLeft(at=now, peer_id=peer_id_from_public_key(k), reason="heartbeat expired"))
        for k, hb in live.items():
            if k not in self._peers:
                self._remember(PeerJoined(at=now, peer_id=peer_id_from_public_key(k), device=hb.device))
            self._emit(self._peer_row(k, hb, now))
        # peers nobody can dial, and the relays that reach them (not through ourselves)
        me = f"/p2p/{self.identity.peer_id}/p2p-circuit"
        self._relay_routes = {peer_id_from_public_key(k): [m for m in hb.maddrs if "/p2p-circuit" in m and me not in m]
                              for k, hb in live.items() if not hb.reachable}
        self._peers = live

    async def _reconnect_relayed(self, peer_id: str) -> bool:
        """The averager could not open a stream to ``peer_id``: if it is behind a NAT, connect
        to it through its relays. Only on such a failure: dialing circuits on every heartbeat
        put libp2p dial backoffs on the relays and dropped group members."""
        routes = self._relay_routes.get(peer_id)
        if not routes:
            return False
        ok = await self.net.connect_relayed(peer_id, routes)
        log.info("%s peer=%s through its relays", "connected to" if ok else "could not reach", peer_id)
        return ok

    def _conditions_reason(self) -> str:
        sched = self.settings.schedule
        if not (sched.window or sched.only_on_ac_power or sched.only_when_idle):
            return ""
        now = datetime.datetime.now()
        mains = conditions.on_mains_power() if sched.only_on_ac_power else None
        idle = conditions.user_idle_s() if sched.only_when_idle else None
        if sched.only_on_ac_power and mains is None or sched.only_when_idle and idle is None:
            if not getattr(self, "_told_unsupported", False):
                self._told_unsupported = True
                log.warning("this machine does not tell whether it is %s; that setting is not enforced",
                            "on mains power" if mains is None and sched.only_on_ac_power else "idle")
        return conditions.pause_reason(sched, now.hour * 60 + now.minute, mains, idle)

    # --- the loop --------------------------------------------------------------------------

    def _build_worker(self) -> None:
        """The model, optimizers and sample stream on the chosen device, from the checkpoint if
        there is one (at start, and on resume after a pause released the accelerator)."""
        train = self.signed.manifest.train
        compute = self.settings.compute
        device = pick_device(self.cfg.device or compute.device)
        if device.type == "cuda" and compute.gpu_memory_fraction < 1.0:
            torch.cuda.set_per_process_memory_fraction(compute.gpu_memory_fraction, device)
        if self._corpus is None:
            self._corpus = load_corpus(train.data, train.model.vocab_size)
        # bf16 autocast where the GPU supports it: the inner steps are ~2x faster, and the outer
        # state (fragments, pseudo-gradients) stays fp32 either way
        bf16 = device.type == "cuda" and torch.cuda.is_bf16_supported()
        worker = Worker(train, device=device, bf16=bf16)
        sampler = ShardSampler(self._corpus.train, train.model.seq_len, train.inner.batch_size, train.data.seed,
                               self.identity.public_key)
        rounds = [0] * len(worker.outer)
        if checkpoint_exists(self._ckpt):
            try:
                rounds = load_checkpoint(self._ckpt, worker, sampler, run_id=self.run_id)
                log.info("resumed from checkpoint path=%s step=%d rounds=%s", self._ckpt, worker.step, rounds)
                self.on_event({"event": "resumed", "step": worker.step, "rounds": rounds})
            except CheckpointError:
                raise  # main() says it in one line; nothing was changed
        self.worker, self.sampler = worker, sampler
        self.stats.rounds = rounds
        self._sync_started_at = [worker.step] * len(worker.outer)

    def _release_worker(self) -> None:
        """Write a checkpoint and drop the model: the accelerator's memory goes back to the OS."""
        assert self.worker is not None
        self._save()
        self._paused_step = self.worker.step
        device = self.worker.device
        self.worker = self.sampler = None
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()

    def _save(self) -> None:
        self._progress = (0.0, "writing a checkpoint")
        try:
            save_checkpoint(self._ckpt, self.worker, self.sampler, run_id=self.run_id, rounds=self.stats.rounds)
        except NonFiniteState as e:
            # never over a good checkpoint: keep it, and take the swarm's state at the next
            # chance (a repair compares our digest with what the other peers vouch for)
            log.error("not saving a checkpoint: %s; the last good one is kept", e)
            self._repair_due = True
        finally:
            self._progress = None

    def _micro_batches(self) -> list:
        """The run's batches for one inner step, split under the volunteer's max_batch_size
        into equal micro-batches (same mean loss and gradient, less memory)."""
        train = self.signed.manifest.train
        batches = [self.sampler.next_batch() for _ in range(train.inner.grad_accum)]
        cap = self.settings.compute.max_batch_size
        b = train.inner.batch_size
        if not cap or cap >= b:
            return batches
        size = max(d for d in range(1, cap + 1) if b % d == 0)
        return [(x[i:i + size], y[i:i + size]) for x, y in batches for i in range(0, b, size)]

    def _apply_settings(self) -> None:
        self._settings_changed = False
        threads = self.settings.compute.cpu_threads
        if threads:
            torch.set_num_threads(threads)

    def _pause_wanted(self) -> str:
        if self._awaiting_confirm():
            return CONFIRM_REASON
        if self._user_paused:
            return self._pause_reason or "paused by you"
        return self._conditions_reason()

    def _pause(self, pipeline: SyncPipeline, swarm) -> None:
        """Land what is in flight (contributed, never dropped), release the accelerator, and
        stay announced as paused until resumed or stopped; then rebuild and catch up."""
        for sync in pipeline.drain():
            self._land(sync, swarm)
        self._release_worker()
        self.state = "paused"
        log.info("paused reason=%s", self._pause_reason)
        self._wake.clear()
        while not self.stop_event.is_set() and not self._finish_requested:
            self._beat(swarm)
            self._refresh_peers(swarm)
            reason = self._pause_wanted()
            if not reason:
                break
            self._pause_reason = reason
            self._wake.wait(swarm.heartbeat_interval_s)
            self._wake.clear()
        if self.stop_event.is_set() or self._finish_requested:
            self._build_worker()  # exit with the model loaded: the summary evaluates it
            return
        self.state = "syncing"
        self._build_worker()
        self._check_agreement(swarm, joining=True)  # the run may have moved on while we were away
        self.state = "training"
        log.info("resumed step=%d rounds=%s", self.worker.step, self.stats.rounds)

    def run(self) -> dict:
        """Train until stopped (``stop()``, Ctrl+C, a command, or ``max_rounds``); returns the summary."""
        train = self.signed.manifest.train
        swarm = self.signed.manifest.swarm
        self._ckpt = self.cfg.data_dir / self.signed.run_id_text / "checkpoint"
        self._corpus = None
        self._build_worker()
        worker = self.worker
        self._wait_for_peers(swarm)
        self._check_agreement(swarm, joining=True)  # late join, restart: catch up first
        pipeline = self._pipeline = SyncPipeline(worker.schedule)
        last_beat = last_ckpt = 0.0
        finish_at: int | None = None
        t_start = self._loop_t0 = time.perf_counter()
        self.state = "training"
        while not self.stop_event.is_set():
            if self._settings_changed:
                self._apply_settings()
            if finish_at is None and self._finish_requested:
                finish_at = min(self.stats.rounds) + 1
                self.state = "finishing"
                log.info("finishing: stopping after round %d", finish_at - 1)
            reason = self._pause_wanted() if finish_at is None else ""
            if reason:
                self._pause_reason = reason
                t_pause = time.perf_counter()
                self._pause(pipeline, swarm)
                self.stats.paused_s += time.perf_counter() - t_pause
                if self.stop_event.is_set():
                    break
                if self._finish_requested:
                    break  # paused when asked to finish: nothing is in flight, so we are done
                worker, last_beat = self.worker, 0.0
                continue
            t0 = time.perf_counter()
            loss = worker.forward_backward(self._micro_batches())
            worker.optimizer_step()
            dt = time.perf_counter() - t0
            self.stats.inner_s += dt
            self.stats.step_times.append(dt)
            step = worker.step
            tokens = train.inner.batch_size * train.inner.grad_accum * train.model.seq_len
            self.ledger.record_trained(tokens)
            self.stats.tokens += tokens
            if step % 10 == 0:
                self.stats.losses.append((step, loss))
                ev = LossMeasured(at=time.time(), step=step, split="train", loss=max(0.0, min(loss, 1e9)))
                self._loss_history.append(ev)
                self._emit(ev)
            for p, r in pipeline.starts(step):
                delta, weight = worker.begin_sync(p)
                self._sync_started_at[p] = step
                pipeline.start(p, r, step, (self.net.submit(self._average(p, r, delta, weight)), delta, weight))
                if self.state == "training":
                    self.state = "averaging"
            for sync in pipeline.due(step):  # what is in flight decides, so a sync landed early by a pause is gone
                self._land(sync, swarm)
                self._publish_state(worker)
                if sync.fragment == len(worker.outer) - 1:  # the last fragment landed: a full round
                    self._full_round(worker, last_ckpt)
                    if time.monotonic() - last_ckpt >= self.cfg.checkpoint_every_s:
                        last_ckpt = time.monotonic()
                        self._save()
            if not pipeline and self.state == "averaging":
                self.state = "training"
            now = time.monotonic()
            if now - last_beat >= swarm.heartbeat_interval_s:
                last_beat = now
                self._beat(swarm)
                self._refresh_peers(swarm)
                if not pipeline:  # between rounds: nothing of ours is in flight
                    self._check_agreement(swarm)
                    worker = self.worker
                self.stats.checks_s += time.monotonic() - now  # the loop waited on the swarm for all of it
            if self.cfg.max_rounds is not None and min(self.stats.rounds) >= self.cfg.max_rounds:
                break
            if finish_at is not None and min(self.stats.rounds) >= finish_at:
                break
        self.state = "leaving" if self._leave_requested else "finishing"
        if self._leave_requested:  # leave now: the rounds in flight are abandoned, and we say so
            for sync in pipeline.abandon():
                sync.handle[0].cancel()
                log.warning("left the run: the sync of fragment %d round %d was abandoned", sync.fragment, sync.round)
                self.ledger.record_sync(0, acknowledged=False)
        for sync in pipeline.finish():  # contribute what was started; never drop it silently
            self._land(sync, swarm)
        worker = self.worker
        self._save()
        self.ledger.save()
        wall = time.perf_counter() - t_start
        heldout = self._evaluate(worker)
        return {
            "peer": self.identity.peer_id, "steps": worker.step, "tokens": worker.tokens,
            "rounds": min(self.stats.rounds) if self.stats.rounds else 0,
            "heldout_loss": heldout, "bytes_sent": self.stats.bytes_sent,
            "bytes_received": self.stats.bytes_received, "syncs": self.stats.syncs,
            "syncs_alone": self.stats.syncs_alone, "dropped_peers": self.stats.dropped_peers,
            "waited_s": round(self.stats.waited_s, 3), "checks_s": round(self.stats.checks_s, 3),
            "blocked_s": round(self.stats.waited_s + self.stats.checks_s, 3),
            "paused_s": round(self.stats.paused_s, 3), "inner_s": round(self.stats.inner_s, 3),
            "wall_s": round(wall, 3), "global_digest": global_digest(worker),
            "allreduce_s": [round(x, 3) for x in list(self.stats.allreduce_s)[-50:]],
        }

    def _evaluate(self, worker: Worker) -> float:
        """Held-out loss of the global model."""
        train = self.signed.manifest.train
        eval_model = Transformer(train.model).to(worker.device)
        eval_model.load_state_dict(worker.global_state())
        held = heldout_batches(self._corpus.heldout, train.model.seq_len, train.inner.batch_size,
                               self.cfg.eval_batches)
        return evaluate(eval_model, held, worker.device)

    def _full_round(self, worker: Worker, last_ckpt: float) -> None:
        # a repair still due is kept until a peer at our rounds was compared with (at the first
        # check after a round, the others' heartbeats may not show that round yet)
        self._repair_due, self._alone_this_round = self._repair_due or self._alone_this_round, False
        self.ledger.record_round()
        every = self.cfg.eval_every_rounds
        if every and min(self.stats.rounds) % every == 0:
            loss = self._evaluate(worker)
            self.stats.heldout.append((worker.step, loss))
            ev = LossMeasured(at=time.time(), step=worker.step, split="heldout", loss=max(0.0, min(loss, 1e9)))
            self._loss_history.append(ev)
            self._emit(ev)

    async def _average(self, fragment: int, round_: int, delta: torch.Tensor, weight: float):
        """Form a group for (fragment, round) and all-reduce; None means average alone."""
        codec = self.signed.manifest.train.sync.codec
        delay = await self.matchmaker.align_delay(fragment, round_, delta.numel())
        if delay > 0:  # we are ahead of peers we missed last round: meet them this time
            log.info("waiting to meet peers that reach this round later fragment=%d round=%d delay_s=%.2f",
                     fragment, round_, delay)
            await asyncio.sleep(delay)
        group = await self.matchmaker.form_group(fragment, round_, float(weight), delta.numel(), codec)
        if group is None:
            return None
        if _fault_due(fragment, round_):  # tests: vanish mid-round, as with kill -9
            os.kill(os.getpid(), signal.SIGKILL)
        outcome = await self.averager.allreduce(group, delta, float(weight))
        # A slice whose reducer failed has no agreed mean. Keep that slice of the *global* copy
        # where it was (a zero averaged delta): every surviving member does the same, so they
        # still hold bit-identical global copies. (Using each member's own delta there would
        # make them diverge, with no majority to repair from.)
        bounds = slice_bounds(delta.numel(), len(group.members))
        for part in outcome.fallback_parts:
            start, end = bounds[part]
            outcome.average[start:end] = 0.0
        return outcome, len(group.members)

    def _land(self, sync: InFlight, swarm) -> None:
        worker = self.worker
        fragment, round_ = sync.fragment, sync.round
        fut, delta, weight = sync.handle
        t0 = time.perf_counter()
        reason = ""
        try:
            result = fut.result(timeout=swarm.matchmaking_timeout_s + swarm.allreduce_timeout_s + 30)
            if result is None:
                reason = "no group formed: averaged alone"
        except Exception as e:  # a failed round must not stop training: average alone
            log.warning("sync failed fragment=%d round=%d reason=%r; applying own update", fragment, round_, e)
            result, reason = None, f"all-reduce failed: {e!r}"
        waited = time.perf_counter() - t0
        self.stats.waited_s += waited
        self.stats.syncs += 1
        outcome = None if result is None else result[0]
        if outcome is None:
            self.stats.syncs_alone += 1
            self._alone_this_round = True
            avg = delta
            self._remember(FragmentSyncFailed(at=time.time(), fragment=fragment, round=round_, reason=reason[:256]))
        else:
            avg = outcome.average
            if outcome.dropped or outcome.partial_parts:  # members that timed out on each other (we
                self._alone_this_round = True  # or another) may land different averages: compare after
            self.stats.bytes_sent += outcome.bytes_sent
            self.stats.bytes_received += outcome.bytes_received
            self.stats.dropped_peers += len(outcome.dropped)
            self.stats.allreduce_s.append(outcome.elapsed_s)
            size = result[1]
            self._remember(FragmentSynced(
                at=time.time(), fragment=fragment, round=round_, group_size=size,
                contributors=max(1, size - len(outcome.dropped)), weight=float(weight),
                duration_s=outcome.elapsed_s, waited_s=waited, bytes_sent=outcome.bytes_sent,
                bytes_received=outcome.bytes_received))
        self.stats.traffic.append((time.monotonic(), self.stats.bytes_sent, self.stats.bytes_received))
        # a fragment's weight counts every token since its last sync, and each of the P fragments
        # carries those same tokens for its 1/P of the model: credit 1/P of them per fragment
        self.ledger.record_sync(int(weight) // len(worker.outer), acknowledged=outcome is not None)
        worker.apply_outer(fragment, avg)
        self.stats.rounds[fragment] = round_ + 1
        last_loss = self.stats.losses[-1][1] if self.stats.losses else float("nan")
        self.on_event({"event": "synced", "fragment": fragment, "round": round_, "step": worker.step,
                       "alone": outcome is None, "dropped": 0 if outcome is None else len(outcome.dropped),
                       "group_size": 1 if result is None else result[1],
                       "digest": hashlib.sha256(worker.outer[fragment].global_flat.numpy().tobytes()).hexdigest()[:16],
                       "train_loss": round(last_loss, 4)})
        log.info("fragment synced fragment=%d round=%d alone=%s", fragment, round_, outcome is None)

    def _wait_for_peers(self, swarm) -> None:
        if self.cfg.min_peers <= 1:
            return
        deadline = time.monotonic() + self.cfg.min_peers_wait_s
        self._beat(swarm)
        last_beat = time.monotonic()
        while not self.stop_event.is_set() and time.monotonic() < deadline:
            live = self.net.call(self.presence.peers(self.run_id, swarm.heartbeat_ttl_s), timeout=30)
            self._update_peers(live)
            if len(live) >= self.cfg.min_peers:
                return
            if time.monotonic() - last_beat >= swarm.heartbeat_interval_s:
                self._beat(swarm)
                last_beat = time.monotonic()
            self.stop_event.wait(0.5)  # poll the DHT; Ctrl+C ends the wait at once
        log.warning("started with fewer peers than min_peers=%d after %.0f s", self.cfg.min_peers,
                    self.cfg.min_peers_wait_s)

    def _check_agreement(self, swarm, *, joining: bool = False) -> None:
        """Catch up or repair. Download the state that peers vouch for if it is ahead of ours
        (when joining, by any round; while training, by two or more, since peers in lockstep
        differ by one for a moment after each round), then start our schedule where they are.
        Or, if at our rounds more peers vouch for another state than for ours (we averaged
        alone or with a minority), download theirs and keep our step. Nobody diverges silently."""
        peers = self.net.call(self.presence.peers(self.run_id, swarm.heartbeat_ttl_s), timeout=30)
        self._update_peers(peers)
        peers.pop(self.identity.public_key, None)
        mine = min(self.stats.rounds, default=0)
        # behind by one round counts when joining, before our first download, or after we
        # averaged alone (we are the straggler); in lockstep, peers differ by one for a moment
        lag = 1 if joining or not self._caught_up or self._repair_due else 2
        ahead = {k: hb.state_digest for k, hb in peers.items()
                 if hb.state_digest and min(hb.rounds, default=0) >= mine + lag}
        choice = choose_digest(ahead)
        if choice is not None:
            log.info("peers are ahead of round %d; downloading their state", mine)
            self._download(swarm, choice[1], peers, fast_forward=True)
            return
        if joining and not ahead:
            self._caught_up = True  # nobody is ahead of us: we start in step with the swarm
        if not (self.state_digest and self._repair_due):
            return  # peers in other groups differ from us by design; their averages mix next rounds
        same = {k: hb.state_digest for k, hb in peers.items()
                if hb.state_digest and tuple(hb.rounds) == tuple(self.stats.rounds)}
        same[self.identity.public_key] = self.state_digest
        # the most vouched-for state wins; a tie goes to the smallest digest, the same choice on
        # every peer, so two peers that each averaged alone converge on one of their states
        if len(same) == 1:
            return  # nobody's heartbeat shows our rounds yet: compare at a later check
        choice = choose_digest(same, min_vouchers=1)
        if choice is None or choice[0] == self.state_digest:
            self._repair_due = False  # ours is the state to keep
            return
        ours = sum(1 for d in same.values() if d == self.state_digest)
        self._repair_due = False
        if len(choice[1]) >= ours:
            log.warning("global state differs from %d peers at rounds %s; downloading theirs",
                        len(choice[1]), self.stats.rounds)
            # fast-forward: take their next landing and start right before their next sync, so
            # we are back in step with them in time too, not only in state
            self._download(swarm, choice[1], peers, fast_forward=True)

    def _current_state(self, swarm, donors: list[str], newer_than: tuple[int, ...] | None = None,
                       wait_s: float = 0.0) -> tuple[bytes, list[str], tuple[int, ...]]:
        """The digest of the state that the most of ``donors`` serve now (two or more of them when
        two or more answer), the donors serving it, and its rounds. With ``newer_than``, poll up to
        ``wait_s`` seconds for a state past those rounds (the swarm's next landing)."""
        deadline = time.monotonic() + wait_s
        attempt = 0
        while True:
            served = self.net.call(current_indexes(self.net.p2p, self.identity, self.run_id, donors,
                                                   timeout_s=swarm.state_chunk_timeout_s),
                                   timeout=swarm.state_chunk_timeout_s + 10)
            by_digest: dict[bytes, list[str]] = {}
            for donor, (digest, _) in served.items():
                by_digest.setdefault(digest, []).append(donor)
            if not by_digest:
                raise StateSyncError(f"none of {len(donors)} donors answered with a state index")
            digest, serving = max(by_digest.items(), key=lambda kv: (len(kv[1]), sum(served[kv[1][0]][1].rounds)))
            rounds = tuple(served[serving[0]][1].rounds)
            agreed = len(serving) >= min(2, len(served))
            if agreed and (newer_than is None or sum(rounds) > sum(newer_than)):
                return digest, serving, rounds
            attempt += 1
            # donors caught mid-landing serve two consecutive states for a moment; or we wait
            # for the round in flight to land
            if attempt >= STATE_INDEX_ATTEMPTS and time.monotonic() >= deadline:
                raise StateSyncError(f"donors disagree on the state ({len(by_digest)} different ones)"
                                     if not agreed else "the swarm did not land a new round in time")
            if self.stop_event.wait(0.25):
                raise StateSyncError("stopped")

    def _download(self, swarm, vouchers: list[bytes], peers: dict, *, fast_forward: bool) -> None:
        """Download the global state that the most of ``vouchers`` serve now and load it. To catch
        up (``fast_forward``), take the state of the swarm's *next* landing: the swarm is already
        matching peers for the round in flight, and a state from before it would always leave us
        one round late. We idle for at most one round, then start in step with everyone."""
        worker = self.worker
        previous = self.state
        self.state = "syncing"
        t0 = time.perf_counter()
        try:
            donors = [peer_id_from_public_key(v) for v in vouchers]
            digest, serving, rounds = self._current_state(swarm, donors)
            if fast_forward:
                digest, serving, rounds = self._current_state(
                    swarm, serving, newer_than=rounds, wait_s=swarm.matchmaking_timeout_s + swarm.allreduce_timeout_s)
            self.on_event({"event": "syncing_state", "donors": len(serving)})
            label = f"downloading the global state from {len(serving)} peers"
            self._progress = (0.0, label)

            def progress(done: int, total: int) -> None:  # on the network thread; the dashboard polls it
                self._progress = (done / total if total else 1.0, label)

            state = self.net.call(fetch_state(self.net.p2p, self.identity, self.run_id, serving, digest,
                                              chunk_timeout_s=swarm.state_chunk_timeout_s, progress=progress),
                                  timeout=swarm.state_chunk_timeout_s * 8 + 60)
        except (StateSyncError, NetworkError) as e:
            log.warning("state sync failed reason=%s; training from round %s", e, self.stats.rounds)
            self.state = previous if previous != "joining" else "training"
            return
        finally:
            self._progress = None
        if fast_forward:
            # what we trained since our latest contribution is replaced by the swarm's state:
            # say so, and count it in the ledger (nothing is dropped silently)
            dropped = worker.step - min(self._sync_started_at, default=worker.step)
            if dropped > 0:
                log.warning("dropped %d local inner steps trained since our last contribution: the run moved on "
                            "to rounds %s while we were away", dropped, list(state.rounds))
                self.ledger.record_dropped(dropped)
        if self._pipeline is not None:
            self._pipeline.rebase()  # refuses with syncs in flight: a landing would apply to the replaced copy
        apply(worker, state)
        self.stats.rounds = list(state.rounds)
        self.state_digest = digest
        self._caught_up, self._repair_due = True, False
        if fast_forward:
            # the donors just landed this state and train toward the next sync its rounds imply:
            # start right before it, so our next step meets them in that round's matchmaking
            sched = worker.schedule
            next_sync = min(sched.offset(p) + r * sched.inner_steps for p, r in enumerate(state.rounds))
            worker.step = max(state.step, next_sync - 1)
            self._sync_started_at = [worker.step] * len(worker.outer)
        else:
            worker.step = max(worker.step, state.step)
        self.state = previous if previous != "joining" else "training"
        self.on_event({"event": "state_synced", "rounds": list(state.rounds), "step": worker.step,
                       "seconds": round(time.perf_counter() - t0, 3)})

    def _publish_state(self, worker: Worker) -> None:
        """Serve the global state as of this landing and vouch for it. Peers that averaged in the
        same groups land the same fragments in the same order, so they serve identical states
        (and digests) at each landing; a joiner gets the swarm's newest state, not the last
        full round's."""
        state = snapshot(worker, self.stats.rounds)
        self._publishing = self.net.submit(self.state_server.publish(state))

    def _beat(self, swarm) -> None:
        if self._publishing is not None and self._publishing.done():
            try:
                self.state_digest = self._publishing.result()
            except Exception as e:
                log.warning("could not serve the global state reason=%r", e)
            self._publishing = None
        now = time.time()
        w = self.worker
        step = w.step if w else self._last_step()
        tput = self._tokens_per_s()
        try:
            # behind a NAT, our listening addresses are no use to anyone: we are reached
            # through the relays we hold reservations on
            self._maddrs = (self.net.relay_maddrs() if self.cfg.reachability == "private"
                            else self.net.visible_maddrs())
        except Exception as e:
            log.info("could not read our addresses reason=%r", e)
        hb = Heartbeat(run_id=self.run_id, sent_at=now, state=self.state, step=step,
                       tokens=self.ledger.credit.tokens_trained, tokens_per_s=tput, rounds=tuple(self.stats.rounds),
                       state_digest=self.state_digest, reachable=self.reachability() == "direct",
                       maddrs=tuple(self._maddrs)[:8], client=f"swarmstream/{__version__}",
                       device=self._device_name() or "none")
        self.net.submit(self.presence.announce(hb, swarm.heartbeat_ttl_s))
        ad = RunAdvertised(run_id=self.run_id, sent_at=now, name=self.signed.manifest.name,
                           num_params=self.signed.manifest.train.model.num_params(), peers=len(self._peers) + 1,
                           step=step)
        self.net.submit(self.presence.advertise(ad, swarm.heartbeat_ttl_s))

    def stop(self) -> None:
        self.stop_event.set()

    def close(self) -> None:
        for part in (self.averager, self.state_server):
            try:
                self.net.call(part.shutdown(), timeout=5)
            except Exception as e:
                log.warning("shutdown was not clean part=%s reason=%r", type(part).__name__, e)
        self.net.close()
        self._release()

    def _release(self) -> None:
        """Close the control socket and drop the identity lock (also when __init__ failed)."""
        if self._log_handler is not None:
            logging.getLogger().removeHandler(self._log_handler)
            self._log_handler = None
        if self.control is not None:
            self.control.close()
            self.control = None
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None


def install_signal_handlers(node: Node) -> None:
    """First Ctrl+C (or SIGTERM): finish the current step, contribute, checkpoint, exit.
    A second one exits at once."""
    def handler(signum, frame):
        if node.stop_event.is_set():
            raise KeyboardInterrupt
        print("swarmstream: stopping after this step (Ctrl+C again to quit now)", file=sys.stderr, flush=True)
        node.stop()

    signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGTERM, handler)


def main(argv: list[str] | None = None) -> int:
    """``python -m peer.node``: one headless node (used by ``swarmstream join`` and ``demo``)."""
    import argparse

    from peer.logs import init_logging

    ap = argparse.ArgumentParser(prog="python -m peer.node")
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--manifest", type=Path, help="a signed .swarmrun file (starts or joins its run)")
    src.add_argument("--address", help="a run address swarmstream:RUN_ID@MULTIADDR")
    ap.add_argument("--identity", type=Path, required=True)
    ap.add_argument("--data-dir", type=Path, required=True)
    ap.add_argument("--listen", default="/ip4/0.0.0.0/tcp/0")
    ap.add_argument("--initial-peers", nargs="*", default=[])
    ap.add_argument("--device", help="cpu, cuda, cuda:N, mps, auto (default: the settings file's)")
    ap.add_argument("--rounds", type=int)
    ap.add_argument("--min-peers", type=int, default=1, help="wait until this many peers are live")
    ap.add_argument("--checkpoint-every", type=float, default=120.0, help="seconds (0: every full round)")
    ap.add_argument("--control", type=Path, default=None,
                    help=f"the control socket to serve (default {paths.control_path()}; 'none' for none)")
    ap.add_argument("--settings", type=Path, default=None, help=f"settings file (default {paths.settings_path()})")
    ap.add_argument("--reachability", choices=("auto", "public", "private"), default="auto",
                    help="auto: libp2p finds out; public: this machine has a dialable address (bootstrap "
                         "and relay peers); private: behind a NAT with no inbound connections (reached "
                         "through relays on the bootstrap peers)")
    ap.add_argument("--wait-for-confirm", action="store_true",
                    help="start paused until the volunteer confirms in the dashboard (first run)")
    ap.add_argument("--eval-every", type=int, default=1, help="held-out loss every N full rounds (0: never)")
    ap.add_argument("--log-level")
    args = ap.parse_args(argv)
    init_logging(args.log_level)
    try:
        return _run_node(args)
    except KeyboardInterrupt:  # a second Ctrl+C: out at once; the last checkpoint stays as it was
        print("swarmstream: stopped at once (second Ctrl+C); the round in flight is not contributed, "
              "the last checkpoint is kept", file=sys.stderr)
        return 130
    except USER_ERRORS as e:
        print(f"swarmstream: error: {one_line(e)}", file=sys.stderr)
        return 2


# What a volunteer can fix (a key file, an address, a run ID, a checkpoint, a port in use):
# said in one line, exit code 2, no traceback.
USER_ERRORS = (NodeAlreadyRunning, ControlError, ProtocolError, RunNotFound, NetworkError, CheckpointError,
               DataError, OSError)


def one_line(e: BaseException) -> str:
    if isinstance(e, OSError) and e.filename is not None:
        return f"{e.strerror or type(e).__name__}: {e.filename}"
    text = " ".join(str(e).split())
    return text or type(e).__name__


def _run_node(args) -> int:
    from protocol.manifest import parse_run_address

    initial = list(args.initial_peers)
    manifest_bytes = run_id = None
    if args.manifest:
        manifest_bytes = read_manifest_file(args.manifest)
    else:
        addr = parse_run_address(args.address)
        run_id, initial = addr.run_id, initial + list(addr.bootstrap)
    control = None if str(args.control) == "none" else (args.control or paths.control_path())
    cfg = NodeConfig(identity_path=args.identity, data_dir=args.data_dir, host_maddrs=(args.listen,),
                     initial_peers=tuple(initial), device=args.device, max_rounds=args.rounds,
                     checkpoint_every_s=args.checkpoint_every, min_peers=args.min_peers, control_path=control,
                     settings_path=args.settings or paths.settings_path(), wait_for_confirm=args.wait_for_confirm,
                     reachability=args.reachability, eval_every_rounds=args.eval_every)

    def print_event(ev: dict) -> None:
        try:
            print(json.dumps(ev), flush=True)
        except BrokenPipeError:  # whoever read our events is gone; the node trains on
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())

    node = Node(cfg, manifest_bytes=manifest_bytes, run_id=run_id, on_event=print_event)
    try:
        install_signal_handlers(node)
        print_event({"event": "listening", "peer": node.identity.peer_id, "maddrs": node.net.visible_maddrs(),
                     "run_id": node.signed.run_id_text, "address": node.join_address()})
        summary = node.run()
        print_event({"event": "summary", **summary})
    finally:
        node.close()
    return 0


def read_manifest_file(path: Path) -> bytes:
    """A run manifest file's bytes (a signed ``.swarmrun``), refusing what cannot be one."""
    from protocol.messages import MAX_HEAD_BYTES

    if not path.is_file():
        raise ConfigError(f"{path} is not a manifest file; create one with `swarmstream run new`")
    if path.stat().st_size > MAX_HEAD_BYTES:
        raise ConfigError(f"{path} is {path.stat().st_size:,} bytes, too large for a run manifest")
    return path.read_bytes()


if __name__ == "__main__":
    raise SystemExit(main())
