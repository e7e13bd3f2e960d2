"""A swarm peer: trains with the engine and averages fragments with other peers.

One process, two threads. The main thread runs the plain training loop of ``peer.worker``;
the network thread (``peer.network``) runs hivemind's P2P and DHT, the matchmaker and the
averager. When fragment p's sync starts after step s, its pseudo-gradient is handed to the
network thread and training goes on; after step s + tau the node lands the average if it is
there; if not, with tau >= 1 it trains on for a few steps more (``sync_pipeline.late_allowance``:
its group's last member may be that far behind), then waits for it, and measures that wait
(``waited_s``); with tau = 0 it waits at once. The last member is spared that far behind:
within that many steps of a round that half its group's other members started, it starts it
with them, skipping the rest (``_keep_pace``). A sync whose group never formed or
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

import logging
import math
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from peer.allreduce import Averager
from peer.bans import Bans
from peer.signed_groups import SignedGroups
from peer.control import ControlServer
from peer.credit import CreditLedger
from peer.identity_store import load_or_create_identity
from peer.matchmaking import Matchmaker
from peer.network import Network, NetworkConfig
from peer.node.catchup import CatchUpMixin
from peer.node.config import (
    _FAULT,
    CONFIRM_REASON,
    NodeConfig,
    NodeStats,
    lock_identity,
)
from peer.node.peers import PeersMixin
from peer.node.settle import SettleMixin
from peer.node.syncs import SyncMixin
from peer.node.volunteer import VolunteerMixin, _LogToControl
from peer.node.worker_state import WorkerStateMixin
from peer.metrics import MetricsServer
from peer.node.faults import make_ghost, make_liar, make_staller, parse_lies, parse_stall
from peer.pace import SwarmClock
from peer.presence import Presence
from peer.ratelimit import RateLimiter
from peer.settings_store import load_settings
from peer.statesync import StateServer
from peer.sync_pipeline import InFlight, SyncPipeline, late_allowance
from peer.worker import Worker
from protocol.identity import public_key_from_peer_id
from protocol.manifest import SignedManifest, open_manifest
from protocol.messages import Message
from protocol.messages_control import (
    LossMeasured,
    StateChanged,
)
from protocol.messages_swarm import Heartbeat
from protocol.settings import Settings

log = logging.getLogger("peer.node")  # one logger name for the whole node, also under python -m

DONOR_SESSIONS = 4  # state downloads we serve at once, one per peer (peer.state_server)


class Node(VolunteerMixin, PeersMixin, SettleMixin, CatchUpMixin, SyncMixin, WorkerStateMixin):
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
        self.bans: Bans | None = None
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
        self._partners: dict[bytes, float] = {}  # key -> when (monotonic) it last averaged with us
        self._presence_level = 0  # of our shards of the run's presence (peer.shards), as last logged
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
            self.presence = Presence(self.net.dht, self.identity, shard_target=cfg.shard_target)
            if manifest_bytes is not None:
                self.signed = open_manifest(manifest_bytes, run_id=run_id)
                self.manifest_bytes = manifest_bytes
            else:
                self.signed, self.manifest_bytes = self.net.call(self.presence.fetch_manifest(run_id), timeout=60)
            self.run_id = self.signed.run_id
            self.net.call(self.presence.publish_manifest(self.manifest_bytes, self.run_id), timeout=30)
            swarm = self.signed.manifest.swarm
            train = self.signed.manifest.train
            self.averager = Averager(self.net.p2p, self.identity, self.run_id, upload=self.upload_limiter,
                                     download=self.download_limiter, clip=train.sync.clip, gate=train.sync.gate,
                                     max_weight=train.max_sync_tokens(), audit=train.sync.audit)
            self.averager.reconnect = self._reconnect_relayed
            if lies := parse_lies(_FAULT):  # the swarm tests' lying peer (peer.node.faults)
                make_liar(self.averager, lies)
            if stall := parse_stall(_FAULT):  # and their starved one
                make_staller(self.averager, *stall)
            self.net.call(self.averager.start(), timeout=30)
            self.matchmaker = Matchmaker(self.net.dht, self.identity, self.run_id, swarm,
                                         max_weight=train.max_sync_tokens())
            self.matchmaker.expected = self._expected_joiners
            self.matchmaker.quiet = self.averager.quiet.__contains__  # no slice for them in groups we lead
            if "ghost" in lies:  # the swarm tests' ghost (peer.node.faults)
                make_ghost(self.matchmaker, self.averager, lead="nolead" not in lies)
            self.state_server = StateServer(self.net.p2p, self.identity, self.run_id,
                                            chunk_bytes=swarm.state_chunk_bytes, max_concurrent=DONOR_SESSIONS)
            self.net.call(self.state_server.start(), timeout=30)
            self.ledger = CreditLedger(self.cfg.data_dir / self.signed.run_id_text / "credit.json")
            self.bans = Bans(self.cfg.data_dir / self.signed.run_id_text / "bans", self.run_id, train.sync.clip,
                              train.sync.gate)
            self.bans.load()
            self.averager.signed_groups = SignedGroups(self.cfg.data_dir / self.signed.run_id_text / "signed_groups")
            self.averager.banned = self.bans.peer_ids  # one set: a ban holds from the next round on
            self.matchmaker.distrusted.ban_all(public_key_from_peer_id(b.peer_id) for b in self.bans.items())
            self.averager.audits.distrust = self.matchmaker.distrusted  # its verdicts come on the network thread
            self.averager.audits.proof_of = self.bans.evidence  # handed on to a banned member's groups
            self.state_digest = b""
            self.state_rounds: tuple[int, ...] = ()  # the rounds state_digest is at
            self._publishing: list = []  # (rounds, lineage, future) of each state being published, oldest first
            # our digest at each of our latest landings since the last lone one or download
            # (same lineage), to compare with peers' heartbeats at whichever rounds they show
            self._digests: dict[tuple[int, ...], bytes] = {}
            self._lineage = 0
            self._alone_this_round = False  # averaged alone since our last full round
            self._repair_due = False  # the last full round had a lone sync: compare with the majority
            self._compare_only = False  # the repair due is a comparison only: no lone landing, not behind
            self._repair_tries = 0  # checks at which the donors of a due repair were not at our rounds
            self._tie_waits = 0  # checks at which a repair's tie waited for a peer on its way to break it
            self._trusted = frozenset({self.signed.manifest.creator})  # its word on the state is enough alone
            self._refused_claims: set[bytes] = set()  # state digests claimed ahead by too few peers
            self._anchors: dict[bytes, tuple[float, int]] = {}  # key -> (when, wall time; our rounds' sum) it last averaged with us
            self._doubted: set[tuple[bytes, int]] = set()  # (key, rounds' sum) of far-ahead claims we did not believe
            self._caught_up = False  # joined the swarm's state (or found nobody ahead); until then lag 1
            self._in_step_at = -math.inf  # wall time we last knew it (CatchUpMixin._in_step)
            self._paused_at = -math.inf  # wall time our last pause began
            self._sync_started_at: list[int] = []  # step of each fragment's latest contribution
            self._clock = SwarmClock(swarm.heartbeat_interval_s, train.tokens_per_step())  # the swarm's pace (peer.pace)
            self._maddrs = self.net.visible_maddrs()
            metrics = self.settings.metrics
            self.metrics = MetricsServer(self, metrics.address, metrics.port) if metrics.port else None
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

    # --- the loop --------------------------------------------------------------------------

    def _pause_wanted(self) -> str:
        if self._awaiting_confirm():
            return CONFIRM_REASON
        if self._user_paused:
            return self._pause_reason or "paused by you"
        return self._conditions_reason()

    def _pause(self, pipeline: SyncPipeline, swarm) -> None:
        """Land what is in flight (contributed, never dropped), release the accelerator, and
        stay announced as paused until resumed or stopped; then rebuild and catch up."""
        self._start_forming_now(pipeline)
        for sync in pipeline.drain():
            self._land(sync, swarm)
        self._release_worker()
        self._paused_at = time.time()
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
        late = late_allowance(worker.schedule, train.sync.late_share)
        last_beat = last_ckpt = 0.0
        finish_at: int | None = None
        last_round = self.cfg.max_rounds  # the round count we stop at (finish or max_rounds), if any
        tokens = train.tokens_per_step()
        t_start = self._loop_t0 = time.perf_counter()
        self.state = "training"
        while not self.stop_event.is_set():
            if self._settings_changed:
                self._apply_settings()
            if finish_at is None and self._finish_requested:
                finish_at = min(self.stats.rounds) + 1
                self.state = "finishing"
                log.info("finishing: stopping after round %d", finish_at - 1)
            last_round = min((r for r in (finish_at, self.cfg.max_rounds) if r is not None), default=None)
            if last_round is not None and last_round != pipeline.last_round:
                self._leave_past(pipeline, last_round)
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
            # pipelined matchmaking: join the groups of the syncs that start within the time a
            # group takes to form, so the group is there when the pseudo-gradient is (here, before
            # the step, so that a fresh run's first groups form during its first steps)
            step = worker.step
            self._check_straggling(worker, pipeline)  # the others started a round we are far from
            following = self._following()  # slower than the swarm: join when the others do (peer.pace)
            for p, r, at in pipeline.joins(step, self._lead_steps()):
                # the weight it will carry, capped as begin_sync caps it (more than H steps' worth
                # only after a round started early by a pause)
                planned = min(worker.tokens_since_sync[p] + tokens * (at - step), train.max_sync_tokens())
                follow = None
                if following:  # it starts when its group has formed: what we train until then
                    own, formation = self._own_pace(timed=1) or 1.0, self.matchmaker.formation_s()
                    planned = min(worker.tokens_since_sync[p] + tokens * math.ceil(formation * own),
                                  train.max_sync_tokens())
                    follow = (max(0.5, (at - step) / own - formation), tokens * own)
                pipeline.form(p, r, step, at, self._submit_forming(p, r, planned, follow))
            t0 = time.perf_counter()
            loss = worker.forward_backward(self._micro_batches())
            worker.optimizer_step()
            dt = time.perf_counter() - t0
            self.stats.inner_s += dt
            self.stats.step_times.append(dt)
            self.stats.inner_steps += 1
            duty = self.settings.compute.duty_cycle
            if duty < 1.0:  # the volunteer's share of time training: rest after the step (a command ends it)
                self.stop_event.wait(dt * (1.0 / duty - 1.0))
            self.stats.cycle_times.append(time.perf_counter() - t0)
            step = worker.step
            self.ledger.record_trained(tokens)
            self.stats.tokens += tokens
            if step % 10 == 0:
                self.stats.losses.append((step, loss))
                ev = LossMeasured(at=time.time(), step=step, split="train", loss=max(0.0, min(loss, 1e9)))
                self._loss_history.append(ev)
                self._emit(ev)
            # a node that follows the others (slower than the swarm, peer.pace) started its sync
            # before they did: it trains on until the result is there, rather than wait for it
            # with overlap, any node lands a result when it is there, a few steps late at most
            # (sync_pipeline.late_allowance), rather than wait for the last member of its group
            ready = (lambda sync: sync.handle[0].done()) if following or late else None
            max_late = None if following else late
            for step in self._keep_pace(worker, pipeline, following, late + worker.schedule.overlap if late else 0):
                # what is in flight decides: a sync landed by a pause is gone. Land before a start
                # (a round lands before its fragment's next one starts: a follower may have kept
                # one), and after it (with tau = 0 a sync lands right after it started)
                for when in ("before", "after"):
                    for sync in pipeline.due(step, ready, max_late):
                        self._land(sync, swarm)
                        self._publish_state(worker)
                        if sync.fragment == len(worker.outer) - 1:  # the last fragment landed: a full round
                            self._full_round(worker, last_ckpt)
                            if time.monotonic() - last_ckpt >= self.cfg.checkpoint_every_s:
                                last_ckpt = time.monotonic()
                                self._save()
                    for p, r, forming in pipeline.starts(step) if when == "before" else ():
                        delta, weight = worker.begin_sync(p)
                        self._sync_started_at[p] = step
                        pipeline.start(p, r, step, self._submit_sync(p, r, delta, weight, forming))
                        if self.state == "training":
                            self.state = "averaging"
            if not pipeline.in_flight() and self.state == "averaging":
                self.state = "training"
            now = time.monotonic()
            if now - last_beat >= swarm.heartbeat_interval_s:
                last_beat = now
                self._beat(swarm)
                self._refresh_peers(swarm)
                if not pipeline.in_flight():  # between rounds: nothing of ours is in flight
                    self._check_agreement(swarm)
                    worker = self.worker
                self.stats.checks_s += time.monotonic() - now  # the loop waited on the swarm for all of it
            if self.cfg.max_rounds is not None and min(self.stats.rounds) >= self.cfg.max_rounds:
                break
            if finish_at is not None and min(self.stats.rounds) >= finish_at:
                break
        self.state = "leaving" if self._leave_requested else "finishing"
        if self._leave_requested:  # leave now: the rounds under way are abandoned, and we say so
            for sync in pipeline.abandon():
                sync.handle[0].cancel()
                if isinstance(sync, InFlight):  # a group still forming had nothing of ours yet
                    log.warning("left the run: the sync of fragment %d round %d was abandoned",
                                sync.fragment, sync.round)
                    self.ledger.record_sync(0, acknowledged=False)
        self._start_forming_now(pipeline)  # stopped mid-round: a group formed with us counts on our part
        for sync in pipeline.finish():  # contribute what was started; never drop it silently
            self._land(sync, swarm)
        wall = time.perf_counter() - t_start  # the training loop's (what blocked shares are of)
        if not (self._leave_requested or self.stop_event.is_set()) and last_round is not None \
                and min(self.stats.rounds) >= last_round:
            self._settle_final(swarm)  # the run ends here: end on the copy the other finishers hold
            self.stats.settle_s = time.perf_counter() - t_start - wall
        worker = self.worker
        self._take_verdicts()  # proofs that came after our last landing are saved too
        self._save()
        self.ledger.save()
        return self._summary(worker, wall, self._evaluate(worker))

    @staticmethod
    def _leave_past(pipeline, last_round: int) -> None:
        """We stop after round ``last_round - 1`` (a finish, ``max_rounds``): no later round joins
        or starts (``SyncPipeline.stop_before``), and a group forming for one (joined before a
        finish was asked for) is left now, not started early by the finish, nor followed to by
        ``_keep_pace``; started early, a round that only some finishing peers had joined would
        land on some copies and not on others. Its other members drop us at its deadline."""
        for f in pipeline.stop_before(last_round):
            f.handle[0].cancel()
            log.info("left the forming group of fragment %d round %d: we stop after round %d",
                     f.fragment, f.round, last_round - 1)

    def stop(self) -> None:
        self.stop_event.set()

    def close(self) -> None:
        if getattr(self, "metrics", None) is not None:
            self.metrics.close()
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
